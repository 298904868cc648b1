"""``python -m bench.profile NAME [--quick] [--rate 100] [--top 15] [-- EXTRA...]``: run one
benchmark of the suite under py-spy and say where the time goes.

Two py-spy samplers follow the benchmark and its subprocesses: one keeps only running
threads (CPU: hot spots), one waiting threads too (wall: a lock, a sleep or the store is time
too); as they sample the same run at the same rate, ``wall − CPU`` for a line estimates the
time threads waited there. Printed, and written to ``bench/results/<UTC time>-<NAME>-
profile.md``: threads by process and name prefix (``gm-comm``, ``gm-sync``, ``train``...)
with CPU and wall shares; hot lines by self samples; waits; functions in ``gradientmail/``
by inclusive samples. The collapsed stacks (``<stamp>-<NAME>.folded``: wall,
``<stamp>-<NAME>-cpu.folded``: CPU) load into speedscope.app or ``flamegraph.pl``.
"""

from __future__ import annotations

import argparse
import contextlib
import linecache
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench.__main__ import BENCHMARKS

RESULTS = h.ROOT / "bench" / "results"
OURS = h.ROOT / "gradientmail"

PTRACE_HELP = """\
py-spy reads the benchmark's memory with ptrace, which this machine refused. Either:
  - run as root: sudo env "PATH=$PATH" {python} -m bench.profile ...
  - allow tracing your own processes: sudo sysctl kernel.yama.ptrace_scope=0
  - in a container, start it with --cap-add SYS_PTRACE (docker) or the SYS_PTRACE capability"""


# -- running the benchmark under py-spy ------------------------------------------------------


