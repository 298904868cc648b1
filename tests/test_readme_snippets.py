"""The README's "Your training code" shows the snippet files verbatim.

Each of its ```python blocks that follows a marker line ``<!-- snippet: PATH -->`` must equal
the file ``PATH`` byte for byte, so the snippet the other tests run (the files under
``examples/snippets/``) is the one the README shows. A marker whose file does not exist yet
keeps its placeholder block; every snippet file that exists must have a marker. The plain
loop (the section's first block) is run as printed by ``tests/test_packaging.py``.

After editing a snippet file, ``python -m tests.test_readme_snippets --write`` copies each
existing file into its README block.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTION = "\n## Your training code\n"
SUBSECTIONS = (
    "### A plain loop",
    "### A DDP or FSDP node",
    "### The Hugging Face Trainer",
    "### Lightning",
)
EXPECTED = (
    "examples/snippets/ddp_node.py",
    "examples/snippets/hf_trainer.py",
    "examples/snippets/lightning.py",
)
_BLOCK = re.compile(r"<!-- snippet: (?P<path>\S+) -->\n```python\n(?P<body>.*?)```\n", re.S)


def shown(readme: str) -> dict[str, str]:
    """``{path: the block's text}`` for every marked block (a path marked twice: an error)."""
    blocks: dict[str, str] = {}
    for match in _BLOCK.finditer(readme):
        path = match.group("path")
        assert path not in blocks, f"the README marks {path} twice"
        blocks[path] = match.group("body")
    return blocks


def mismatches(readme: str, root: Path) -> list[str]:
    """What differs between the README's marked blocks and the snippet files under ``root``:
    a file without a block, a block that is not its file byte for byte."""
    blocks = shown(readme)
    found = []
    for file in sorted((root / "examples" / "snippets").glob("*.py")):
        path = file.relative_to(root).as_posix()
        if path not in blocks:
            found.append(f"{path}: the README shows no block for it")
        elif blocks[path].encode() != file.read_bytes():
            found.append(f"{path}: the README's block differs from the file")
    return found


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_each_snippet_file_is_shown_verbatim() -> None:
    found = mismatches(_readme(), ROOT)
    assert not found, "; ".join(found) + " (python -m tests.test_readme_snippets --write)"


def test_the_section_has_the_four_ways_and_a_block_for_each_snippet() -> None:
    readme = _readme()
    assert SECTION in readme
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    places = [section.find(f"\n{heading}\n") for heading in SUBSECTIONS]
    assert -1 not in places, places
    assert places == sorted(places), places
    assert section.split(SUBSECTIONS[1])[0].count("```python\n") == 1  # the plain loop
    assert sorted(shown(section)) == sorted(EXPECTED)


@pytest.mark.parametrize("change", ["edit the file", "remove the block", "a file without one"])
def test_a_block_that_is_not_its_file_is_caught(tmp_path: Path, change: str) -> None:
    folder = tmp_path / "examples" / "snippets"
    folder.mkdir(parents=True)
    (folder / "a.py").write_text("import torch\n\nprint(1)\n")
    readme = (
        "x\n<!-- snippet: examples/snippets/a.py -->\n```python\nimport torch\n\nprint(1)\n```\n"
    )
    assert mismatches(readme, tmp_path) == []
    if change == "edit the file":
        (folder / "a.py").write_text("import torch\n\nprint(2)\n")
    elif change == "remove the block":
        readme = "x\n"
    else:
        (folder / "b.py").write_text("pass\n")
    assert len(mismatches(readme, tmp_path)) == 1


def write() -> list[str]:
    """Copy each existing snippet file into its README block; return the paths updated."""
    readme = _readme()
    updated: list[str] = []

    def body(match: re.Match[str]) -> str:
        file = ROOT / match.group("path")
        if not file.is_file() or file.read_text(encoding="utf-8") == match.group("body"):
            return match.group(0)
        updated.append(match.group("path"))
        text = file.read_text(encoding="utf-8")
        return f"<!-- snippet: {match.group('path')} -->\n```python\n{text}```\n"

    new = _BLOCK.sub(body, readme)
    (ROOT / "README.md").write_text(new, encoding="utf-8")
    return updated


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_readme_snippets --write")
    print("updated:", ", ".join(write()) or "nothing")
