"""GradientMail's benchmark suite: each benchmark beside a reference measured in the same run.

    .venv/bin/python -m bench [NAMES] [--quick | --large] [--json out.json]

Benchmarks (name, module: what is measured, against which reference):

- ``payload``, ``payload.py``: 1. tensors -> bytes -> sha256 -> store -> model memory,
  against memcpy of the same bytes;
- ``combine``, ``combine.py``: 2. the closer's weighted average + outer Nesterov step,
  against memcpy of the same input bytes;
- ``rounds``, ``rounds.py``: 3. bytes, requests and commit latency per learner and round,
  against the byte lower bound and a raw put + get on the same store;
- ``step``, ``step_cost.py``: 4. how long step() holds the training thread, against a bare
  training step and hivemind's blocking averaging round;
- ``sync``, ``sync_time.py``: 5. time to a synchronized model, 2 processes, against
  hivemind's averaging round;
- ``idle``, ``idle_cost.py``: 6. requests per idle learner per minute and dollars per
  node-hour at AWS S3 request prices, and how long a commit waits after idling;
- ``mailbox``, ``mailbox.py`` (extra, not in the default run): each backend's calls,
  against the raw call on the same store.

Default sizes finish in a few minutes on a 2-core machine; ``--quick`` in under three;
``--large`` covers the issue's full ranges (100M parameters, 8 learners). hivemind runs in a
venv of its own (``python -m bench.hivemind_setup``; the suite creates it on first use and
skips the hivemind reference, saying why, when it cannot). Shared code: ``_harness.py``
(timing, tables, targets, JSON: the one report module), ``_procs.py`` (the one
learner-process harness: spawned learners and their results, worker subprocesses, a fresh
mailbox per configuration), ``_workload.py`` (models, the reference training step),
``_twoproc.py`` (two learner processes, for 4 and 5), ``hivemind_ref.py`` and
``_hivemind_worker.py`` (the hivemind reference). The quality benchmark:
``quality.py`` (its arms and run), ``_quality_report.py`` (its tables, targets, plot),
``_lm.py`` (its sizes and in-process arms; the model is ``gradientmail.demo.lm``),
``_quality_worker.py`` (its processes), ``quality_moshpit.py`` (its Moshpit arms).
"""
