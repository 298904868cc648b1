"""The entries: every algorithm, every compressor, the per-learner Session settings and the
built-in node's own, with their defaults and bounds (the dataclasses validate with these;
``launch/runspec.py``, ``launch/env.py`` and the CLI derive their fields from them)."""

from __future__ import annotations

from gradientmail.settings._model import AlgorithmInfo, CompressorInfo, Setting

MAX_GROUP_SIZE = 1000  # Moshpit: coordinates are written with three digits in group keys
MAX_GRID_DIMS = 8
TOPK_MAX_CHUNK = 32768  # TopK: positions inside a chunk are int16

_SYNC_EVERY = Setting("sync_every", "int", 100, "Local steps between syncs.", ge=1)
_FRAGMENTS = Setting(
    "fragments", "int", 1, "Streaming fragments (at most syncEvery), staggered in time.", ge=1
)
_BUFFERS = Setting(
    "buffers",
    "choice",
    "average",
    "How a round sets floating-point buffers: average (sample-weighted) or closer (the "
    "closer's own copy).",
    choices=("average", "closer"),
)


def _outer_lr(default: float) -> Setting:
    return Setting("outer_lr", "float", default, "Outer learning rate.", gt=0)


COMPRESSORS: dict[str, CompressorInfo] = {
    info.name: info
    for info in (
        CompressorInfo(
            "topk",
            "TopK",
            "Per chunk the largest density fraction of entries, quantized to bits.",
            (
                Setting("density", "float", 0.02, "Fraction of each chunk kept.", gt=0, le=1),
                Setting("bits", "choice", 2, "Bits per kept value.", choices=(2, 4, 8)),
                Setting("chunk", "int", 4096, "Elements per chunk.", ge=1, le=TOPK_MAX_CHUNK),
            ),
        ),
        CompressorInfo(
            "cast",
            "Cast",
            "Every element rounded to a 16-bit float.",
            (
                Setting(
                    "dtype",
                    "choice",
                    "bfloat16",
                    "The 16-bit float type.",
                    choices=("bfloat16", "float16"),
                ),
            ),
        ),
        CompressorInfo(
            "quantize",
            "Quantize",
            "Every element quantized per chunk to bits-bit signed integers.",
            (
                Setting("bits", "choice", 8, "Bits per value.", choices=(8, 4)),
                Setting("chunk", "int", 4096, "Elements per scale.", ge=1),
            ),
        ),
    )
}

ALGORITHMS: dict[str, AlgorithmInfo] = {
    info.name: info
    for info in (
        AlgorithmInfo(
            "diloco",
            "DiLoCo",
            "Every learner averages with every other at each sync point (one closer per "
            "round), with an outer Nesterov step.",
            "rounds",
            (
                _SYNC_EVERY,
                _FRAGMENTS,
                _outer_lr(0.7),
                Setting("outer_momentum", "float", 0.9, "Outer (Nesterov) momentum.", ge=0, lt=1),
                Setting("nesterov", "bool", True, "Nesterov momentum (false: plain)."),
                _BUFFERS,
            ),
            compression="optional",
        ),
        AlgorithmInfo(
            "sparseloco",
            "SparseLoCo",
            "DiLoCo with error feedback in place of outer momentum, over top-k compressed "
            "pseudo-gradients.",
            "rounds",
            (
                _SYNC_EVERY,
                _FRAGMENTS,
                _outer_lr(1.0),
                _BUFFERS,
                Setting(
                    "error_decay",
                    "float",
                    0.95,
                    "Decay of the error-feedback accumulator between contributions.",
                    gt=0,
                    le=1,
                ),
                Setting(
                    "dense_every",
                    "int",
                    1,
                    "A commit's parameters are stored every denseEvery-th round of its "
                    "fragment (1: every round); the others are computed from the rounds.",
                    ge=1,
                ),
            ),
            compression="required",
            default_compression={"name": "topk", "density": 0.02, "bits": 2, "chunk": 4096},
            fixed={"outer_momentum": 0.0, "nesterov": False},
        ),
        AlgorithmInfo(
            "moshpit",
            "Moshpit",
            "Small groups on a virtual grid of groupSize ** gridDims cells average at each "
            "sync point (no closer sees everyone).",
            "groups",
            (
                _SYNC_EVERY,
                Setting(
                    "group_size",
                    "int",
                    4,
                    "The grid's side: the members of a full group.",
                    ge=2,
                    le=MAX_GROUP_SIZE,
                ),
                Setting(
                    "grid_dims",
                    "int",
                    2,
                    "The grid's dimensions; gridDims rounds average every learner of a full "
                    "grid with every other.",
                    ge=1,
                    le=MAX_GRID_DIMS,
                ),
            ),
        ),
    )
}

# Per-learner Session settings (not in the manifest), with the exchanges they apply to.
SESSION: dict[str, tuple[Setting, tuple[str, ...]]] = {
    s.name: (s, exchanges)
    for s, exchanges in (
        (
            Setting(
                "quorum",
                "int",
                1,
                "Contributions a round may close with after roundTimeout.",
                ge=1,
            ),
            ("rounds",),
        ),
        (
            Setting(
                "round_timeout",
                "float",
                10.0,
                "Seconds a round (a group round, for Moshpit) waits for the missing.",
                gt=0,
            ),
            ("rounds", "groups"),
        ),
        (
            Setting(
                "overlap",
                "int",
                0,
                "Local steps a contribution's commit may be applied late (0: exact).",
                ge=0,
            ),
            ("rounds",),
        ),
        (
            Setting(
                "mixing",
                "float",
                None,
                "How a late commit is applied: unset keeps the local progress; alpha blends "
                "alpha * local + (1 - alpha) * commit.",
                ge=0,
                lt=1,
                nullable=True,
            ),
            ("rounds",),
        ),
        (
            Setting(
                "keep_rounds",
                "int",
                2,
                "Newest commits per fragment kept in the mailbox (verify can check them).",
                ge=1,
            ),
            ("rounds", "groups"),
        ),
    )
}

# The built-in node's own settings (python -m gradientmail.demo.node).
NODE: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("steps", "int", 200, "Training steps of the built-in node.", ge=1),
        Setting(
            "task",
            "choice",
            "lm",
            "What the built-in node trains: lm (a byte-level language model) or synthetic "
            "(a small MLP, seconds per thousand steps).",
            choices=("lm", "synthetic"),
        ),
    )
}

# The built-in node's language model sizes (its GRADIENTMAIL_LM keys).
LM_SIZES: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("d_model", "int", 64, "Width of the model.", ge=1),
        Setting("layers", "int", 2, "Transformer layers.", ge=1),
        Setting("heads", "int", 4, "Attention heads (dModel is a multiple of it).", ge=1),
        Setting("context", "int", 128, "Bytes per training window.", ge=1),
        Setting("batch", "int", 12, "Windows per batch.", ge=1),
    )
}

# How every node of a run is launched (the run's own fields: spec.procsPerNode, not the
# algorithm section's): the same for every algorithm.
_PROCS_PER_NODE = Setting(
    "procs_per_node",
    "int",
    1,
    "Processes per node: with P > 1 each node runs its command as P local ranks with "
    "torchrun's environment (RANK, WORLD_SIZE=P, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one "
    "learner whose ranks live and die together.",
    ge=1,
)
LAUNCH: dict[str, Setting] = {_PROCS_PER_NODE.name: _PROCS_PER_NODE}
