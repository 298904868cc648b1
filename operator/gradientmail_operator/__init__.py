"""The GradientMail operator: GradientMailRun resources reconciled into node pods.

Importable as ``gradientmail_operator`` (never as ``operator``, which would shadow the
standard library); ``scripts/install.sh`` installs it from ``operator/``. Files:

- ``crd.py``: renders the CRD YAML from the spec models in ``gradientmail/launch/runspec.py``
  (shared with ``gradientmail run``): ``python -m gradientmail_operator.crd``.
- ``render.py``: pure: the run's prefix and mailbox URL, the node pods (env, security,
  the ranks' launcher for ``procsPerNode`` > 1) and the specs a pod cannot run.
- ``reconcile.py``: pure: from spec, status and pods to a plan (create, delete, phase,
  events); phases and condition reasons.
- ``status.py``: conditions keyed by type; the mailbox's view folded into the status.
- ``kube.py``: the Kubernetes calls the operator makes (and the list RBAC is checked against).
- ``handlers.py``: kopf handlers and timer; run with
  ``kopf run -m gradientmail_operator.handlers --all-namespaces``.
"""
