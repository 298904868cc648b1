"""Packaging: what a user installing into their own environment meets.

- training needs torch alone (no numpy), and the core imports without torch, with one clear
  error naming the ``[torch]`` extra for the training names (each in a fresh interpreter
  where the missing packages cannot be imported);
- importing the library leaves the process's warning filters alone, and decoding a payload
  warns about nothing;
- ``gm.NodeEnv`` (and the old path ``gm.node``) after ``import gradientmail``; the
  README's training snippet ("Your training code", its plain loop) runs as printed (only
  the mailbox URL swapped for a directory; the start barrier with one node);
- pyproject: SPDX license strings, a small core with extras, ranges only (the tested
  versions in ``constraints.txt``, which the install script and CI use), a scheduled job
  without constraints; the README links nothing outside the repository and never tells
  users to install the PyPI name.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# Run first in every child: the named top-level packages cannot be imported, as if they were
# not installed (`import` raises ModuleNotFoundError naming them, importlib.util.find_spec
# answers None, as torch's optional imports expect).
_BLOCK = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
"""


def _child(code: str, blocked: tuple[str, ...] = (), timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter (cwd: the repository) with ``blocked`` packages
    missing; return its stdout, failing the test with its stderr when it fails."""
    source = _BLOCK.format(blocked=sorted(blocked)) + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", source],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


# -- dependencies at run time ------------------------------------------------------------


def test_training_needs_torch_alone_not_numpy() -> None:
    """A user's environment with torch and nothing else of the extras (no numpy, no
    safetensors, no CLI packages): payloads encode and decode (whole and in parts) and a
    Session trains, joins, commits and closes."""
    out = _child(
        """
        import asyncio, warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch says once that numpy is missing
            import torch
        import gradientmail as gm
        from gradientmail.payload import decode, encode, get_tensors, put_tensors
        from gradientmail.payload.transfer import encode_payload

        tensors = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16),
                   "e": torch.zeros(0)}
        key, data = encode(tensors)
        back = decode(key, data)
        assert all(torch.equal(back[n], tensors[n]) for n in tensors)
        assert len(encode_payload(tensors, part_bytes=16).objects) > 2  # parts and index
        box = gm.MemoryMailbox()
        key, _ = asyncio.run(put_tensors(box, {"w": torch.randn(4096)}))
        assert asyncio.run(get_tensors(box, key))["w"].shape == (4096,)

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with gm.Session(model, algorithm=gm.DiLoCo(sync_every=2, fragments=2), mailbox=box,
                        learner_id="solo") as session:
            for _ in range(6):
                x = torch.randn(5, 4)
                optimizer.zero_grad()
                model(x).pow(2).mean().backward()
                optimizer.step()
                session.step(samples=x.shape[0])
        rounds = asyncio.run(box.list("rounds/"))
        assert len(rounds) > 2, rounds  # the initial commits and trained ones
        print("trained without numpy:", len(rounds), "rounds")
        """,
        blocked=("numpy", "safetensors", "rich", "yaml", "pydantic"),
    )
    assert "trained without numpy" in out


def test_the_core_imports_without_torch_and_names_the_extra() -> None:
    out = _child(
        """
        import asyncio
        import gradientmail as gm
        import gradientmail.inspect, gradientmail.node, gradientmail.demo.node
        from gradientmail.patterns.barrier import Barrier

        box = gm.open_mailbox("memory://core-only")
        asyncio.run(box.put_if_absent("a", b"1"))
        assert Barrier(mailbox=box, learner_id="n0").wait("start", parties=1) == ["n0"]
        try:
            gm.Session
        except ImportError as exc:
            print(exc)
        else:
            raise AssertionError("gm.Session without torch")
        """,
        blocked=("torch", "numpy", "safetensors", "rich", "yaml", "pydantic"),
    )
    message = out.strip()
    assert len(message.splitlines()) == 1, message
    assert "gradientmail.Session needs torch" in message
    assert "[torch]" in message
    assert "pip install 'gradientmail[" not in message  # the PyPI name is another project's


def test_importing_gradientmail_leaves_the_warning_filters_alone() -> None:
    """No import changes the process-wide filters, and decoding (views over read-only
    bytes) warns about nothing and leaves them as they were."""
    out = _child(
        """
        import warnings
        import boto3, torch  # their own imports add filters (urllib3's): before ours
        before = list(warnings.filters)
        import gradientmail as gm
        import gradientmail.cli, gradientmail.node, gradientmail.payload, gradientmail.session
        import gradientmail.demo.node, gradientmail.demo.report
        import gradientmail.payload.stream, gradientmail.engine.closer
        gm.Session, gm.DiLoCo, gm.align, gm.verify
        assert warnings.filters == before, [f for f in warnings.filters if f not in before]

        from gradientmail.payload import decode, encode
        key, data = encode({"w": torch.randn(64), "i": torch.arange(5)})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            decoded = decode(key, data)
        assert not caught, [str(w.message) for w in caught]
        assert warnings.filters == before
        print("filters unchanged:", len(before))
        """
    )
    assert "filters unchanged" in out


def test_gm_node_env_and_the_old_node_path_are_there_after_import_gradientmail() -> None:
    out = _child(
        """
        import gradientmail as gm
        import gradientmail.demo.node
        from gradientmail.launch.env import NodeEnv
        assert gm.NodeEnv is NodeEnv and gm.node.NodeEnv is NodeEnv
        assert gm.node.main is gradientmail.demo.node.main
        print(gm.NodeEnv.__name__, gm.node.main.__name__)
        """
    )
    assert out.split() == ["NodeEnv", "main"]


# -- the README as printed -------------------------------------------------------------------


def _training_snippet() -> str:
    section = README.split("\n## Your training code\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block in the README's training section"
    return match.group(1)


_PRELUDE = """
import torch

