"""The round engine (torch): a model as fragments, joining, closing rounds, verifying.

- ``layout.py``: :class:`ModelLayout`, which tensors each fragment holds (parameters,
  floating-point buffers; frozen parameters apart) and the copies in and out of the model
  across devices.
- ``join.py``: creating or joining a run: creator election with failover, the manifest,
  the initial commits (finished by any joiner when the creator died), loading the newest.
- ``closer.py``: closing a round: the close condition, claim-with-failover, excluding
  contributions that cannot be loaded, combine, commit, sweep.
- ``sums.py``: a round's weighted sums, streamed part by part from the mailbox into one
  accumulator (the closer and verify share it).
- ``chain.py``: a commit's parameters whether stored or not (``SparseLoCo(dense_every=K)``):
  downloaded, or computed from the newest stored commit and the rounds' contributions.
- ``verify.py``: recomputing a commit from its record and the previous commit.
"""
