#!/usr/bin/env bash
# Install GradientMail into .venv, then train: `gradientmail run` starts three processes of the
# built-in node that share a fresh mailbox directory and nothing else. They wait until all
# three have joined, then each trains the same small byte-level language model on its own
# shard of the Python standard library's sources (800 steps, about a minute on 2 cores).
# The live table shows rounds, learners and the validation loss of the aligned model (the
# newest commit of every fragment); at the end come its loss curve beside node 0's, a PNG
# of both in the run folder, and a few lines the aligned model writes. Ctrl-C stops every
# node.
# Extra arguments go to `gradientmail run` (see --help), e.g. --nodes 4 --steps 1600, or
# --mailbox 's3://bucket/demo-1?endpoint=http://127.0.0.1:9000'. GRADIENTMAIL_LM=d_model=96
# changes the model (gradientmail/demo/node.py), GRADIENTMAIL_TASK=synthetic trains a toy MLP.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/gradientmail run "$@"
