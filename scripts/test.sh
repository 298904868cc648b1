#!/usr/bin/env bash
# Install everything, then run the whole suite: lint, types, and every test, with real
# SeaweedFS and moto S3 servers started on loopback for the run (and stopped after it).
# Extra arguments go to pytest, e.g. scripts/test.sh -k filesystem
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh

echo "==> ruff"
.venv/bin/ruff check gradientmail operator tests bench examples
.venv/bin/ruff format --check gradientmail operator tests bench examples
echo "==> mypy --strict gradientmail operator"
.venv/bin/mypy
echo "==> pytest (SeaweedFS + moto on loopback)"
exec .venv/bin/python -m tests.support.s3servers -- .venv/bin/python -m pytest "$@"
