"""hivemind's Moshpit All-Reduce at N peers, run by a venv that has hivemind (never by the
project's venv):

    build/hivemind-venv/bin/python -I bench/_hivemind_moshpit_worker.py --peers 4 --rounds 4

N forked processes (hivemind needs fork), each its own DHT peer (peer 0 the bootstrap) and
a ``DecentralizedAverager(target_group_size=M)`` over ``--params`` float32. N = M ** d: peer
``i`` is grid cell ``i`` in base M and starts with ``initial_group_bits`` its coordinates
along dimensions 1 .. d-1; hivemind shifts each round's chunk index into the key, so round t
averages along dimension ``(t - 1) % d`` (hivemind's ``test_allreduce_grid``). After
``--warmup`` untimed rounds every peer sets its tensor to ``float(i)``, meets the others
once, and runs ``--rounds`` blocking ``step()`` calls back to back. Prints one JSON line:
per peer and round, when ``step()`` was called and returned (``time.monotonic``), whether it
succeeded, its group's size and the squared distance to the initial global mean. Only
stdlib, torch and hivemind are imported here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any


def _bits(peer: int, group_size: int, dims: int) -> str:
    """The initial group bits of grid cell ``peer``: its coordinates along dimensions
    1 .. d-1 in base ``group_size``, ``log2(group_size)`` bits each, dimension 1 first (the
    first hivemind drops, so round 2 averages along it)."""
    width = group_size.bit_length() - 1
    coords = [(peer // group_size**dim) % group_size for dim in range(1, dims)]
    return "".join(format(c, "b").rjust(width, "0") for c in coords)


def _peer(index: int, maddrs: Any, barrier: Any, queue: Any, args: argparse.Namespace) -> None:
    import hivemind  # type: ignore[import-not-found]  # only in hivemind's venv
    import torch
    from hivemind.averaging import DecentralizedAverager  # type: ignore[import-not-found]

    torch.set_num_threads(1)
    try:
        if index == 0:
            dht = hivemind.DHT(start=True)
            maddrs.send([str(m) for m in dht.get_visible_maddrs()])
            maddrs.close()
        else:
            dht = hivemind.DHT(initial_peers=maddrs, start=True)
        tensor = torch.zeros(args.params, dtype=torch.float32)
        averager = DecentralizedAverager(
            [tensor],
            dht,
            prefix="gradientmail-moshpit",
            target_group_size=args.group_size,
            min_group_size=2,
            initial_group_bits=_bits(index, args.group_size, args.dims),
            min_matchmaking_time=args.min_matchmaking_time,
            request_timeout=args.min_matchmaking_time / 2,
            start=True,
        )
        mean = (args.peers - 1) / 2.0
        barrier.wait(timeout=args.join_timeout)  # every peer is up before the first round
        warm = []
        for r in range(args.warmup):
            warm.append(_round(averager, index, r, args, mean))
        with averager.get_tensors() as tensors:
            tensors[0].fill_(float(index))
            sq0 = float(((tensors[0].double() - mean) ** 2).sum())
        barrier.wait(timeout=args.join_timeout)
        rounds = [_round(averager, index, r, args, mean) for r in range(args.rounds)]
        queue.put(
            {
                "peer": index,
                "bits": _bits(index, args.group_size, args.dims),
                "final_bits": averager.get_group_bits(),
                "warmup": warm,
                "sq0": sq0,
                "rounds": rounds,
            }
        )
        barrier.wait(timeout=args.join_timeout)  # nobody leaves while another may need it
        averager.shutdown()
        dht.shutdown()
    except BaseException as exc:
        queue.put({"peer": index, "error": f"{type(exc).__name__}: {exc}"})
        raise


def _round(
    averager: Any, index: int, r: int, args: argparse.Namespace, mean: float
) -> dict[str, Any]:
    t0 = time.monotonic()
    group = 0
    try:  # a step that finds no group (None) or raises is a failed round; the next retries
        result = averager.step(timeout=args.timeout)
        if result is not None:
            group = len(result)
    except Exception as exc:
        print(f"peer {index} round {r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        result = None
    t1 = time.monotonic()
    with averager.get_tensors() as tensors:
        sq = float(((tensors[0].double() - mean) ** 2).sum())
    return {"called": t0, "returned": t1, "ok": result is not None, "group": group, "sq": sq}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-matchmaking-time", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--join-timeout", type=float, default=300.0)
    args = parser.parse_args()
    m, n = args.group_size, args.peers
    dims = 0
    while m**dims < n:
        dims += 1
    if m < 2 or m & (m - 1) or m**dims != n:
        parser.error(f"--peers must be a power of --group-size, a power of 2 (got N={n}, M={m})")
    args.dims = max(dims, 1)

    import hivemind
    import torch

    mp.set_start_method("fork", force=True)
    started = time.monotonic()
    barrier = mp.Barrier(n)
    queue: Any = mp.Queue()
    receive, send = mp.Pipe(duplex=False)
    peers = [mp.Process(target=_peer, args=(0, send, barrier, queue, args))]
    peers[0].start()
    maddrs: list[str] = []
    if receive.poll(args.join_timeout):
        maddrs = receive.recv()
    if maddrs:
        for i in range(1, n):
            peers.append(mp.Process(target=_peer, args=(i, maddrs, barrier, queue, args)))
            peers[-1].start()
    up = time.monotonic() - started
    results: dict[int, Any] = {}
    deadline = (
        time.monotonic() + args.join_timeout + (args.timeout + 5) * (args.rounds + args.warmup + 2)
    )
    while maddrs and len(results) < n and time.monotonic() < deadline:
        try:
            item = queue.get(timeout=2)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in peers):
                break
            continue
        results[item["peer"]] = item
    for p in peers:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    out = {
        "hivemind": hivemind.__version__,
        "torch": torch.__version__,
        "peers_n": n,
        "group_size": m,
        "dims": args.dims,
        "params": args.params,
        "warmup": args.warmup,
        "min_matchmaking_time": args.min_matchmaking_time,
        "timeout": args.timeout,
        "started_s": up,
        "seconds": time.monotonic() - started,
        "peers": [
            results.get(i, {"peer": i, "error": "no result" if maddrs else "no bootstrap"})
            for i in range(n)
        ],
    }
    print(json.dumps(out), flush=True)
    return 0 if all("rounds" in p for p in out["peers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
