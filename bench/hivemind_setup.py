"""Create the venv the hivemind reference runs in (hivemind's pins clash with the project's,
so it never goes into ``.venv``):

    .venv/bin/python -m bench.hivemind_setup [--venv build/hivemind-venv]

It runs ``python -m venv`` with this interpreter's Python, then
``pip install torch==<the project's torch> hivemind==1.1.12`` (the hivemind wheel ships its
``p2pd`` daemon; nothing else is downloaded). The suite (``python -m bench``) does the same
on first use, and skips the hivemind reference, with pip's error, when it cannot. Another
venv with hivemind can be named with ``--hivemind-python`` or
``$GRADIENTMAIL_HIVEMIND_PYTHON``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import ROOT, progress

VENV = ROOT / "build" / "hivemind-venv"
HIVEMIND = "hivemind==1.1.12"
ENV_VAR = "GRADIENTMAIL_HIVEMIND_PYTHON"


class Unavailable(RuntimeError):
    """hivemind cannot be run here; the message says why."""


def _torch_pin() -> str:
    try:
        import torch

        return f"torch=={torch.__version__.split('+')[0]}"
    except ImportError:  # pragma: no cover
        return "torch"


def _has_hivemind(python: Path) -> str | None:
    """None when ``python`` imports hivemind, else the reason."""
    try:
        done = subprocess.run(
            [str(python), "-I", "-c", "import hivemind, torch; print(hivemind.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{python}: {exc}"
    if done.returncode != 0:
        return f"{python} cannot import hivemind: {_tail(done.stderr)}"
    return None


def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def create(venv: Path = VENV) -> Path:
    """Create ``venv`` with hivemind in it; return its python, or raise :class:`Unavailable`."""
    python = venv / "bin" / "python"
    if not python.exists():
        progress(f"hivemind: creating {venv}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [sys.executable, "-m", "venv", str(venv)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise Unavailable(f"python -m venv {venv} failed: {_tail(done.stderr)}")
    progress(f"hivemind: pip install {_torch_pin()} {HIVEMIND} into {venv} (a minute or two)")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", _torch_pin(), HIVEMIND],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"pip install {HIVEMIND} timed out after {exc.timeout:.0f} s") from exc
    if done.returncode != 0:
        raise Unavailable(f"pip install {HIVEMIND} failed: {_tail(done.stderr or done.stdout)}")
    reason = _has_hivemind(python)
    if reason:
        raise Unavailable(reason)
    return python


def locate(explicit: str | None = None, *, install: bool = True) -> Path:
    """The Python to run the hivemind worker with: ``explicit``, ``$GRADIENTMAIL_HIVEMIND_
    PYTHON``, or build/hivemind-venv (created when missing and ``install``)."""
    for candidate in (explicit, os.environ.get(ENV_VAR)):
        if candidate:
            python = Path(candidate)
            reason = _has_hivemind(python)
            if reason:
                raise Unavailable(reason)
            return python
    python = VENV / "bin" / "python"
    if python.exists() and _has_hivemind(python) is None:
        return python
    if not install:
        raise Unavailable(f"no hivemind venv at {VENV}; run python -m bench.hivemind_setup")
    return create(VENV)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=VENV)
    args = parser.parse_args()
    try:
        python = create(args.venv)
    except Unavailable as exc:
        print(f"hivemind is not installable here: {exc}", file=sys.stderr)
        return 1
    print(f"hivemind venv ready: {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
