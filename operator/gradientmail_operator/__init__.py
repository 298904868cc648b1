"""The GradientMail operator: GradientMailRun resources reconciled into node pods.

Importable as ``gradientmail_operator`` (never as ``operator``, which would shadow the
standard library). Files:

- ``spec.py``: the resource's pydantic models, the single source of the CRD schema.
- ``crd.py``: renders the CRD YAML from ``spec.py`` (``python -m gradientmail_operator.crd``).
"""
