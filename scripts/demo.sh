#!/usr/bin/env bash
# Install GradientMail into .venv, then train: `gradientmail run` starts three processes of the
# built-in node (800 steps each) that share a fresh mailbox directory and nothing else, with
# a live table of rounds, learners, loss and progress; Ctrl-C stops every node.
# Extra arguments go to `gradientmail run` (see --help), e.g. --nodes 5 --steps 3000, or
# --mailbox 's3://bucket/demo-1?endpoint=http://127.0.0.1:9000'.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/gradientmail run "$@"
