"""Launching nodes (no torch): what the operator and ``gradientmail run`` hand every node.

- ``runspec.py``: the ``GradientMailRun`` model (pydantic), the one source of the CRD.
- ``env.py``: the node environment contract (:class:`NodeEnv`), read by the built-in node
  (``python -m gradientmail.demo.node``) and by users' own scripts.
- ``ranks.py``: a node of ``procsPerNode`` processes: its ranks started with torchrun's
  environment, living and dying together (``gradientmail run``'s nodes, and the pods'
  launcher ``python -m gradientmail.launch.ranks``).
"""
