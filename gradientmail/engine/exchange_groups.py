"""Moshpit groups: a learner's contribution goes to its group of the next group round
(``engine/groups.py``), closed by one of the group's members; there is no syncer (a group
commit is this learner's own business, nobody else's commits are applied).

At a sync point the training thread hands its parameters over as for run-wide rounds;
here they are published to this learner's group of the next group round, the group is
closed (or its closer waited for), and the group's average is staged, which the training
thread applies as any commit: loaded, or rebased on the progress made since the snapshot.
A contribution that came after its group closed is staged as a commit of its own
parameters (nothing changes, its sync point counts as contributed) and reported as
:class:`~gradientmail.events.GroupMissed`.
"""

from __future__ import annotations

from functools import partial

from gradientmail import wire as p
from gradientmail.algorithms.moshpit import Moshpit
from gradientmail.coord.retry import Stopped, retrying
from gradientmail.engine import exchange as ex
from gradientmail.engine.align import download_average, newest_group_round
from gradientmail.engine.groups import GroupLost, GroupOutcome, GroupRounds
from gradientmail.errors import PayloadCorrupt, ProtocolError
from gradientmail.events import Committed, GroupMissed, RoundFailed
from gradientmail.ledger import GLOBAL
from gradientmail.payload import get_tensors, put_tensors

__all__ = ["GroupsExchange"]


class GroupsExchange:
    """Moshpit's group rounds for one learner (module docstring): its slot on the grid,
    and each contribution's group round, closed here or by another member."""

    syncer = False  # close() finds this learner's commits: nobody else's are applied

    def __init__(self, context: ex.ExchangeContext) -> None:
        algorithm = context.algorithm
        # The registry chose this exchange from the algorithm's name (settings.exchange_kind);
        # the grid's arithmetic must come with it.
        if not isinstance(algorithm, Moshpit):
            raise TypeError(
                f"group rounds need the grid of gm.Moshpit, not {type(algorithm).__name__}"
            )
        self.host = context.host
        self.box = context.box
        self.layout = context.layout
        self.algorithm = algorithm
        self.groups = GroupRounds(
            context.box,
            context.layout,
            algorithm,
            context.host.learner_id,
            context.tracker,
            round_timeout=context.round_timeout,
            claim_timeout=context.claim_timeout,
            keep_rounds=context.keep_rounds,
        )

    async def joined(self, rounds: dict[int, int], tensors: dict[int, ex.Tensors]) -> None:
        """This learner's slot, and the model it starts from: the average of the newest
        group round's commits when the run has any (a late joiner), else the initial
        commit. Its group rounds continue from that round."""
        await self.groups.join()
        commits = await newest_group_round(self.box)
        if not commits:
            return
        tensors[0] = await download_average(self.box, self.algorithm, self.layout, commits)
        rounds[0] = self.groups.last_round = commits[0].round

    async def poll(self) -> None:  # no syncer: close() finds this learner's commits
        return

    async def publish(self, offer: ex.Offer) -> ex.Placed:
        groups, stop, learner = self.groups, self.host.stop, self.host.learner_id
        t = await retrying(groups.next_round, stop=stop)
        group = groups.group(t)
        key, nbytes = await retrying(partial(put_tensors, self.box, offer.snapshot), stop=stop)
        record = p.Snapshot(t, learner, offer.samples, key, offer.base, groups.index)
        await retrying(
            partial(
                self.box.put_if_absent, p.group_snapshot_key(t, group, learner), p.encode(record)
            ),
            stop=stop,
        )
        return ex.Placed(t, key, nbytes, group=group)

    async def close(self, pending: ex.Pending) -> None:
        host, learner = self.host, self.host.learner_id
        with host.lock:
            if pending.cancelled or pending.group is None or pending.payload is None:
                return
            snapshot, t, group, payload = (
                pending.snapshot,
                pending.round,
                pending.group,
                pending.payload,
            )
        try:
            outcome = await self.groups.try_close(t, group, payload, snapshot)
            if outcome is None:
                return
        except Stopped:
            raise
        except GroupLost as exc:
            # Its round is gone (swept while it was behind) or its record unreadable. It
            # keeps its parameters (its own snapshot stands in for the commit) and catches
            # up, as a learner that came late.
            host.emit(RoundFailed(learner, round=t, error=str(exc)))
            own = self._own_commit(t, group, pending.samples, payload)
            host.stage(own, snapshot, ex.mine_of([own], learner))
            self._missed(t, group)
            return
        except Exception as exc:
            host.emit(RoundFailed(learner, round=t, error=f"group {group}: {exc!r}"))
            return
        unusable = False
        try:
            params = await self._params(outcome, snapshot)
        except Stopped:
            raise
        except (ProtocolError, PayloadCorrupt) as exc:
            # The group's commit names parameters that cannot be read (missing, corrupt):
            # waiting would wedge this learner, retrying cannot mend a create-once object.
            # It keeps its own parameters, as if it had come late, and goes on.
            host.emit(
                RoundFailed(
                    learner,
                    round=t,
                    error=f"group {group}: its commit cannot be loaded, keeping this "
                    f"learner's own parameters: {exc}",
                )
            )
            params, unusable = snapshot, True
        commit = outcome.commit
        if unusable or not outcome.member:
            # Late: the group closed without it. Its own parameters stand in for the commit,
            # so the training thread lets go of the contribution like any other.
            commit = self._own_commit(t, group, pending.samples, payload)
            if not outcome.member:
                self._missed(t, group)
        host.stage(commit, params, ex.mine_of([commit], learner))
        if unusable or not outcome.member or outcome.commit.closer != learner:
            return
        host.count("closed")
        host.emit(
            Committed(
                learner,
                round=t,
                fragment=0,
                contributors=tuple(c.learner for c in commit.contributors),
                adopted=False,
                excluded=tuple(x.learner for x in commit.excluded),
            )
        )
        try:
            await self.groups.sweep(t, group)
        except Stopped:
            raise
        except Exception as exc:  # housekeeping; the group round is committed
            host.emit(RoundFailed(learner, round=t, error=f"sweep: {exc!r}"))

    def _missed(self, t: int, group: str) -> None:
        """Its contribution came after its group closed (or the round was lost)."""
        self.host.count("missed_groups")
        self.host.emit(GroupMissed(self.host.learner_id, round=t, group=group))

    def _own_commit(self, t: int, group: str, samples: int, payload: str) -> p.Commit:
        """A stand-in commit (never written) of this learner's own contribution alone."""
        learner = self.host.learner_id
        return p.Commit(
            round=t,
            fragment=0,
            base=None,
            contributors=(p.Contribution(learner, samples, payload),),
            params=payload,
            momentum=None,
            closer=learner,
            group=group,
        )

    async def _params(self, outcome: GroupOutcome, snapshot: ex.Tensors) -> ex.Tensors:
        """The parameters a group round gives this learner: the closer's own average, its
        own snapshot when alone or left out, else the record's payload, downloaded."""
        if outcome.params is not None:
            return outcome.params
        if not outcome.member or len(outcome.commit.contributors) == 1:
            return snapshot
        return await retrying(
            partial(
                get_tensors, self.box, outcome.commit.params, self.layout.specs[0], purpose=GLOBAL
            ),
            stop=self.host.stop,
        )
