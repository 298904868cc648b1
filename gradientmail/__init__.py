"""GradientMail: distributed training whose nodes never connect to each other.

Nodes meet only in a shared object store, the *mailbox*. The public surface is re-exported
here (``__all__``); everything else is private to its package. The layers, lowest first
(each imports only from the ones above it in this list):

- ``errors.py``, ``events.py``: the exceptions (who is at fault, what to do) and the events
  and counters a Session reports; ``ledger.py``: the host memory the library holds, by
  purpose (:func:`memory_usage`); ``settings/``: the one home of every setting (torch-free):
  each algorithm's and compressor's fields, defaults, bounds and capabilities, and which
  exchange an algorithm's rounds go through (``exchange_kind``).
- ``mailbox/``: the :class:`Mailbox` Protocol, its backends (memory, file, S3),
  :func:`open_mailbox`, key validation, and a metering wrapper.
- ``wire/``: every key and record of the protocol (keys, records, payload part indexes); no
  torch.
- ``coord/``: coordination through create-once writes: jittered retry, leases and the
  heartbeat task, the one claim-with-failover loop (``claims.py``), sweep planning; no
  torch. Used by the engine, the patterns and the CLI alike.
- ``payload/``: tensors <-> content-addressed safetensors bytes (no pickle), buffer pools.
- ``algorithms/``: the arithmetic only: the :class:`Algorithm` protocol the engine calls,
  :class:`DiLoCo`, :class:`SparseLoCo`, :class:`Moshpit` (small averaging groups on a
  grid), and the compressors of contributions (:class:`TopK`, :class:`Cast`,
  :class:`Quantize`).
- ``engine/``: a model as fragments (``layout``), joining and creator failover (``join``),
  the aligned model (``align``), a round's members, closing and verifying (``members``,
  ``closer``, ``verify``), and the exchanges a Session drives (``exchange*.py``: run-wide
  rounds, Moshpit groups).
- ``session/``: :class:`Session` (the learner): a training loop, a communication thread and
  one exchange, composed; ``_ranks.py``: the ranks of a ``torch.distributed`` group as one
  learner.
- ``patterns/``: :class:`Barrier` and the Shared Queue, on ``coord/``.
- ``inspect/``: a read-only view of a run (CLI, operator); its ``_groups.py`` reads
  and shows a Moshpit run's group rounds, ``_traffic.py`` sizes the bytes moved.
- ``launch/``: the ``GradientMailRun`` model, the node environment (:class:`NodeEnv`,
  what a node's own script reads) and a node's ranks (``ranks.py``: P processes with
  torchrun's environment); it builds Sessions, so it sits above ``session/``.
- ``integrations/``: the Hugging Face Trainer and Lightning callbacks (optional extras,
  never imported by ``import gradientmail``).
- ``testing/``: the mailbox contract suite, fault injectors and the whole-tensor reference
  combine, for users' own tests.
- ``cli/``: the ``gradientmail`` command (``_command.py`` is its entry point).
- ``demo/``: not the library: the built-in node (``python -m gradientmail.demo.node``), its
  language model and corpus (shared with ``bench/quality.py``) and what ``gradientmail
  run`` shows of it; ``node.py`` keeps the node's old path (``gradientmail.node``) working.
"""

from typing import TYPE_CHECKING, Any

from gradientmail import events, inspect
from gradientmail.errors import (
    MailboxConfigError,
    MailboxError,
    MailboxUnavailable,
    PayloadCorrupt,
    ProtocolError,
    RanksFailed,
    RoundImpossible,
)
from gradientmail.ledger import MemoryUsage, memory_usage
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.file import FileMailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.s3 import S3Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.patterns.barrier import Barrier
from gradientmail.patterns.shared_queue import SharedQueue, shared_queue

if TYPE_CHECKING:
    from gradientmail.algorithms import (
        Algorithm,
        Cast,
        DiLoCo,
        Moshpit,
        Quantize,
        SparseLoCo,
        TopK,
    )
    from gradientmail.engine import verify
    from gradientmail.engine.align import align
    from gradientmail.launch.env import NodeEnv
    from gradientmail.session import Session

__all__ = [
    "Algorithm",
    "Barrier",
    "Cast",
    "DiLoCo",
    "FileMailbox",
    "Mailbox",
    "MailboxConfigError",
    "MailboxError",
    "MailboxUnavailable",
    "MemoryMailbox",
    "MemoryUsage",
    "Moshpit",
    "NodeEnv",
    "PayloadCorrupt",
    "ProtocolError",
    "Quantize",
    "RanksFailed",
    "RoundImpossible",
    "S3Mailbox",
    "Session",
    "SharedQueue",
    "SparseLoCo",
    "TopK",
    "align",
    "events",
    "inspect",
    "memory_usage",
    "open_mailbox",
    "shared_queue",
    "verify",
]

# The training side needs torch; the mailbox, the patterns and the inspector do not (the
# operator image has no torch). Those names load on first use.
_TORCH_NAMES = {
    "Session": ("gradientmail.session", "Session"),
    "DiLoCo": ("gradientmail.algorithms", "DiLoCo"),
    "SparseLoCo": ("gradientmail.algorithms", "SparseLoCo"),
    "Moshpit": ("gradientmail.algorithms", "Moshpit"),
    "TopK": ("gradientmail.algorithms", "TopK"),
    "Cast": ("gradientmail.algorithms", "Cast"),
    "Quantize": ("gradientmail.algorithms", "Quantize"),
    "Algorithm": ("gradientmail.algorithms", "Algorithm"),
    "align": ("gradientmail.engine.align", "align"),
    "verify": ("gradientmail.engine.verify", None),
    # No torch until a node trains; lazy all the same (``node``: the old path of the demo).
    "NodeEnv": ("gradientmail.launch.env", "NodeEnv"),
    "node": ("gradientmail.node", None),
}


def __getattr__(name: str) -> Any:
    if name not in _TORCH_NAMES:
        raise AttributeError(f"module 'gradientmail' has no attribute {name!r}")
    import importlib

    module_name, attribute = _TORCH_NAMES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name in ("torch", "safetensors", "numpy"):
            raise ImportError(
                f"gradientmail.{name} needs {exc.name}, which is not installed: install "
                f"GradientMail with its torch extra, pip install '<checkout or wheel>[torch]' "
                f"(it is not on PyPI)"
            ) from exc
        raise
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


__version__ = "0.1.0.dev0"
