"""``import gradientmail`` (and its integrations package) never imports a trainer: the
extras are optional, and each costs seconds of import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_gradientmail_imports_no_trainer() -> None:
    code = (
        "import sys, gradientmail as gm, gradientmail.integrations; gm.NodeEnv; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'transformers', 'lightning', 'pytorch_lightning', 'accelerate'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
