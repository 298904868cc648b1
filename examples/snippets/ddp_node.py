"""A node of several ranks (DDP) as ONE learner: `gradientmail run --nodes 2 --procs-per-node 2
-- python examples/snippets/ddp_node.py` (or torchrun) starts it; tests/session/test_ranks.py
runs it."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradientmail as gm

dist.init_process_group("gloo")  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank = dist.get_rank()
env = gm.NodeEnv.from_environ()  # the same on every rank: one learner id for the node
torch.manual_seed(0)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1000 * env.node_index + rank)  # each rank its own batches

with env.session(model) as session:  # on EVERY rank; rank 0 alone talks to the mailbox
    if rank == 0:  # line the nodes up (the others wait in their first collective)
        env.barrier().wait("start", parties=env.parties("start"))
    for _ in range(env.steps):
        x = torch.randn(16, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        session.step(samples=len(x))  # this rank's samples; the learner counts all ranks'
# after every step() and at close, every rank holds rank 0's parameters, bitwise
dist.destroy_process_group()
