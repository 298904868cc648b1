"""Spec 004's third process: ``python -m tests.spec_acceptance.align DIR``.

``gm.align(model, mailbox=box)`` as printed, on a FileMailbox opened on the run's
directory. It prints one JSON line: the payload key each fragment of the aligned model
would have (equal to a commit's ``params`` exactly when the model holds its bytes) and the
evaluation loss before and after.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.payload import encode
from tests.spec_acceptance.common import build_model, loss_on
from tests.thirdparty.spec_file_mailbox import FileMailbox

RUN_DIR = sys.argv[1]

torch.set_num_threads(1)
model = build_model()
torch.manual_seed(1)
for parameter in model.parameters():  # a fresh model, unlike the run's initial one
    torch.nn.init.normal_(parameter)
before = loss_on(model)

box = FileMailbox(RUN_DIR)
gm.align(model, mailbox=box)

manifest = p.decode_manifest(p.MANIFEST, asyncio.run(box.get(p.MANIFEST)))
params = dict(model.named_parameters())
keys = [encode({s.name: params[s.name] for s in specs})[0] for specs in manifest.fragments]
print(json.dumps({"params": keys, "loss_before": before, "loss_after": loss_on(model)}))
