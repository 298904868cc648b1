"""The round engine (torch): a model as fragments, joining, closing rounds, verifying.

- ``layout.py``: :class:`ModelLayout`, which tensors each fragment holds (parameters,
  floating-point buffers; frozen parameters apart) and the copies in and out of the model
  across devices; ``ModelLayout.from_manifest``: a run laid out without its model's class.
- ``join.py``: creating or joining a run: creator election with failover, the manifest,
  the initial commits (finished by any joiner when the creator died).
- ``align.py``: the run's aligned model, read without joining (``gm.align``, ``gradientmail
  align``, a joiner's load): the newest commit of every fragment, or a Moshpit run's newest
  group round; typed errors (``RoundMissing``, ``ObjectMissing``: list again).
- ``closer.py``: closing a round: the close condition, its claims (``coord/claims.py``),
  combine, commit, sweep; ``failures.py``: a round nobody can make (the same data fault on
  every try): recorded once (``claims/{r}/failed``), raised in every learner.
- ``members.py``: a round's or a group's members: reading and validating their snapshots,
  excluding unusable ones, summing with retry; checking a record's members (the round
  closer, the group closer and verify share it).
- ``adopt.py``: writing a closer's record, or adopting the one that won.
- ``sums.py``: a round's weighted sums, streamed part by part from the mailbox into one
  accumulator (under ``members.py``).
- ``chain.py``: a commit's parameters whether stored or not (``SparseLoCo(dense_every=K)``):
  downloaded, or computed from the newest stored commit and the rounds' contributions.
  A run-wide commit stores float32 (``wire.outer_specs``); learners load it rounded.
- ``verify.py``: recomputing a commit from its record and the previous commit.
- ``exchange.py``: the :class:`Exchange` protocol a Session's communication thread drives
  (publish, close, the syncer's poll, join-time loading), its :class:`Host` (the learner's
  shared state, one staging path) and the hand-off records; ``exchanges.py``: the registry
  (``settings.exchange_kind`` kind -> class); ``exchange_rounds.py``: run-wide rounds (the
  closer, the syncer's fetch and replay); ``exchange_groups.py``: Moshpit's group rounds.
"""
