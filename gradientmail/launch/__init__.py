"""Launching nodes (no torch): what the operator and ``gradientmail run`` hand every node.

- ``runspec.py``: the ``GradientMailRun`` model (pydantic), the one source of the CRD.
- ``env.py``: the node environment contract (:class:`NodeEnv`), read by the built-in node
  (``python -m gradientmail.demo.node``) and by users' own scripts.
"""
