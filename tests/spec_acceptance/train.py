"""One of spec 004's "two processes": ``python -m tests.spec_acceptance.train DIR STEPS SEED``.

Everything between the ``spec 004`` markers is the snippet as printed, except the
directory: the spec's ``"/var/tmp/gradientmail/run-1"`` is ``RUN_DIR``, because "a new run
uses a new directory" and tests run side by side. The snippet sets no ``learner_id``, so
each process joins under the default one (host and pid). It prints one JSON line at the end.
"""

from __future__ import annotations

import json
import sys

import torch

import gradientmail as gm
from tests.spec_acceptance.common import Loader, build_model, loss_on, train_step
from tests.thirdparty.spec_file_mailbox import FileMailbox

RUN_DIR, STEPS, SEED = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
DELAY = 0.02  # seconds a batch takes to arrive

torch.set_num_threads(1)
model = build_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
dataloader = Loader(SEED, STEPS, DELAY)

# -- spec 004, "Using it in a run" -----------------------------------------------------------
box = FileMailbox(RUN_DIR)

with gm.Session(
    model,
    algorithm=gm.DiLoCo(sync_every=100, fragments=8),
    mailbox=box,
) as session:
    for batch in dataloader:
        train_step(model, optimizer, batch)
        session.step(samples=len(batch))
# -- end of the snippet ----------------------------------------------------------------------

counters = session.counters()
print(
    json.dumps(
        {
            "learner": session.learner_id,
            "steps": session.steps,
            "rounds": list(session.rounds),
            "published": counters.published,
            "loss": loss_on(model),
        }
    ),
    flush=True,
)
