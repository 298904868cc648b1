#!/usr/bin/env bash
# Install GradientMail into .venv, then train: two node processes and a checker share a fresh
# mailbox directory and nothing else; every commit is verified as it lands.
# Extra arguments go to examples/synthetic.py (see --help), e.g. --mailbox s3://bucket/run-1
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python examples/synthetic.py "$@"
