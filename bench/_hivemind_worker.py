"""The hivemind reference, run by a venv that has hivemind (never by the project's venv):

    build/hivemind-venv/bin/python -I bench/_hivemind_worker.py --params 10M --rounds 8

Two processes (forked: hivemind needs the fork start method) each hold a float32 tensor of
``--params`` elements and run ``DecentralizedAverager.step()`` (matchmaking + all-reduce,
blocking) ``--warmup`` + ``--rounds`` times over loopback, both released together by a
barrier before each round. Prints one JSON line on stdout: per round and peer, when
``step()`` was called and when it returned (``time.monotonic``, shared by the processes of
one machine), whether it succeeded, and the averaged tensor's first and last elements (the
parent checks the two peers agree). Only stdlib, torch and hivemind are imported here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)


def _peer(
    index: int,
    maddrs: list[str],
    barrier: Any,
    queue: Any,
    args: argparse.Namespace,
) -> None:
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager

    torch.set_num_threads(1)  # as the gradientmail learner processes: two processes, two cores
    try:
        dht = hivemind.DHT(initial_peers=maddrs, start=True)
        tensor = torch.full((args.params,), float(index + 1))
        averager = DecentralizedAverager(
            [tensor],
            dht,
            prefix="gradientmail-bench",
            target_group_size=2,
            min_group_size=2,
            min_matchmaking_time=args.min_matchmaking_time,
            request_timeout=min(3.0, args.min_matchmaking_time / 2),
            start=True,
        )
        rounds = []
        for r in range(args.warmup + args.rounds):
            with averager.get_tensors() as tensors:
                tensors[0].add_(float(index + 1))  # "training": the peers drift apart
            barrier.wait(timeout=120)
            t0 = time.monotonic()
            try:  # a round that finds no group is recorded as failed; the next one retries
                result = averager.step(timeout=args.timeout)
            except Exception as exc:
                print(f"peer {index} round {r}: {type(exc).__name__}: {exc}", file=sys.stderr)
                result = None
            t1 = time.monotonic()
            with averager.get_tensors() as tensors:
                first, last = float(tensors[0][0]), float(tensors[0][-1])
            rounds.append(
                {
                    "round": r,
                    "called": t0,
                    "returned": t1,
                    "ok": result is not None,
                    "first": first,
                    "last": last,
                }
            )
        queue.put({"peer": index, "rounds": rounds})
        barrier.wait(timeout=120)  # neither leaves while the other may still need it
        averager.shutdown()
        dht.shutdown()
    except BaseException as exc:
        queue.put({"peer": index, "error": f"{type(exc).__name__}: {exc}"})
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=_count, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--min-matchmaking-time", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()

    import hivemind
    import torch

    mp.set_start_method("fork", force=True)
    started = time.monotonic()
    dht = hivemind.DHT(start=True)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    barrier = mp.Barrier(2)
    queue: Any = mp.Queue()
    peers = [mp.Process(target=_peer, args=(i, maddrs, barrier, queue, args)) for i in range(2)]
    for p in peers:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + (args.timeout + 5) * (args.rounds + args.warmup + 2)
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            item = queue.get(timeout=5)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in peers):
                break
            continue
        results[item["peer"]] = item
    for p in peers:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    dht.shutdown()
    out = {
        "hivemind": hivemind.__version__,
        "torch": torch.__version__,
        "params": args.params,
        "warmup": args.warmup,
        "min_matchmaking_time": args.min_matchmaking_time,
        "seconds": time.monotonic() - started,
        "peers": [results.get(i, {"peer": i, "error": "no result"}) for i in range(2)],
    }
    print(json.dumps(out), flush=True)
    return 0 if all("rounds" in p for p in out["peers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
