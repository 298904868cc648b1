"""The ``gradientmail`` command's entry point. It lives outside ``gradientmail.cli``, whose
import already needs the ``[cli]`` extra (rich, pyyaml, pydantic): a missing one is one
line naming the extra, not a traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence

_EXTRA = {"rich", "yaml", "pydantic", "pydantic_core"}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from gradientmail.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _EXTRA:
            raise
        print(
            f"gradientmail: the command needs the [cli] extra ({exc.name} is not installed): "
            "pip install '/path/to/your/gradientmail/checkout[cli]'",
            file=sys.stderr,
        )
        return 2
    return cli_main(argv)
