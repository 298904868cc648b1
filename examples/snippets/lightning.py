import lightning as L

import gradientmail as gm
from gradientmail.integrations.lightning import GradientMailCallback

env = gm.NodeEnv.from_environ()  # this node, as `gradientmail run` or the operator started it
callback = GradientMailCallback(
    mailbox=env.open_mailbox(),
    algorithm=env.build_algorithm(),  # the run's gm.DiLoCo(...)
    learner_id=env.learner_id,
    start_parties=env.parties("start"),  # train once every node has joined
    **env.session_options(),
)
trainer = L.Trainer(max_steps=env.steps, log_every_n_steps=10, callbacks=[callback])
trainer.fit(module, train_loader)  # joins at the start, steps after each optimizer step,
# syncs before each checkpoint, and leaves at the end with the run's newest model in `module`
