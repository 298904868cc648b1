#!/usr/bin/env bash
# The GPU check (issue 26): every test marked `requires_cuda`, then a bfloat16 run of two
# learners of 2 ranks each (DDP inside each learner; every rank constructs gm.Session the
# same way, rank 0 talks to the mailbox) on the GPUs found, then `gradientmail verify` of
# that run, and ONE table: what ran, on which device, its result, and the peak device
# memory of the process that ran it (torch.cuda.max_memory_allocated over its devices).
#
# Ranks: rank r of each learner on GPU r mod N. With 2 GPUs or more the ranks talk over
# nccl; with one, both ranks share it and talk over gloo (nccl refuses two ranks of one
# group on one device).
#
# Where there is no GPU (no NVIDIA device, or a torch without CUDA) it says so and exits 0.
# It installs nothing: it uses ./.venv when present, else $PYTHON or python3.
#
#   scripts/gpu-check.sh          the check; exit 1 when anything failed
#   scripts/gpu-check.sh --cpu    rehearse the multi-rank run on CPU (gloo, no CUDA tests),
#                                 to check the script itself on a machine without a GPU
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=${PYTHON:-python3}
CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1

if [ "$CPU" = 0 ]; then
    # Cheap first (no torch import): a machine without an NVIDIA device or driver.
    if ! command -v nvidia-smi >/dev/null 2>&1 && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
        echo "gpu-check: no GPU on this machine (no nvidia-smi, no /dev/nvidia*): nothing to run"
        exit 0
    fi
    found=$("$PY" -c 'import torch; print(torch.cuda.device_count(), torch.__version__, torch.version.cuda)' 2>&1)
    if [ $? -ne 0 ]; then
        echo "gpu-check: $PY cannot import torch: ${found##*$'\n'}" >&2
        exit 1
    fi
    read -r GPUS TORCH CUDA <<<"$found"
    if [ "$GPUS" = 0 ]; then
        echo "gpu-check: no GPU usable here (torch $TORCH, CUDA build: $CUDA, devices: 0): nothing to run"
        exit 0
    fi
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
export GM_GPU_CHECK_RESULTS="$RESULTS" PYTHONPATH="$WORK:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# A pytest plugin: one result line per test, with the peak memory over this process's GPUs.
cat >"$WORK/gm_gpu_peak.py" <<'EOF'
import json, os
import pytest, torch

def _devices():
    return range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for d in _devices():
        torch.cuda.reset_peak_memory_stats(d)

def pytest_runtest_logreport(report):
    if report.when != "call" and not (report.when == "setup" and not report.passed):
        return
    peaks = {d: torch.cuda.max_memory_allocated(d) for d in _devices()}
    used = [d for d, b in peaks.items() if b] or list(peaks)[:1]
    device = ", ".join(f"cuda:{d} {torch.cuda.get_device_name(d)}" for d in used) or "cpu"
    line = {"what": report.nodeid, "device": device, "result": report.outcome,
            "peak": max(peaks.values(), default=None)}
    with open(os.environ["GM_GPU_CHECK_RESULTS"], "a") as out:
        out.write(json.dumps(line) + "\n")
EOF

# One rank of a bf16 learner: RANK/WORLD_SIZE come from gradientmail.launch.ranks.
cat >"$WORK/gm_gpu_rank.py" <<'EOF'
import hashlib, json, os, sys
import torch, torch.distributed as dist
import gradientmail as gm

