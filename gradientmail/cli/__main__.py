"""``python -m gradientmail.cli``: the ``gradientmail`` command."""

import os
import sys

from gradientmail.cli import main

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.exit(main())
