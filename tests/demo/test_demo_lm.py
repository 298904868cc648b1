"""The main job: ``gradientmail run`` with the built-in node's language model.

The pieces first (the PNG, drawn by matplotlib and by the fallback writer, the sparkline,
the node's settings, the parsing of a node's validation lines), then one short real run of
the LM task: two nodes, 20 steps of a tiny model (``GRADIENTMAIL_LM``), which must end
with the aligned model's loss recorded and below the initial model's, the PNG in the run
folder, and generated text printed. Structure only, never timing.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import pytest

from gradientmail.cli._nodes import Node
from gradientmail.demo.node import LmSettings, task_of
from gradientmail.demo.plot import draw_png, plot_png, png_bytes
from gradientmail.demo.report import (
    ALIGNED_COLOR,
    GLYPHS,
    NODE_COLOR,
    PROMPTS,
    binned,
    sparkline,
)
from gradientmail.launch.env import NodeEnv, NodeEnvError
from tests.cli.test_cli import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """``(type, body)`` of every chunk, each CRC checked; the signature first."""
    assert data[:8] == PNG_SIGNATURE
    chunks = []
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data)
    return chunks


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the RGB rows of a PNG as :func:`png_bytes` writes them."""
    chunks = png_chunks(data)
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    assert chunks[-1][1] == b""
    width, height, depth, color, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1]
    )
    assert (depth, color, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = [raw[i * stride : (i + 1) * stride] for i in range(height)]
    assert all(row[0] == 0 for row in rows)  # filter type None
    return width, height, [row[1:] for row in rows]


def test_png_bytes_is_a_valid_png_of_the_given_pixels() -> None:
    rows = [bytes([10, 20, 30, 40, 50, 60, 70, 80, 90]), bytes([255, 0, 0, 0, 255, 0, 0, 0, 255])]
    width, height, pixels = png_pixels(png_bytes(3, 2, rows))
    assert (width, height) == (3, 2)
    assert pixels == rows
    with pytest.raises(ValueError, match="2 rows of 9 bytes"):
        png_bytes(3, 2, rows[:1])


ALIGNED = [(0.0, 5.5), (10.0, 3.0), (20.0, 2.5), (30.0, 2.2)]
NODE = [(0.0, 5.5), (12.0, 3.4), (31.0, 2.4)]


def test_the_fallback_draws_each_curve_in_its_colour(tmp_path: Path) -> None:
    """Without matplotlib: the standard-library drawing."""
    path = tmp_path / "loss.png"
    draw_png(path, [(ALIGNED, ALIGNED_COLOR), (NODE, NODE_COLOR)], width=200, height=120)
    width, height, rows = png_pixels(path.read_bytes())
    assert (width, height) == (200, 120)
    colours = {bytes(row[3 * x : 3 * x + 3]) for row in rows for x in range(width)}
    assert {bytes(ALIGNED_COLOR), bytes(NODE_COLOR), b"\xff\xff\xff"} <= colours
    assert rows[0][:3] == b"\xff\xff\xff"  # the margin stays white
    # No points at all: axes only, still a valid image.
    draw_png(path, [([], ALIGNED_COLOR)], width=50, height=40)
    assert png_pixels(path.read_bytes())[:2] == (50, 40)


def _near(pixel: tuple[int, ...], color: tuple[int, int, int]) -> bool:
    return all(abs(a - b) <= 8 for a, b in zip(pixel[:3], color, strict=True))


def test_plot_png_draws_each_curve_in_its_colour(tmp_path: Path) -> None:
    """With matplotlib installed (the dev install has it): its drawing, of the size asked,
    each curve in its colour."""
    pytest.importorskip("matplotlib")
    image = pytest.importorskip("PIL.Image")
    path = tmp_path / "loss.png"
    series = [(ALIGNED, ALIGNED_COLOR, "aligned model"), (NODE, NODE_COLOR, "node 0")]
    assert plot_png(path, series, width=320, height=200) == "matplotlib"
    with image.open(path) as png:
        assert png.size == (320, 200)
        data = png.convert("RGB").tobytes()
    pixels = [tuple(data[i : i + 3]) for i in range(0, len(data), 3)]
    for color in (ALIGNED_COLOR, NODE_COLOR):
        assert sum(_near(p, color) for p in pixels) > 50, color
    assert pixels[0] == (255, 255, 255)
    # No points at all: axes only, still an image.
    assert plot_png(path, [([], ALIGNED_COLOR, "")], width=100, height=80) == "matplotlib"
    with image.open(path) as png:
        assert png.size == (100, 80)


def test_plot_png_falls_back_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    path = tmp_path / "loss.png"
    series = [(ALIGNED, ALIGNED_COLOR, "aligned model"), (NODE, NODE_COLOR, "node 0")]
    assert plot_png(path, series, width=120, height=90) == "built-in"
    width, height, rows = png_pixels(path.read_bytes())
    assert (width, height) == (120, 90)
    colours = {bytes(row[3 * x : 3 * x + 3]) for row in rows for x in range(width)}
    assert {bytes(ALIGNED_COLOR), bytes(NODE_COLOR)} <= colours


def test_sparkline_maps_values_to_glyphs() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == GLYPHS
    assert sparkline([7, 0]) == "█▁"
    # A shared scale: values outside it are clipped; None is a gap; flat is the middle.
    assert sparkline([5.0, 3.0, None, 1.0], lo=2.0, hi=4.0) == "█▅ ▁"
    assert sparkline([2.0, 2.0]) == "▄▄"
    assert sparkline([]) == ""
    assert sparkline([None, None]) == "  "


def test_binned_lines_curves_up_in_time() -> None:
    points = [(0.0, 4.0), (1.0, 2.0), (9.0, 1.0)]
    assert binned(points, 5, 10.0) == [3.0, 3.0, 3.0, 3.0, 1.0]  # empty columns carry on
    assert binned([(6.0, 2.0)], 4, 8.0) == [None, None, None, 2.0]  # nothing before 6 s
    assert binned([(0.0, 1.0)], 3, 0.0) == [None, None, 1.0]


def test_lm_settings_come_from_the_environment() -> None:
    assert LmSettings.from_environ({}) == LmSettings()
    s = LmSettings.from_environ({"GRADIENTMAIL_LM": " d_model=32, heads=2,lr=0.01 "})
    assert (s.d_model, s.heads, s.lr, s.layers) == (32, 2, 0.01, LmSettings().layers)
    for text, message in [
        ("width=3", "'width=3' is not key=value with a key among d_model"),
        ("d_model", "'d_model' is not key=value"),
        ("batch=many", "batch='many' is not a int"),
        ("batch=0", "batch must be positive"),
        ("d_model=30,heads=4", "d_model 30 is not a multiple of heads 4"),
    ]:
        with pytest.raises(NodeEnvError, match=message):
            LmSettings.from_environ({"GRADIENTMAIL_LM": text})
    assert task_of({}) == "lm"
    assert task_of({"GRADIENTMAIL_TASK": "synthetic"}) == "synthetic"
    with pytest.raises(NodeEnvError, match="GRADIENTMAIL_TASK='mnist'"):
        task_of({"GRADIENTMAIL_TASK": "mnist"})


def test_a_node_line_with_val_adds_a_point_to_its_curve(tmp_path: Path) -> None:
    node = Node(0, NodeEnv(mailbox="file:///x", learner_id="n0", steps=40), tmp_path / "n0.log")
    node.see("n0: joined, training 40 steps")
    node.see("n0: step 0 val 5.4486")
    node.see("n0: step 20 loss 3.9177 val 2.9275 rounds [4, 3]")
    node.see("n0: step 40 loss 2.5 rounds [6, 7]")  # no val: no point
    assert [v for _, v in node.val_curve] == [5.4486, 2.9275]
    assert (node.step, node.first_loss, node.last_loss) == (40, 3.9177, 2.5)


def test_a_bad_lm_setting_is_refused_before_any_node_starts(tmp_path: Path) -> None:
    done = cli("run", "--workdir", tmp_path / "w", GRADIENTMAIL_LM="depth=3")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "GRADIENTMAIL_LM: 'depth=3' is not key=value" in done.stderr
    assert not (tmp_path / "w").exists()


TINY = "d_model=16,layers=1,heads=2,context=32,batch=4,eval_windows=8,reports=4,max_bytes=300000"


def test_a_short_lm_run_reports_the_aligned_model(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    cache = tmp_path / "cache"
    done = cli(
        "run",
        *("--nodes", "2", "--steps", "20", "--sync-every", "5", "--fragments", "2"),
        *("--round-timeout", "5", "--workdir", workdir, "--no-live"),
        timeout=300,
        GRADIENTMAIL_TASK="",  # the default task: the language model
        GRADIENTMAIL_LM=TINY,
        XDG_CACHE_HOME=str(cache),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for node in ("local-node-0", "local-node-1"):
        assert f"{node}: step 20 loss" in out
    assert "aligned model: validation loss" in out  # the table's line
    # The curves: the aligned model's, evaluated by the CLI (the last one after every
    # node finished), and node 0's own, from its `val` lines (step 0 and each report).
    record = json.loads((workdir / "curves.json").read_text())
    curves = {c["label"]: c["points"] for c in record["curves"]}
    aligned, own = curves["aligned model"], curves["local-node-0's model"]
    assert aligned
    assert all(math.isfinite(v) for _, v in aligned)
    assert len(own) == 1 + 4  # step 0, then reports=4 lines
    assert aligned[-1][1] < own[0][1]  # trained: below the initial model, on the same windows
    assert [t for t, _ in aligned] == sorted(t for t, _ in aligned)
    assert set(record["rounds"]) == {"0", "1"}  # the newest commit of both fragments
    header = png_chunks((workdir / "loss.png").read_bytes())[0]
    assert header[0] == b"IHDR"
    assert struct.unpack(">II", header[1][:8]) == (640, 360)  # whoever drew it
    assert f"curves: {workdir / 'loss.png'}" in out
    assert "the aligned model continues each prompt" in out
    for prompt in PROMPTS:
        assert prompt.decode().strip() in out
    assert list(cache.glob("gradientmail/lm-corpus-*.safetensors"))  # built once, kept