learner, url, backend, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rank = int(os.environ["RANK"])
line = {"what": f"bf16 DDP: {learner} rank {rank} ({backend})", "result": "failed", "peak": None}
try:
    dist.init_process_group(backend)
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        line["device"] = f"{device} {torch.cuda.get_device_name(device)}"
    else:
        device = torch.device("cpu")
        line["device"] = "cpu"
    torch.manual_seed(0)  # the same initial model on every rank and learner
    model = torch.nn.Sequential(
        torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 256),
    ).to(device=device, dtype=torch.bfloat16)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if backend == "nccl" else None
    )
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 * int(learner[-1]) + rank)
    box = gm.open_mailbox(url)
    algorithm = gm.DiLoCo(sync_every=5, fragments=2)
    with gm.Session(ddp, algorithm=algorithm, mailbox=box, learner_id=learner,
                    round_timeout=60.0, keep_rounds=1000) as session:  # all verifiable
        if rank == 0:  # the learners start together: the leader lines up in the mailbox
            gm.Barrier(mailbox=box, learner_id=learner).wait("start", parties=2, timeout=300)
        dist.barrier()
        for _ in range(steps):
            tokens = torch.randint(0, 256, (8, 33), generator=generator).to(device)
            logits = ddp(tokens[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(samples=tokens.shape[0])
        session.sync()
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode() + value.detach().cpu().view(torch.uint8).numpy().tobytes())
    line.update(result="passed", params=digest.hexdigest(), loss=float(loss),
                dtypes=sorted({str(t.dtype) for t in model.parameters()}))
    if device.type == "cuda":
        line["peak"] = torch.cuda.max_memory_allocated(device)
except BaseException as exc:  # reported in the table, and the exit status
    line["error"] = f"{type(exc).__name__}: {exc}"[:300]
    raise
finally:
    with open(os.environ["GM_GPU_CHECK_RESULTS"], "a") as out:
        out.write(json.dumps(line) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
EOF

status=0
if [ "$CPU" = 0 ]; then
    echo "gpu-check: $GPUS GPU(s), torch $TORCH (CUDA $CUDA): the requires_cuda tests" >&2
    "$PY" -m pytest -q -p no:cacheprovider -p gm_gpu_peak -m requires_cuda tests/ >"$WORK/pytest.log" 2>&1
    code=$?
    # 5: no test selected (none marked requires_cuda) is not a failure of the check.
    if [ $code -ne 0 ] && [ $code -ne 5 ]; then status=1; tail -n 40 "$WORK/pytest.log" >&2; fi
    BACKEND=gloo
    [ "$GPUS" -ge 2 ] && BACKEND=nccl
else
    BACKEND=gloo
fi

echo "gpu-check: two bf16 learners of 2 ranks each ($BACKEND)" >&2
MAILBOX="file://$WORK/mailbox"
pids=()
for learner in gpu-learner-0 gpu-learner-1; do
    "$PY" -m gradientmail.launch.ranks --procs 2 -- \
        "$PY" "$WORK/gm_gpu_rank.py" "$learner" "$MAILBOX" "$BACKEND" 20 \
        >"$WORK/$learner.log" 2>&1 &
    pids+=($!)
done
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then status=1; tail -n 30 "$WORK/gpu-learner-$i.log" >&2; fi
done
"$PY" -m gradientmail.cli verify "$MAILBOX" >"$WORK/verify.log" 2>&1
verified=$?
[ $verified -ne 0 ] && status=1 && tail -n 20 "$WORK/verify.log" >&2
"$PY" -m gradientmail.cli status "$MAILBOX" --json >"$WORK/status.json" 2>>"$WORK/verify.log"

"$PY" - "$RESULTS" "$WORK/verify.log" "$verified" "$WORK/status.json" <<'EOF' || status=1
import json, sys
from collections import defaultdict

results = sorted((json.loads(line) for line in open(sys.argv[1]) if line.strip()),
                 key=lambda r: (r["what"].startswith("bf16"), r["what"]))
verify = open(sys.argv[2]).read().strip().splitlines()
try:
    run = json.load(open(sys.argv[4]))
    said = f"{run['rounds_committed']} rounds committed, dtypes {', '.join(run['dtypes'])}"
except (ValueError, KeyError, TypeError) as exc:
    said = f"status unreadable ({exc!r})"
results.append({"what": f"gradientmail verify ({said}): " + (verify[0] if verify else "no output"),
                "device": "cpu (host)", "result": "passed" if sys.argv[3] == "0" else "failed",
                "peak": None})
# The ranks of one learner must hold the same parameters, bit for bit.
by_learner = defaultdict(set)
for r in results:
    if "params" in r:
        by_learner[r["what"].split(" rank ")[0]].add(r["params"])
failed = False
for learner, digests in sorted(by_learner.items()):
    same = len(digests) == 1
    failed |= not same
    results.append({"what": f"{learner}: ranks bitwise identical", "device": "-",
                    "result": "passed" if same else "FAILED", "peak": None})
ranks = [r for r in results if r["what"].startswith("bf16 DDP") and "rank " in r["what"]]
if len(ranks) != 4:
    failed = True
    results.append({"what": f"bf16 DDP: {len(ranks)} of 4 ranks reported", "device": "-",
                    "result": "FAILED", "peak": None})

def mib(b):
    return "-" if b is None else f"{b / 2**20:,.1f} MiB"

rows = [(r["what"], r.get("device", "?"), r["result"] + (f" ({r['error']})" if "error" in r else ""),
         mib(r["peak"])) for r in results]
head = ("what ran", "device", "result", "peak device memory")
widths = [max(len(row[i]) for row in [head, *rows]) for i in range(4)]
for row in [head, tuple("-" * w for w in widths), *rows]:
    print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
failed |= any(r["result"] not in ("passed", "skipped") for r in results)
sys.exit(1 if failed else 0)
EOF
exit $status
