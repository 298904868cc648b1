"""The old path of the built-in node and of :class:`NodeEnv`, kept so that pods, images and
scripts written before the demo package moved keep working.

- ``python -m gradientmail.node`` runs :func:`gradientmail.demo.node.main` (the built-in
  node is now ``python -m gradientmail.demo.node``);
- ``gradientmail.node.NodeEnv`` is :class:`gradientmail.launch.env.NodeEnv`, public as
  ``gradientmail.NodeEnv``.

Only the tests of these old paths import this module; new code names the paths above (the
built-in node's other names are in :mod:`gradientmail.demo.node`).
"""

from __future__ import annotations

import sys

from gradientmail.demo.node import main
from gradientmail.launch.env import NodeEnv, NodeEnvError

__all__ = ["NodeEnv", "NodeEnvError", "main"]

if __name__ == "__main__":
    sys.exit(main())
