#!/usr/bin/env bash
# Install GradientMail into .venv, then run the demo on an embedded mailbox (a fresh
# directory): several node processes coordinate through it and nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/gradientmail demo "$@"