def find_pyspy() -> str | None:
    """py-spy next to this Python (the venv's), else on ``PATH``."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, start time)`` of ``pid`` from /proc, or None when it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # state, ppid, ... (stat(5) from field 3)
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


class Tree:
    """Every process descended from ``root`` seen while the benchmark ran, by pid and start
    time: processes that left the tree (a new session, a dead parent) are still ended, and
    a reused pid is never signalled."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, int] = {}
        self.cmdlines: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="profile-tree", daemon=True)
        self._thread.start()

    def scan(self) -> None:
        children: dict[int, list[int]] = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            stat = _proc_stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
        todo = [self.root]
        while todo:
            for child in children.get(todo.pop(), []):
                stat = _proc_stat(child)
                if stat is not None:
                    if child not in self.seen:
                        self.seen[child] = stat[1]
                        with contextlib.suppress(OSError):
                            raw = Path(f"/proc/{child}/cmdline").read_bytes()
                            self.cmdlines[child] = raw.replace(b"\0", b" ").decode(errors="replace")
                    todo.append(child)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(OSError):
                self.scan()

    def alive(self) -> list[int]:
        return [pid for pid, start in self.seen.items() if (_proc_stat(pid) or (0, -1))[1] == start]

    def end(self, grace: float = 5.0) -> list[tuple[int, str]]:
        """Stop watching; SIGTERM then SIGKILL whatever of the tree is still alive."""
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self.scan()
        left = [(pid, self.cmdlines.get(pid, "?").strip()) for pid in self.alive()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.alive():
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
        return left


@dataclass
class Run:
    command: list[str]
    returncode: int | None  # None: stopped (timeout, Ctrl-C)
    stopped: str
    seconds: float
    output: str
    spy_logs: dict[str, str]
    spy_codes: dict[str, int | None]
    left_behind: list[tuple[int, str]]  # (pid, command line)


def _stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], first: int, wait: float) -> None:
    """Signal ``first``, wait ``wait`` s, then kill."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.send_signal(first)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_profiled(
    bench_cmd: list[str], outputs: dict[str, Path], *, pyspy: str, rate: int, native: bool,
    timeout: float,
) -> Run:  # fmt: skip
    """Start ``bench_cmd``, attach one py-spy per output (``cpu``; ``wall`` with --idle),
    echo the benchmark's stdout, stop everything at ``timeout`` or Ctrl-C, and end every
    process the benchmark left behind."""
    started = time.monotonic()
    # New sessions: Ctrl-C reaches only this script, which then stops the benchmark so that
    # the samplers see it exit and write what they have.
    bench = subprocess.Popen(bench_cmd, cwd=h.ROOT, stdout=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, bufsize=1,
                             start_new_session=True)  # fmt: skip
    tree = Tree(bench.pid)
    spies: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    lines: list[str] = []

    def echo() -> None:
        assert bench.stdout is not None
        for line in bench.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=echo, name="profile-echo", daemon=True)
    reader.start()
    stopped = ""
    try:
        for kind, out in outputs.items():
            cmd = [pyspy, "record", "--format", "raw", "--subprocesses", "--threads",
                   "--full-filenames", "--rate", str(rate), "--pid", str(bench.pid), "-o", str(out),
                   *(["--idle"] if kind == "wall" else []),
                   # --native pauses the process for each sample; else the timings barely move
                   "--native" if native else "--nonblocking"]  # fmt: skip
            logs[kind] = out.with_suffix(".pyspy.log")
            with logs[kind].open("wb") as log:
                spies[kind] = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )  # fmt: skip
        deadline = started + timeout
        while bench.poll() is None:
            failed = [k for k, s in spies.items() if s.poll() not in (None, 0)]
            if failed:
                stopped = f"py-spy ({failed[0]}) exited with {spies[failed[0]].returncode}"
                break
            if time.monotonic() > deadline:
                stopped = f"timeout after {timeout:.0f} s"
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        _stop(bench, signal.SIGTERM, 5)
        left = tree.end()
        reader.join(10)
        for spy in spies.values():
            # py-spy stops on its own when the process it follows exits; SIGINT makes it
            # write what it has, should it not.
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(30)
            _stop(spy, signal.SIGINT, 10)
    spy_logs = {}
    for kind, path in logs.items():
        with contextlib.suppress(OSError):
            spy_logs[kind] = path.read_text(errors="replace")
            path.unlink()
    return Run(bench_cmd, None if stopped else bench.returncode, stopped,
               time.monotonic() - started, "".join(lines), spy_logs,
               {kind: spy.returncode for kind, spy in spies.items()}, left)  # fmt: skip


# -- reading the collapsed stacks ------------------------------------------------------------

# With --subprocesses each stack starts with its process's ancestry, outermost first.
_PROCESS = re.compile(r'process (\d+):"(.*?)";(?=process \d+:"|thread \()')
_THREAD = re.compile(r"thread \(([^)]*)\)(?:: ([^;]*))?")
_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int


@dataclass
class Stack:
    chain: list[tuple[int, str]]  # (pid, command line) from the sampled root to this process
    thread: str
    frames: list[Frame]  # outermost first
    count: int


def parse(path: Path) -> list[Stack]:
    """py-spy's raw output (``--threads --subprocesses``): one stack per line,
    ``process PID:"CMD";thread (TID): NAME;frame;frame COUNT``."""
    stacks: list[Stack] = []
    if not path.exists():
        return stacks
    for raw in path.read_text(errors="replace").splitlines():
        text, _, number = raw.rpartition(" ")
        chain, pos = [], 0
        while match := _PROCESS.match(text, pos):
            chain.append((int(match[1]), match[2]))
            pos = match.end()
        match = _THREAD.match(text, pos)
        if not chain or not match or not number.isdigit():
            continue
        tid, name = match.groups()
        rest = text[match.end() :].lstrip(";")
        frames = []
        for part in rest.split(";") if rest else []:
            fm = _FRAME.match(part)
            frames.append(Frame(fm[1], fm[2], int(fm[3])) if fm else Frame(part, "", 0))
        stacks.append(Stack(chain, name or f"(unnamed {tid})", frames, int(number)))
    return stacks


def thread_group(name: str) -> str:
    """``gm-comm-7`` -> ``gm-comm``; ``gm-hash_0`` -> ``gm-hash``; ``train-3`` -> ``train``;
    ``Thread-5 (worker)`` -> ``Thread (worker)``."""
    if name.startswith("(unnamed"):
        return "(unnamed)"
    match = re.match(r"^(gm-[a-z]+)", name)
    return match[1] if match else re.sub(r"[-_]\d+\b", "", name)


def process_role(chain: Sequence[tuple[int, str]]) -> str:
    """``bench`` for the benchmark; a child by its command line (``-m module``, a script),
    ``spawned`` for a multiprocessing child, and ``<parent> fork`` for a fork."""
    if len(chain) == 1:
        return "bench"
    parent = process_role(chain[:-1])
    cmdline = chain[-1][1]
    if cmdline == chain[-2][1]:
        return f"{parent} fork"
    if "spawn_main" in cmdline or "--multiprocessing-fork" in cmdline:
        return "spawned"
    if "resource_tracker" in cmdline:
        return "resource tracker"
    words = cmdline.split()
    if "-c" in words[:-1]:
        code = " ".join(words[words.index("-c") + 1 :])
        return f"python -c {code[:24]}…" if len(code) > 24 else f"python -c {code}"
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    scripts = [w for w in words[1:] if w.endswith(".py")]
    return Path(scripts[0] if scripts else words[0] if words else "?").name


def short_path(path: str) -> str:
    """Relative to the repository, to site-packages, or to the standard library."""
    if not path:
        return ""
    parts = Path(path).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(h.ROOT))
    for i, part in enumerate(parts):
        if re.fullmatch(r"python3\.\d+", part) and i + 1 < len(parts):
            return "/".join(parts[i + 1 :])
    return Path(path).name


def is_repo(frame: Frame) -> bool:
    return frame.file.startswith(str(h.ROOT) + os.sep) and "/.venv/" not in frame.file


# The repository's sources as they were when the benchmark started, so that a line number is
# shown with the line it meant even when a file is edited during the run.
SOURCES: dict[str, list[str]] = {}


def snapshot_sources() -> None:
    for folder in ("gradientmail", "bench"):
        for path in (h.ROOT / folder).rglob("*.py"):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                SOURCES[str(path)] = path.read_text().splitlines()


def source(frame: Frame, width: int = 48) -> str:
    lines = SOURCES.get(frame.file)
    if lines is not None:
        text = lines[frame.line - 1].strip() if 0 < frame.line <= len(lines) else ""
    else:
        text = linecache.getline(frame.file, frame.line).strip() if frame.file else ""
    text = text.replace("|", "\\|").replace("`", "'")
    return text if len(text) <= width else text[: width - 1] + "…"


def where(frame: Frame) -> str:
    return f"{short_path(frame.file)}:{frame.line}" if frame.file else "(native)"


NO_PYTHON = Frame("(no Python frame: native code or starting up)", "", 0)


@dataclass
class Profile:
    """The two samplers' stacks, and what the tables count."""

    cpu: list[Stack]
    wall: list[Stack]
    rate: int
    roles: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cpu_total = sum(s.count for s in self.cpu)
        self.wall_total = sum(s.count for s in self.wall)
        for s in self.cpu + self.wall:
            self.roles.setdefault(s.chain[-1][0], process_role(s.chain))

    def group(self, s: Stack) -> tuple[str, str]:
        return self.roles[s.chain[-1][0]], thread_group(s.thread)

    def count(self, key: Callable[[Stack], Iterable[Any]]) -> tuple[Counter[Any], Counter[Any]]:
        """Samples per key (each stack counts once per key it yields): CPU, wall."""
        out: tuple[Counter[Any], Counter[Any]] = (Counter(), Counter())
        for counter, stacks in zip(out, (self.cpu, self.wall), strict=True):
            for s in stacks:
                for k in key(s):
                    counter[k] += s.count
        return out