torch.manual_seed(0)
rank, nodes = 0, 1
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
dataloader = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(40)]

def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()

def evaluate(model):
    pass
"""


def test_the_readme_training_snippet_runs_as_printed(tmp_path: Path) -> None:
    snippet = _training_snippet()
    assert "samples=x.shape[0]" in snippet  # examples, not the items of a batch tuple
    url = re.search(r'gm\.open_mailbox\("([^"]+)"\)', snippet)
    assert url, snippet
    mailbox = (tmp_path / "mailbox").as_uri()
    code = _PRELUDE + snippet.replace(url.group(1), mailbox)
    code += textwrap.dedent(
        f"""
        import asyncio
        rounds = asyncio.run(gm.open_mailbox({mailbox!r}).list("rounds/"))
        print("rounds", len(rounds))
        """
    )
    out = _child(code, timeout=180)
    # The initial commit of each fragment, and close()'s contribution of the last steps.
    assert int(out.split("rounds")[-1]) >= 4, out


def test_the_readme_links_nothing_outside_the_repository() -> None:
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        text = path.read_text()
        assert "../shared" not in text, path
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), (path, target)
            assert resolved.exists(), (path, target)
    assert "(docs/design.md)" in README


def test_no_doc_or_message_installs_the_pypi_name() -> None:
    """`gradientmail` on PyPI is another project: install from a checkout or a wheel."""
    bare = re.compile(r"pip install\s+(-\S+\s+)*['\"]?gradientmail(\[|\b(?![-/.]))")
    places = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "gradientmail/__init__.py"]
    for path in places:
        for line in path.read_text().splitlines():
            if "never" not in line:
                assert not bare.search(line), f"{path.name}: {line.strip()}"
    assert "not published on PyPI" in README


# -- pyproject, constraints, install script, CI ----------------------------------------------


def _pyproject(path: str) -> dict[str, Any]:
    with open(ROOT / path, "rb") as f:
        return tomllib.load(f)


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_name(name)] = version
    return pins


@pytest.mark.parametrize("path", ["pyproject.toml", "operator/pyproject.toml"])
def test_the_license_is_an_spdx_string(path: str) -> None:
    data = _pyproject(path)
    assert data["project"]["license"] == "Apache-2.0"
    assert not [c for c in data["project"].get("classifiers", []) if c.startswith("License")]
    (setuptools,) = data["build-system"]["requires"]
    assert setuptools == "setuptools>=77.0.3"  # PEP 639 license strings


def test_the_core_is_small_and_the_extras_split() -> None:
    project = _pyproject("pyproject.toml")["project"]
    extras = project["optional-dependencies"]
    assert {_name(r) for r in project["dependencies"]} == {"boto3"}
    assert {_name(r) for r in extras["torch"]} >= {"torch"}
    assert {_name(r) for r in extras["cli"]} >= {"rich", "pyyaml"}
    operator = _pyproject("operator/pyproject.toml")["project"]["dependencies"]
    assert sorted(extras["operator"]) == sorted(r for r in operator if r != "gradientmail")


def test_requirements_are_ranges_and_the_tested_versions_are_pinned() -> None:
    project = _pyproject("pyproject.toml")["project"]
    requirements = [
        *project["dependencies"],
        *_pyproject("operator/pyproject.toml")["project"]["dependencies"],
    ]
    for extra in project["optional-dependencies"].values():
        requirements += extra
    assert not [r for r in requirements if "==" in r]
    pins = _pins()
    assert pins["kubernetes"] == "37.0.1"  # 37.0.2 needs a dateutil that botocore forbids
    assert pins["torch"] == "2.13.0"
    missing = {_name(r) for r in requirements} - set(pins) - {"gradientmail"}
    assert not missing, f"no tested version in constraints.txt for {sorted(missing)}"


def test_the_install_script_and_ci_use_the_constraints_and_a_job_tries_the_newest() -> None:
    install = (ROOT / "scripts/install.sh").read_text()
    assert "constraints=(-c constraints.txt)" in install
    assert '"${constraints[@]}"' in install
    assert "constraints.txt" in install.split("want=", 1)[1].split("\n", 2)[0]  # reinstall
    assert "scripts/install.sh" in (ROOT / "scripts/test.sh").read_text()
    ci = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    steps = ci["jobs"]["test"]["steps"]
    assert any(s.get("run") == ".ci/run" for s in steps)
    assert "constraints.txt" in str(steps)
    newest = yaml.safe_load((ROOT / ".github/workflows/newest.yml").read_text())
    assert newest[True]["schedule"]  # yaml reads the key `on` as True
    job = newest["jobs"]["test"]
    assert job["env"]["GRADIENTMAIL_CONSTRAINTS"] == "none"
    assert any(s.get("run", "").startswith(".ci/run") for s in job["steps"])


def test_building_the_wheel_prints_no_license_deprecation(tmp_path: Path) -> None:
    """The SPDX string silences setuptools' license warnings (about 60 lines per build
    before): build the wheel from a copy, with this environment's setuptools."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (source / name).write_text((ROOT / name).read_text())
    subprocess.run(
        ["cp", "-r", str(ROOT / "gradientmail"), str(source / "gradientmail")], check=True
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert list((tmp_path / "dist").glob("gradientmail-*.whl"))
    noisy = [
        ln
        for ln in output.splitlines()
        if re.search(r"(?i)license.*deprecat|deprecat.*license", ln)
    ]
    assert not noisy, noisy[:5]


def test_the_command_without_the_cli_extra_names_it_in_one_line() -> None:
    code = (
        "import sys\n"
        "sys.modules['rich'] = None  # not installed\n"
        "from gradientmail._command import main\n"
        "sys.exit(main(['status', 'file:///nowhere']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "[cli]" in done.stderr
    assert "Traceback" not in done.stderr
