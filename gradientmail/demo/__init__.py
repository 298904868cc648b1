"""The built-in node's demo: what ``gradientmail run`` trains and shows when it is given no
command of its own. Not the library: nothing outside this package and the CLI's ``run``
imports it, and ``import gradientmail`` never loads it.

- ``node.py``: the built-in node program (``python -m gradientmail.demo.node``): its tasks
  (``lm``, ``synthetic``), :class:`~gradientmail.demo.node.LmSettings`
  (``GRADIENTMAIL_LM``), the start and done barriers around a Session.
- ``lm.py``: the small byte-level language model and its corpus (the Python standard
  library's sources), shared with the quality benchmark (``bench/_lm.py``); torch at the
  top.
- ``report.py``: what ``gradientmail run`` shows of the LM while and after it trains: the
  aligned model evaluated on a thread (:class:`~gradientmail.demo.report.AlignedEval`),
  the sparklines, ``curves.json``, the PNG and a few generated lines.
- ``plot.py``: the PNG of the loss curves: matplotlib when installed, else a small
  standard-library encoder.

``gradientmail/node.py`` keeps the old paths (``python -m gradientmail.node``,
``gradientmail.node.NodeEnv``) working for pods and scripts written before the move.
"""
