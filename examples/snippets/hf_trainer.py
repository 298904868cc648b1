from transformers import Trainer

import gradientmail as gm
from gradientmail.integrations.transformers import GradientMailCallback

env = gm.NodeEnv.from_environ()  # this node, as `gradientmail run` or the operator started it
callback = GradientMailCallback(
    mailbox=env.open_mailbox(),
    algorithm=env.build_algorithm(),  # the run's gm.DiLoCo(...)
    learner_id=env.learner_id,
    start_parties=env.parties("start"),  # train once every node has joined
    **env.session_options(),
)
trainer = Trainer(model=model, args=args, train_dataset=train_dataset, callbacks=[callback])
trainer.train()  # joins at the start, steps after each optimizer step, syncs before each
# checkpoint, and leaves at the end with the run's newest model in `model`
