#!/usr/bin/env bash
# Install everything, then run the whole suite: lint, types, and every test, with real
# SeaweedFS and moto S3 servers started on loopback for the run (and stopped after it).
# Extra arguments go to pytest, e.g. scripts/test.sh -k filesystem
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh

echo "==> ruff"
.venv/bin/ruff check gradientmail operator tests testbed bench examples
.venv/bin/ruff format --check gradientmail operator tests testbed bench examples
# mypy (~30 CPU-s) runs beside the tests: they leave part of a core idle while they wait on
# processes and stores. Its verdict is printed, and counts, after theirs.
echo "==> mypy --strict gradientmail operator (beside the tests; its result follows theirs)"
mypy_log=$(mktemp)
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
# Two workers (pytest-xdist) share the two cores: most tests wait on processes, stores and
# timers rather than compute. tests/support/schedule.py decides what runs together and in
# which order (the longest first). GRADIENTMAIL_TEST_WORKERS=0 runs in one process.
workers=${GRADIENTMAIL_TEST_WORKERS:-2}
xdist=(-n "$workers" --dist loadgroup)
if [[ "$workers" == 0 ]]; then
  xdist=()
fi
echo "==> pytest (SeaweedFS + moto on loopback; ${workers} workers)"
tests=0
.venv/bin/python -m testbed.s3servers -- .venv/bin/python -m pytest "${xdist[@]}" \
  --durations=15 "$@" || tests=$?
echo "==> mypy --strict gradientmail operator"
types=0
wait "$mypy_pid" || types=$?
cat "$mypy_log"
rm -f "$mypy_log"
if [[ "$types" != 0 ]]; then
  echo "test.sh: mypy failed (exit $types)" >&2
fi
if [[ "$tests" != 0 ]]; then
  exit "$tests"
fi
exit "$types"
