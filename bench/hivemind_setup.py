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
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def run_worker(
    command: list[str], log: Path, wall_s: float, lines: int = 6
) -> tuple[dict[str, Any] | None, str]:
    """Run a hivemind worker; its JSON record (the last ``{`` line of its stdout) and the tail
    of its log, or None and what went wrong. It runs in a session of its own whose process
    group is killed at the end: hivemind's DHT and p2pd processes outlive a killed peer and
    would keep running (and, were stdout a pipe, keep the parent waiting for EOF)."""
    out_path = log.with_suffix(".json")
    with open(log, "w") as err, open(out_path, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
        deadline = time.monotonic() + wall_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            timed_out = proc.poll() is None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    try:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        tail = "(no log)"
    if timed_out:
        return None, f"the hivemind worker ran past {wall_s:.0f} s: {tail}"
    records = [x for x in out_path.read_text().splitlines() if x.startswith("{")]
    if not records:
        return None, f"the hivemind worker exited {proc.returncode} without a result: {tail}"
    record: dict[str, Any] = json.loads(records[-1])
    return record, tail


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
