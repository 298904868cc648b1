"""How ``scripts/test.sh`` spreads the suite over pytest-xdist workers (``-n 2 --dist loadgroup``).

Two decisions, made here and nowhere else (``tests/conftest.py`` hooks them in):

- **Which tests stay together.** A module whose tests share a module-scoped fixture that is
  expensive to build (a trained run), or that trains real nodes for minutes, is listed in
  :data:`TOGETHER`: its tests are one unit (shared with the modules of the same name)
  and run on one worker, in file order. Every other test is a unit of its own and goes to
  whichever worker is free. (xdist's own ``xdist_group`` mark works by rewriting
  ``item._nodeid``, which pytest 9.2 no longer reads, so :class:`Scheduler` decides the
  units itself.)
- **In which order.** Under xdist the longest units go first (longest-processing-time
  first), so the two workers finish close together instead of one waiting on a long test
  that started last. The times come from ``tests/support/durations.json``, measured by a
  run with ``--junitxml`` and written by ``python -m tests.support.schedule JUNIT.xml``;
  a test it does not know counts as quick. The order only changes which worker runs what,
  never what a test checks; outside xdist nothing is reordered.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).with_name("durations.json")

# Modules whose tests must share one worker, by unit name: a module-scoped fixture each test
# needs (built once per worker that runs any of them), or tests that train real node
# processes for minutes and must not run beside each other (two such runs at once on two
# cores starved both past their guards).
TOGETHER = {
    "tests/engine/test_totals.py": "tests/engine/test_totals.py",  # a trained run, shared
    "tests/cli/test_moshpit_tools.py": "tests/cli/test_moshpit_tools.py",  # a Moshpit run
    "tests/operator/test_operator_e2e.py": "trains-nodes",
    "tests/charts/test_install.py": "trains-nodes",
}

# Below this a test's time is noise: left out of durations.json, ordered as collected.
QUICK_S = 1.0


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """nodeid -> seconds, or empty when the file is missing or unreadable (then the order is
    the collection order: slower to finish, never wrong)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its :data:`TOGETHER` name, else itself."""
    return TOGETHER.get(nodeid.split("::", 1)[0], nodeid)


def arrange(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker, put the longest units first (every worker sorts the same way, so
    their collections stay equal, which xdist checks)."""
    if not hasattr(config, "workerinput"):
        return
    seconds = load_durations()
    unit_s: dict[str, float] = {}
    for item in items:
        unit = unit_of(item.nodeid)
        unit_s[unit] = unit_s.get(unit, 0.0) + seconds.get(item.nodeid, 0.0)
    # sorted() is stable: a unit's tests keep their file order, quick tests theirs.
    items[:] = sorted(items, key=lambda item: -unit_s[unit_of(item.nodeid)])


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The scheduler for ``--dist loadgroup`` (None: xdist's own, for any other mode)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep arrange()'s order, not "most tests first"
    return Scheduler(config, log)


def durations_from_junit(junit: Path) -> dict[str, float]:
    """nodeid -> seconds (setup + call + teardown) of every test at least :data:`QUICK_S`."""
    out: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # classname is "tests.pkg.test_mod" or "tests.pkg.test_mod.TestClass"
        cut = next((i for i in range(len(parts), 0, -1) if parts[i - 1].startswith("test_")), 0)
        if not cut:
            continue
        nodeid = "::".join([_module_path("/".join(parts[:cut]) + ".py"), *parts[cut:], name])
        seconds = float(case.get("time", "0") or 0)
        if seconds >= QUICK_S:
            out[nodeid] = round(out.get(nodeid, 0.0) + seconds, 1)
    return out


def _module_path(path: str) -> str:
    """``path`` as it is now: a report from before tests moved into folders names
    ``tests/test_x.py`` for what is now ``tests/<pkg>/test_x.py``."""
    root = DURATIONS.parents[2]
    if (root / path).exists():
        return path
    moved = sorted(root.glob(f"tests/**/{Path(path).name}"))
    return moved[0].relative_to(root).as_posix() if len(moved) == 1 else path


def by_folder(junit: Path) -> dict[str, float]:
    """Seconds of test time per folder of ``tests/`` (every test, quick ones too)."""
    out: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        cut = next((i for i in range(len(parts), 0, -1) if parts[i - 1].startswith("test_")), 0)
        module = _module_path("/".join(parts[:cut]) + ".py") if cut else "?"
        folder = module.rsplit("/", 1)[0] if "/" in module else module
        out[folder] = out.get(folder, 0.0) + float(case.get("time", "0") or 0)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.schedule",
        description=f"write {DURATIONS.name} from a pytest --junitxml report",
    )
    parser.add_argument("junit", type=Path)
    parser.add_argument(
        "--by-folder", action="store_true", help="print test time per folder, write nothing"
    )
    args = parser.parse_args(argv)
    if args.by_folder:
        folders = by_folder(args.junit)
        for folder, seconds in sorted(folders.items(), key=lambda kv: -kv[1]):
            print(f"{folder:<28} {seconds / 60:6.1f} min")
        print(f"{'(sum of test times)':<28} {sum(folders.values()) / 60:6.1f} min")
        return 0
    durations = durations_from_junit(args.junit)
    DURATIONS.write_text(json.dumps(dict(sorted(durations.items())), indent=0) + "\n")
    print(f"{DURATIONS}: {len(durations)} tests of {QUICK_S:g} s or more", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
