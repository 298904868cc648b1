"""A Moshpit learner's communication side (mixed into Session): group rounds instead of
the run-wide rounds of ``_background.py``.

At a sync point the training thread hands its parameters over as for DiLoCo
(``_training.py``); here the communication thread publishes them to this learner's group
of the next group round, closes the group (or waits for its closer), and stages the
group's average for the training thread, which applies it as any commit: loaded, or
rebased on the progress made since the snapshot. A contribution that came after its
group closed is staged as a commit of its own parameters (nothing changes, its sync point
counts as contributed) and reported as :class:`~gradientmail.events.GroupMissed`.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.coord.retry import Stopped, retrying
from gradientmail.engine.groups import GroupLost, GroupOutcome, GroupRounds
from gradientmail.errors import PayloadCorrupt, ProtocolError
from gradientmail.events import Committed, GroupMissed, Published, PublishFailed, RoundFailed
from gradientmail.ledger import GLOBAL
from gradientmail.payload import get_tensors, put_tensors
from gradientmail.session._background import _Background
from gradientmail.session._state import _Pending


class _GroupSide(_Background):
    """The Session's group-round methods; ``_groups`` is set for a Moshpit run only."""

    _groups: GroupRounds | None

    async def _group_publish(self, pending: _Pending) -> None:
        groups = self._groups
        assert groups is not None
        with self._lock:
            if pending.cancelled:
                return
            snapshot = pending.snapshot
        try:
            t = await retrying(groups.next_round, stop=self._stop)
            group = groups.group(t)
            key, nbytes = await retrying(partial(put_tensors, self._box, snapshot), stop=self._stop)
            record = p.Snapshot(
                t, self.learner_id, pending.samples, key, pending.base, groups.index
            )
            await retrying(
                partial(
                    self._box.put_if_absent,
                    p.group_snapshot_key(t, group, self.learner_id),
                    p.encode(record),
                ),
                stop=self._stop,
            )
        except Stopped:
            raise
        except Exception as exc:
            self._emit(PublishFailed(self.learner_id, round=pending.round, error=repr(exc)))
            with self._lock:
                if self._inflight.get(pending.fragment) is pending:
                    del self._inflight[pending.fragment]
            return
        with self._lock:
            pending.round, pending.group = t, group
            pending.payload = key
            pending.published_at = time.monotonic()
            self._counters.published += 1
        self._wake_beat.set()
        self._emit(
            Published(
                self.learner_id,
                round=t,
                fragment=pending.fragment,
                samples=pending.samples,
                nbytes=nbytes,
            )
        )

    async def _group_close(self, pending: _Pending) -> None:
        groups = self._groups
        assert groups is not None
        with self._lock:
            if pending.cancelled or pending.group is None or pending.payload is None:
                return
            snapshot, t, group, payload = (
                pending.snapshot,
                pending.round,
                pending.group,
                pending.payload,
            )
        try:
            outcome = await groups.try_close(t, group, payload, snapshot)
            if outcome is None:
                return
        except Stopped:
            raise
        except GroupLost as exc:
            # Its round is gone (swept while it was behind) or its record unreadable. It
            # keeps its parameters (its own snapshot stands in for the commit) and catches
            # up, as a learner that came late.
            self._emit(RoundFailed(self.learner_id, round=t, error=str(exc)))
            self._stage(self._own_commit(t, group, pending.samples, payload), snapshot)
            with self._lock:
                self._counters.missed_groups += 1
            self._emit(GroupMissed(self.learner_id, round=t, group=group))
            return
        except Exception as exc:
            self._emit(RoundFailed(self.learner_id, round=t, error=f"group {group}: {exc!r}"))
            return
        unusable = False
        try:
            params = await self._group_params(outcome, snapshot)
        except Stopped:
            raise
        except (ProtocolError, PayloadCorrupt) as exc:
            # The group's commit names parameters that cannot be read (missing, corrupt):
            # waiting would wedge this learner, retrying cannot mend a create-once object.
            # It keeps its own parameters, as if it had come late, and goes on.
            self._emit(
                RoundFailed(
                    self.learner_id,
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
                with self._lock:
                    self._counters.missed_groups += 1
                self._emit(GroupMissed(self.learner_id, round=t, group=group))
        self._stage(commit, params)
        if outcome.member and not unusable and outcome.commit.closer == self.learner_id:
            with self._lock:
                self._counters.closed += 1
            self._emit(
                Committed(
                    self.learner_id,
                    round=t,
                    fragment=0,
                    contributors=tuple(c.learner for c in commit.contributors),
                    adopted=False,
                    excluded=tuple(x.learner for x in commit.excluded),
                )
            )
            try:
                await groups.sweep(t, group)
            except Stopped:
                raise
            except Exception as exc:  # housekeeping; the group round is committed
                self._emit(RoundFailed(self.learner_id, round=t, error=f"sweep: {exc!r}"))

    def _own_commit(self, t: int, group: str, samples: int, payload: str) -> p.Commit:
        """A stand-in commit (never written) of this learner's own contribution alone."""
        return p.Commit(
            round=t,
            fragment=0,
            base=None,
            contributors=(p.Contribution(self.learner_id, samples, payload),),
            params=payload,
            momentum=None,
            closer=self.learner_id,
            group=group,
        )

    async def _group_params(
        self, outcome: GroupOutcome, snapshot: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The parameters a group round gives this learner: the closer's own average, its
        own snapshot when alone or left out, else the record's payload, downloaded."""
        if outcome.params is not None:
            return outcome.params
        if not outcome.member or len(outcome.commit.contributors) == 1:
            return snapshot
        return await retrying(
            partial(
                get_tensors,
                self._box,
                outcome.commit.params,
                self._layout.specs[0],
                purpose=GLOBAL,
            ),
            stop=self._stop,
        )