def thread_table(p: Profile) -> h.Table:
    cpu, wall = p.count(lambda s: [p.group(s)])
    threads: dict[tuple[str, str], set[tuple[int, str]]] = {}
    for s in p.cpu + p.wall:
        threads.setdefault(p.group(s), set()).add((s.chain[-1][0], s.thread))
    t = h.Table(
        "Threads: where the samples fall",
        ["process", "thread", "threads", "wall s", "wall %", "CPU s", "CPU %", "busy"],
        note="Grouped by process (`bench`: the benchmark's own; `spawned`: a multiprocessing "
        "child, such as a learner of `step`/`sync`; `fork`: a forked copy) and thread-name "
        "prefix. `wall s`/`CPU s`: thread-seconds sampled "
        f"(samples / {p.rate} Hz), waiting included / running only; `busy`: CPU / wall.",
    )
    for key in sorted(set(cpu) | set(wall), key=lambda k: (-cpu[k], -wall[k])):
        n_proc = len({pid for pid, _ in threads[key]})
        # Two samplers, sampled independently: a busy thread can read a little over 100%.
        busy = f"{min(100.0, 100 * cpu[key] / wall[key]):.0f}%" if wall[key] else "-"
        t.add(f"{key[0]} ×{n_proc}" if n_proc > 1 else key[0], key[1], len(threads[key]),
              f"{wall[key] / p.rate:.1f}", h.pct(wall[key], p.wall_total),
              f"{cpu[key] / p.rate:.1f}", h.pct(cpu[key], p.cpu_total), busy)  # fmt: skip
    return t


