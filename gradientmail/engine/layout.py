"""A model seen as fragments: which tensors each fragment holds, and copies in and out.

What travels, and how (each tensor's ``kind`` is in the manifest, :class:`TensorSpec`):

- **trainable parameters** (``requires_grad=True``, kind ``param``): split into the
  algorithm's fragments (contiguous groups in model order); every round of a fragment
  syncs them through the outer optimizer.
- **floating-point buffers** (kind ``buffer``): the persistent ones, which ``state_dict``
  holds (BatchNorm's ``running_mean`` and ``running_var``). Each travels with the fragment
  of the trainable parameter before it in model order (its own module's, for a norm layer;
  fragment 0 when none precedes it). A round sets them to the contributions' plain
  sample-weighted average, or to the closer's copy (``DiLoCo(buffers="closer")``): they
  are statistics, so no outer step and no momentum. Applying a commit *loads* them
  (:meth:`ModelLayout.rebase` and :meth:`ModelLayout.mix` keep no local progress for a
  buffer: a running variance is not a sum of steps, and ``new + (local − anchor)`` could
  turn it negative).
- **frozen parameters** (``requires_grad=False``, kind ``frozen``): never in a round, so
  they cannot drift by rounding; the creator stores them once, before the manifest, which
  names the payload (:meth:`ModelLayout.frozen_tensors`), and every node loads them at join,
  ``align`` too (:meth:`ModelLayout.load_frozen`).
- **everything else keeps its local value**: buffers that are not floating point
  (BatchNorm's ``num_batches_tracked``, integer counters, masks) and non-persistent buffers
  (caches a module recomputes, outside its ``state_dict``).
- **tied names** (one tensor under two names: ``lm_head.weight`` is ``wte.weight``): the
  tensor travels once, under the name ``named_parameters`` lists; the other names are the
  manifest's ``aliases`` (:attr:`ModelLayout.aliases`), for ``gradientmail align --out``.

The layout is fixed when it is made: a parameter frozen or unfrozen later is not followed.

Devices: everything that crosses the mailbox lives on the host (CPU): payloads, snapshots,
the closer's base parameters and momentum, the commits a Session keeps. The layout is where
tensors move between the host and each tensor's own device, through a :class:`Transfer`:
:meth:`ModelLayout.copy_out` copies to host memory (pinned when CUDA is available, with
non-blocking copies followed by one synchronize); :meth:`ModelLayout.load` and
:meth:`ModelLayout.rebase` move host tensors to the parameter's device (``rebase`` computes
there). ``combine`` runs on the host, in float32, so a commit verifies bitwise on any
machine (a GPU may fuse a multiply-add that a CPU rounds twice). A tensor on the ``meta``
device (no data) is refused when the layout is made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from gradientmail.algorithms.base import Algorithm
from gradientmail.errors import ProtocolError
from gradientmail.payload import can_send
from gradientmail.payload.buffers import BufferPool
from gradientmail.wire import BUFFER, FROZEN, OUTER_DTYPE, PARAM, Manifest, TensorSpec, outer_specs

__all__ = ["ModelLayout", "Transfer"]


class Transfer:
    """Moves tensors between the host and the device a model's tensor lives on.

    Host tensors (CPU) are used where they are; the others go through host memory, pinned
    when CUDA is available (device-to-host copies are then non-blocking, and valid after
    :meth:`synchronize`). A subclass can count or redirect the moves: :meth:`on_host`
    decides which tensors take the device path (tests drive that path without a GPU).
    """

    def __init__(self) -> None:
        self.pinned = torch.cuda.is_available()

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` can be used as it is (no move)."""
        return tensor.device.type == "cpu"

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in fresh host memory; read it after :meth:`synchronize`."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pinned)
        host.copy_(tensor, non_blocking=self.pinned)
        return host

    def to_device(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``host`` on ``like``'s device; ``host`` may change again once :meth:`synchronize`
        returned."""
        return host.to(like.device, non_blocking=True)

    def synchronize(self, devices: Iterable[torch.device]) -> None:
        """Wait until the copies started to or from ``devices`` are done."""
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)


class ModelLayout:
    """Which tensors each fragment holds (``fragments``, ``specs``), the frozen parameters,
    and the copies between the model and host tensors."""

    def __init__(
        self, model: torch.nn.Module, algorithm: Algorithm, *, transfer: Transfer | None = None
    ) -> None:
        tensors = _Tensors(model)
        if not tensors.params:
            raise ValueError("the model has no parameters to train")
        trainable = [name for kind, name in tensors.order if kind == PARAM]
        if not trainable:
            raise ValueError(
                "the model has no trainable parameters (requires_grad=True): nothing to train"
            )
        groups = algorithm.split([(name, tensors.params[name].numel()) for name in trainable])
        fragment_of = {name: index for index, group in enumerate(groups) for name in group}
        members: list[list[str]] = [[] for _ in groups]
        current = 0  # a buffer joins the fragment of the trainable parameter before it
        for kind, name in tensors.order:
            if kind == PARAM:
                current = fragment_of[name]
                members[current].append(name)
            elif kind == BUFFER:
                members[current].append(name)
        frozen = [name for kind, name in tensors.order if kind == FROZEN]
        self._setup(tensors, members, frozen, transfer, tensors.aliases)

    @classmethod
    def for_run(
        cls, model: torch.nn.Module, manifest: Manifest, *, transfer: Transfer | None = None
    ) -> ModelLayout:
        """The run's layout over ``model``, for loading commits into it (``align``): the
        fragments and kinds are the manifest's, whatever ``requires_grad`` says in this
        model (an evaluation model need not freeze what the training froze). Every tensor
        the manifest lists must be in ``model`` with its shape and dtype, a parameter where
        the run has a parameter, a floating-point buffer where it has a buffer, and every
        one that would travel from ``model`` must be in the manifest: else
        :class:`ProtocolError` listing the differences."""
        tensors = _Tensors(model)
        found: list[str] = []
        listed: set[str] = set()
        for spec in (*(s for f in manifest.fragments for s in f), *manifest.frozen):
            listed.add(spec.name)
            value = (tensors.buffers if spec.kind == BUFFER else tensors.params).get(spec.name)
            if value is None:
                what = "floating-point buffer" if spec.kind == BUFFER else "parameter"
                found.append(f"the run's {what} {spec.name} is not one in this model")
            elif (tuple(value.shape), str(value.dtype)) != (spec.shape, spec.dtype):
                found.append(
                    f"{spec.noun()} {spec.name}: run has {spec.describe()}, this model has "
                    f"{value.dtype}{list(value.shape)}"
                )
        extra = sorted(name for _, name in tensors.order if name not in listed)
        found += [f"{name} is in this model but not in the run's" for name in extra[:5]]
        if found:
            raise ProtocolError("the model does not match the run: " + "; ".join(found[:10]))
        return cls._of_manifest(tensors, manifest, transfer)

    @classmethod
    def from_manifest(cls, manifest: Manifest, *, transfer: Transfer | None = None) -> ModelLayout:
        """The run's layout over host tensors of its own (zeros, shaped and typed as the
        manifest says, under its names): a run read without its model's class (``gradientmail
        align``). Load commits into it (:meth:`load`, :meth:`load_frozen`), read them back
        with :meth:`copy_out` and :meth:`frozen_tensors`."""
        return cls._of_manifest(_Tensors.zeros(manifest), manifest, transfer)

    @classmethod
    def _of_manifest(
        cls, tensors: _Tensors, manifest: Manifest, transfer: Transfer | None
    ) -> ModelLayout:
        members = [[spec.name for spec in fragment] for fragment in manifest.fragments]
        layout = cls.__new__(cls)
        frozen = [spec.name for spec in manifest.frozen]
        layout._setup(tensors, members, frozen, transfer, manifest.aliases)
        return layout

    def _setup(
        self,
        tensors: _Tensors,
        members: list[list[str]],
        frozen: list[str],
        transfer: Transfer | None,
        aliases: Mapping[str, str],
    ) -> None:
        for names in (*members, frozen):
            for name in names:
                tensors.check(name)
        travelling = {n for names in (*members, frozen) for n in names}
        # {further name: listed name} of each tied tensor that travels (the manifest's).
        self.aliases: dict[str, str] = {a: n for a, n in aliases.items() if n in travelling}
        self.transfer = Transfer() if transfer is None else transfer
        self._owners = {n: tensors.owners[n] for m in members for n in m if n in tensors.owners}
        # Buffers without a module (a layout from a manifest): held here.
        self._held = {
            n: tensors.buffers[n]
            for m in members
            for n in m
            if n in tensors.buffers and n not in tensors.owners
        }
        buffers = {*self._owners, *self._held}
        self.params: dict[str, torch.nn.Parameter] = {
            n: tensors.params[n] for m in members for n in m if n not in buffers
        }
        self.frozen: dict[str, torch.nn.Parameter] = {n: tensors.params[n] for n in frozen}
        self.fragments: tuple[tuple[str, ...], ...] = tuple(tuple(m) for m in members)
        self._buffers: tuple[frozenset[str], ...] = tuple(
            frozenset(n for n in m if n in buffers) for m in members
        )
        self.specs: tuple[tuple[TensorSpec, ...], ...] = tuple(
            tuple(self._spec(name, BUFFER if name in buffers else PARAM) for name in group)
            for group in self.fragments
        )
        self.frozen_specs: tuple[TensorSpec, ...] = tuple(
            self._spec(name, FROZEN) for name in self.frozen
        )
        # How a run-wide commit stores each fragment (float32: wire.outer_specs).
        self.outer_specs: tuple[tuple[TensorSpec, ...], ...] = tuple(
            outer_specs(specs) for specs in self.specs
        )

    def _spec(self, name: str, kind: str) -> TensorSpec:
        tensor = self.tensor(name)
        return TensorSpec(name, tuple(tensor.shape), str(tensor.dtype), kind)

    def tensor(self, name: str) -> torch.Tensor:
        """The model's tensor ``name`` now. Buffers are looked up on their module each time:
        ``model.to(...)`` replaces a buffer (a parameter keeps its object)."""
        owner = self._owners.get(name)
        if owner is not None:
            value = getattr(owner[0], owner[1])
            assert isinstance(value, torch.Tensor), name
            return value
        if name in self._held:
            return self._held[name]
        if name in self.params:
            return self.params[name]
        return self.frozen[name]

    def manifest(
        self, creator: str, algorithm: Algorithm, frozen_payload: str | None = None
    ) -> Manifest:
        """The run's manifest as this node would write it; ``frozen_payload``: the key of
        :meth:`frozen_tensors` stored (the creator stores it before the manifest)."""
        return Manifest(
            creator=creator,
            algorithm=algorithm.settings(),
            fragments=self.specs,
            frozen=self.frozen_specs,
            frozen_payload=frozen_payload,
            aliases=self.aliases,
        )

    @property
    def count(self) -> int:
        return len(self.fragments)

    def buffer_names(self, fragment: int) -> frozenset[str]:
        """The fragment's floating-point buffers (``combine(..., buffer_names=...)``)."""
        return self._buffers[fragment]

    def nbytes(self, fragment: int) -> int:
        return sum(
            self.tensor(n).numel() * self.tensor(n).element_size() for n in self.fragments[fragment]
        )

    # -- copies ------------------------------------------------------------------------------

    def copy_out(self, fragment: int, pool: BufferPool | None = None) -> dict[str, torch.Tensor]:
        """A detached host copy of the fragment's tensors (safe to keep while training goes
        on). Host tensors are copied into buffers from ``pool`` when given (a released
        copy's memory, not fresh pages); others into (pinned) host memory, all copies
        started before one synchronize."""
        return self._copy_out(self.fragments[fragment], fragment, pool)

    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        """Host copies of the frozen parameters (empty when there are none): what the
        creator stores before the manifest, whose ``frozen_payload`` names them."""
        return self._copy_out(tuple(self.frozen), None, None)

    def _copy_out(
        self, names: tuple[str, ...], key: int | None, pool: BufferPool | None
    ) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            sources = {n: self.tensor(n).detach() for n in names}
            host = {n: t for n, t in sources.items() if self.transfer.on_host(t)}
            copies: dict[str, torch.Tensor] = {}
            if pool is None or key is None:
                copies.update((n, t.clone()) for n, t in host.items())
            elif host:
                taken = pool.take(host, dtype=None)
                for name, value in host.items():
                    taken[name].copy_(value)
                copies.update(taken)
            devices = set()
            for name, value in sources.items():
                if name not in host:
                    copies[name] = self.transfer.to_host(value)
                    devices.add(value.device)
            if devices:
                self.transfer.synchronize(devices)
            return {n: copies[n] for n in names}

    def outer_copy(self, fragment: int) -> dict[str, torch.Tensor]:
        """The fragment's tensors as a run-wide commit stores them (an initial commit):
        host copies in float32 (:data:`~gradientmail.wire.OUTER_DTYPE`; exact from any
        floating dtype a payload carries)."""
        outer = getattr(torch, OUTER_DTYPE.removeprefix("torch."))
        return {n: t.to(dtype=outer) for n, t in self.copy_out(fragment).items()}

    def load(self, fragment: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the fragment's tensors in place (the optimizer keeps its references).
        A float32 global loaded into a tensor of another dtype is rounded by ``copy_``:
        ``Tensor.to``'s round to nearest, ties to even (the one rule, see ``rebase``)."""
        self._load(self.fragments[fragment], tensors)

    def load_frozen(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the frozen parameters with the run's (the manifest's ``frozen_payload``)."""
        if set(tensors) != set(self.frozen):
            missing = sorted(set(self.frozen) - set(tensors))[:3]
            extra = sorted(set(tensors) - set(self.frozen))[:3]
            raise ValueError(f"frozen tensors differ (missing {missing}, unexpected {extra})")
        self._load(tuple(self.frozen), tensors)

    def _load(self, names: tuple[str, ...], tensors: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            devices = set()
            for name in names:
                target, value = self.tensor(name), tensors[name]
                if not self.transfer.on_host(target):
                    value = self.transfer.to_device(value, target)
                    devices.add(target.device)
                target.copy_(value)
            if devices:  # the host tensors may be reused once this returns
                self.transfer.synchronize(devices)

    def rebase(
        self,
        fragment: int,
        new_global: Mapping[str, torch.Tensor],
        anchor: Mapping[str, torch.Tensor],
    ) -> None:
        """``param ← new_global + (param − anchor)``: adopt a commit, keep local progress.

        ``anchor`` is what the commit already accounts for: the snapshot this learner
        contributed, or the previous global if it did not contribute. Buffers are loaded
        (``buffer ← new_global``): statistics, not sums of steps. On a device, both host
        tensors move there and the update runs there.

        A tensor in a lower precision than the (float32) global is computed in float32
        and rounded once, as :meth:`load` rounds: ``param ← round(new_global + (param −
        anchor))``, so a learner without local progress holds exactly the rounded global.
        """
        buffers = self._buffers[fragment]
        with torch.no_grad():
            devices = set()
            for name in self.fragments[fragment]:
                target = self.tensor(name)
                value, base = new_global[name], anchor[name]
                if not self.transfer.on_host(target):
                    devices.add(target.device)
                    value = self.transfer.to_device(value, target)
                    if name not in buffers:
                        base = self.transfer.to_device(base, target)
                if name in buffers:
                    target.copy_(value)
                elif _rounded(target, value):
                    # float32 arithmetic, one rounding (bf16 in-place steps round twice).
                    target.copy_(target.to(dtype=value.dtype).sub_(base).add_(value))
                else:
                    # In place, no temporaries: a fresh buffer per tensor costs more than the
                    # math.
                    target.add_(value).sub_(base)
            if devices:
                self.transfer.synchronize(devices)

    def mix(self, fragment: int, new_global: Mapping[str, torch.Tensor], alpha: float) -> None:
        """``param ← α·param + (1 − α)·new_global``: Streaming DiLoCo's blend of a late
        commit with the local progress since. Buffers are loaded, as by :meth:`rebase`. On a
        device, ``new_global`` moves there and the blend runs there."""
        buffers = self._buffers[fragment]
        with torch.no_grad():
            devices = set()
            for name in self.fragments[fragment]:
                target, value = self.tensor(name), new_global[name]
                if not self.transfer.on_host(target):
                    devices.add(target.device)
                    value = self.transfer.to_device(value, target)
                if name in buffers:
                    target.copy_(value)
                elif _rounded(target, value):  # float32 arithmetic, one rounding
                    target.copy_(
                        target.to(dtype=value.dtype).mul_(alpha).add_(value, alpha=1.0 - alpha)
                    )
                else:
                    target.mul_(alpha).add_(value, alpha=1.0 - alpha)
            if devices:
                self.transfer.synchronize(devices)


def _rounded(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``value`` (a float32 global) is finer than ``target`` (a bf16/fp16 tensor):
    then an update of ``target`` is computed in ``value``'s dtype and rounded once."""
    return target.dtype != value.dtype and value.dtype == torch.float32


class _Tensors:
    """A model's tensors that can travel, by name, in model order (``order``: each module's
    own parameters, then its own persistent floating-point buffers, as ``(kind, name)``;
    a parameter's kind from its ``requires_grad``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        self.params = dict(model.named_parameters())
        every = dict(model.named_buffers())
        self.buffers: dict[str, torch.Tensor] = {}
        self.owners: dict[str, tuple[torch.nn.Module, str]] = {}  # buffer -> (module, attr)
        self.order: list[tuple[str, str]] = []
        # {further name: first name} of a tensor that state_dict holds under several names.
        self.aliases: dict[str, str] = {}
        first = {id(t): n for n, t in (*self.params.items(), *every.items())}
        # named_modules, then each module's own members, is the order named_parameters and
        # named_buffers use; a tensor shared by two modules counts where they first list it.
        for prefix, module in model.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
                listed = self.params.get(dot + attr)
                if listed is not None and listed is param:  # else listed under another name
                    self.order.append((PARAM if listed.requires_grad else FROZEN, dot + attr))
                elif param is not None and dot + attr not in self.params:
                    self.aliases[dot + attr] = first[id(param)]
            transient: set[str] = getattr(module, "_non_persistent_buffers_set", set())
            for attr, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
                name = dot + attr
                known = every.get(name)
                # A persistent buffer listed under another name: an alias.
                if known is None and attr not in transient and id(buffer) in first:
                    self.aliases[name] = first[id(buffer)]
                if known is None or known is not buffer or attr in transient:
                    continue
                if known.is_floating_point():
                    self.order.append((BUFFER, name))
                    self.buffers[name] = known
                    self.owners[name] = (module, attr)

    @classmethod
    def zeros(cls, manifest: Manifest) -> _Tensors:
        """Host tensors of zeros for every tensor the manifest lists, by name and kind,
        owned by no module."""
        tensors = cls.__new__(cls)
        tensors.params, tensors.buffers, tensors.owners, tensors.order = {}, {}, {}, []
        tensors.aliases = dict(manifest.aliases)
        for spec in (*(s for fragment in manifest.fragments for s in fragment), *manifest.frozen):
            value = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype.removeprefix("torch.")))
            if spec.kind == BUFFER:
                tensors.buffers[spec.name] = value
            else:
                trainable = spec.kind == PARAM
                tensors.params[spec.name] = torch.nn.Parameter(value, requires_grad=trainable)
            tensors.order.append((spec.kind, spec.name))
        return tensors

    def check(self, name: str) -> None:
        """``ValueError`` naming the tensor if it cannot travel: no data, or a dtype no
        payload carries."""
        if name in self.buffers:
            what, tensor = "buffer", self.buffers[name]
        else:
            tensor = self.params[name]
            what = "parameter" if tensor.requires_grad else "frozen parameter"
        if tensor.device.type == "meta":
            raise ValueError(
                f"{what} {name!r} is on the meta device: it has no data to send or load. "
                "Materialize the model first (model.to_empty(device=...), then initialize it)"
            )
        if not can_send(tensor.dtype):
            raise ValueError(f"{what} {name!r} is {tensor.dtype}, which a payload cannot carry")
