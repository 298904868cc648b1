"""``scripts/gpu-check.sh`` where there is no GPU: it says so and exits 0, whether the
machine has no NVIDIA device at all (found without importing torch) or has a driver that
this torch cannot use (a CPU build: the probe through torch). The GPU path itself runs on
a GPU machine (``scripts/gpu-check.sh``; ``--cpu`` rehearses its multi-rank run here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def _run(path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path, "PYTHON": sys.executable}  # when there is no .venv
    return subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_without_an_nvidia_device_it_says_so_and_exits_0(tmp_path: Path) -> None:
    if any(Path(p).exists() for p in ("/dev/nvidia0", "/usr/bin/nvidia-smi", "/bin/nvidia-smi")):
        pytest.skip("this machine has an NVIDIA driver: the next test covers it")
    bare = tmp_path / "bin"  # the system's tools, but no nvidia-smi
    bare.mkdir()
    done = _run(f"{bare}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert "gpu-check: no GPU on this machine" in done.stdout, done.stdout
    assert "what ran" not in done.stdout  # no table: nothing ran


def test_a_driver_that_this_torch_cannot_use_is_no_gpu_either(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: a driver without a device torch can use'\n")
    smi.chmod(0o755)
    done = _run(f"{fake}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert "gpu-check: no GPU usable here" in done.stdout, done.stdout
    assert "devices: 0" in done.stdout