def _leaf(s: Stack) -> list[tuple[Frame, Frame | None]]:
    """The innermost frame, and the innermost frame of this repository below it."""
    leaf = s.frames[-1] if s.frames else NO_PYTHON
    return [(leaf, next((f for f in reversed(s.frames[:-1]) if is_repo(f)), None))]


def _under(caller: Frame | None) -> str:
    return f"{caller.function} ({where(caller)})" if caller else "-"


def _pool_idle(frame: Frame) -> bool:
    """A thread pool's worker waiting for work (not time anything waited for)."""
    return frame.function == "_worker" and frame.file.endswith("concurrent/futures/thread.py")


def hot_table(p: Profile, top: int) -> h.Table:
    cpu, wall = p.count(_leaf)
    t = h.Table(
        f"Hot spots: top {top} lines by self samples (running threads)",
        ["CPU %", "wall %", "function", "where", "source", "under (innermost of ours)"],
        note="The innermost Python line of each sample: a line that calls into C (hashlib, "
        "torch, file I/O) holds the time spent in that call. `under`: the innermost frame "
        "of this repository above it.",
    )
    for (frame, caller), n in cpu.most_common(top):
        t.add(h.pct(n, p.cpu_total), h.pct(wall[(frame, caller)], p.wall_total), frame.function,
              where(frame), source(frame, 40), _under(caller))  # fmt: skip
    return t


def wait_table(p: Profile, top: int) -> h.Table:
    cpu, wall = p.count(_leaf)
    waited = Counter(
        {k: wall[k] - cpu[k] for k in wall if wall[k] > cpu[k] and not _pool_idle(k[0])}
    )
    pool_idle = sum(n for k, n in wall.items() if _pool_idle(k[0]))
    t = h.Table(
        f"Waits: top {top} lines by wall − CPU self samples",
        ["wait s", "wall %", "function", "where", "under (innermost of ours)"],
        note="Where threads sat without running (a lock, a sleep, a queue, a blocking read, "
        "an event loop's select): wall samples minus CPU samples of the same line, in "
        "thread-seconds. Long-lived helper threads waiting for work show here too: read "
        "with the threads table. Left out: thread-pool workers waiting for a task "
        f"({pool_idle / p.rate:.1f} thread-s).",
    )
    for (frame, caller), n in waited.most_common(top):
        t.add(f"{n / p.rate:.1f}", h.pct(wall[(frame, caller)], p.wall_total), frame.function,
              where(frame), _under(caller))  # fmt: skip
    return t


def ours_table(p: Profile, top: int) -> h.Table:
    def ours(s: Stack) -> set[tuple[str, str]]:
        mine = str(OURS) + os.sep
        return {(f.function, short_path(f.file)) for f in s.frames if f.file.startswith(mine)}

    cpu, wall = p.count(ours)
    t = h.Table(
        f"Our code: top {top} functions in gradientmail/ by inclusive samples (cpu)",
        ["CPU %", "wall %", "function", "file"],
        note="A function counts a sample when it is anywhere on the stack (once per "
        "sample); wall % includes time its threads spent waiting below it.",
    )
    for key, _ in sorted(cpu.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        t.add(h.pct(cpu[key], p.cpu_total), h.pct(wall[key], p.wall_total), key[0], key[1])
    return t


def render(p: Profile, top: int) -> str:
    procs = Counter(p.roles.values())
    listing = ", ".join(f"{role} ×{n}" if n > 1 else role for role, n in procs.items())
    summary = (
        f"{p.cpu_total} CPU samples ({p.cpu_total / p.rate:.1f} thread-s running), "
        f"{p.wall_total} wall samples ({p.wall_total / p.rate:.1f} thread-s) at {p.rate} Hz; "
        f"processes: {listing or '-'}"
    )
    tables = [thread_table(p), hot_table(p, top)]
    tables += [wait_table(p, top)] if p.wall else []
    tables.append(ours_table(p, top))
    return "\n\n".join(["## Where the time goes", summary, *(t.render() for t in tables)])


# -- the command -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile",
        description="Run a benchmark under py-spy and print where the time goes: by thread, "
        "hot lines, waits, and our functions. Arguments after -- go to python -m bench "
        "(e.g. -- --no-hivemind).",
    )
    add = parser.add_argument
    add("name", choices=list(BENCHMARKS), help="the benchmark to profile")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the benchmark's small sizes")
    size.add_argument("--large", action="store_true", help="the benchmark's full ranges")
    add("--rate", type=int, default=100, help="samples per second (100)")
    add("--top", type=int, default=15, help="rows per table (15)")
    add("--timeout", type=float, default=1200, help="stop the benchmark after this (s, 1200)")
    add("--native", action="store_true", help="py-spy --native: C/C++ frames too (pauses it)")
    add("--parse", type=Path, metavar="FOLDED", help="only print the tables of an earlier "
        "run's <stamp>-<name>.folded (same --rate)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rate < 1 or args.top < 1:
        parser.error("--rate and --top must be >= 1")

    if args.parse is not None:
        cpu_path = args.parse.with_name(args.parse.stem + "-cpu.folded")
        print(render(Profile(parse(cpu_path), parse(args.parse), args.rate), args.top))
        return 0

    pyspy = find_pyspy()
    if pyspy is None:
        print(f"py-spy not found (beside this Python or on PATH); install it with\n"
              f"  {sys.executable} -m pip install py-spy", file=sys.stderr)  # fmt: skip
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = RESULTS / f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{args.name}"
    outputs = {"cpu": Path(f"{base}-cpu.folded"), "wall": Path(f"{base}.folded")}
    preset = ["--quick"] if args.quick else ["--large"] if args.large else []
    bench_cmd = [sys.executable, "-m", "bench", args.name, *preset, "--no-json", *extra]
    h.progress(f"profiling: {' '.join(bench_cmd)} (py-spy at {args.rate} Hz)")

    snapshot_sources()
    run = run_profiled(
        bench_cmd, outputs, pyspy=pyspy, rate=args.rate, native=args.native, timeout=args.timeout
    )
    spy_failed = {
        kind: run.spy_logs.get(kind, "")
        for kind, path in outputs.items()
        if run.spy_codes.get(kind) != 0 or not path.exists()
    }
    for kind, log in spy_failed.items():
        print(f"\npy-spy ({kind}) said:\n{log.strip()}", file=sys.stderr)
    said = " ".join(spy_failed.values()).lower()
    if any(word in said for word in ("permission", "ptrace", "operation not permitted")):
        print(PTRACE_HELP.format(python=sys.executable), file=sys.stderr)
    if run.left_behind:
        print(f"\nended {len(run.left_behind)} processes the benchmark left behind:",
              file=sys.stderr)  # fmt: skip
        for pid, cmdline in run.left_behind:
            print(f"  {pid}: {cmdline[:200]}", file=sys.stderr)
    if run.stopped:
        print(f"\nbenchmark stopped: {run.stopped}; the tables cover the run until then",
              file=sys.stderr)  # fmt: skip
    if not any(path.exists() for path in outputs.values()):
        print("no profile was written", file=sys.stderr)
        return 2

    tables = render(Profile(parse(outputs["cpu"]), parse(outputs["wall"]), args.rate), args.top)
    print(f"\n{tables}")
    status = run.stopped or f"exit status {run.returncode}"
    preset_name = "quick" if args.quick else "large" if args.large else "default"
    stacks = ", ".join(f"`{p.relative_to(h.ROOT)}`" for p in outputs.values())
    md = [
        f"# Profile: {args.name} ({preset_name})",
        f"Command: `{' '.join(run.command)}` under py-spy {'--native ' if args.native else ''}"
        f"at {args.rate} Hz; {run.seconds:.0f} s, {status}.",
        f"Machine: {h.describe(h.machine())}",
        f"Stacks: {stacks}",
        tables,
        "## The benchmark's output",
        run.output.rstrip(),
    ]
    md_path = Path(f"{base}-profile.md")
    md_path.write_text("\n\n".join(md) + "\n")
    print(f"\nProfile: {md_path.relative_to(h.ROOT)}; stacks: {stacks.replace('`', '')}")
    return 1 if run.stopped or spy_failed else run.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
