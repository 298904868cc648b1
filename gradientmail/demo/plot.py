"""The loss curves of a ``gradientmail run`` as a PNG (:func:`plot_png`).

matplotlib draws them when it is installed (the dev install has it; the library does not
depend on it): labelled axes and a legend. Without it, :func:`draw_png` draws the same
curves with the standard library alone (``zlib`` and ``struct``): lines and dots on a light
grid, no text (the terminal and ``curves.json`` give the numbers), so the run folder has
its picture either way.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Series", "draw_png", "plot_png", "png_bytes"]

RGB = tuple[int, int, int]
# (points (x, y), colour, label)
Series = tuple[Sequence[tuple[float, float]], RGB, str]

X_LABEL = "seconds since the run started"
Y_LABEL = "validation loss, nats/byte"


def plot_png(path: Path, series: Sequence[Series], *, width: int = 640, height: int = 360) -> str:
    """Write ``series`` as a line plot of ``width`` × ``height`` pixels, both axes from zero
    (seconds, and a loss, which is never negative: a fall looks as large as it is). Returns
    what drew it: ``"matplotlib"``, or ``"built-in"`` when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        draw_png(path, [(points, color) for points, color, _ in series], width=width, height=height)
        return "built-in"
    # A Figure of its own, not pyplot: no global state, no GUI backend, safe off the main
    # thread.
    dpi = 100
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for points, color, label in series:
        axes.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            markersize=3,
            linewidth=2,
            color=tuple(c / 255 for c in color),
            label=label,
        )
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    axes.set_xlabel(X_LABEL)
    axes.set_ylabel(Y_LABEL)
    axes.grid(color="#e1e1e1")
    if any(label for _, _, label in series):
        axes.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=dpi)
    return "matplotlib"


# -- the fallback: the standard library alone ----------------------------------------------


def png_bytes(width: int, height: int, rows: Sequence[bytes]) -> bytes:
    """A PNG of 8-bit RGB ``rows`` (``height`` rows of ``3 * width`` bytes each)."""
    if width < 1 or height < 1 or len(rows) != height or any(len(r) != 3 * width for r in rows):
        raise ValueError(f"png_bytes: {height} rows of {3 * width} bytes expected")

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    raw = b"".join(b"\x00" + row for row in rows)  # filter type 0 (None) on every row
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def draw_png(
    path: Path,
    series: Sequence[tuple[Sequence[tuple[float, float]], RGB]],
    *,
    width: int = 640,
    height: int = 360,
) -> None:
    """A line plot of ``series`` (points ``(x, y)`` and a colour each) on shared axes from
    zero: white background, grey axes and a light grid of 4 × 4 cells, no text."""
    pixels = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    margin = 20
    x0, y0, x1, y1 = margin, margin, width - margin - 1, height - margin - 1

    def put(x: int, y: int, color: RGB) -> None:
        if 0 <= x < width and 0 <= y < height:
            pixels[y][3 * x : 3 * x + 3] = bytes(color)

    for i in range(5):  # grid, then axes
        gx = x0 + (x1 - x0) * i // 4
        gy = y0 + (y1 - y0) * i // 4
        for y in range(y0, y1 + 1):
            put(gx, y, (225, 225, 225))
        for x in range(x0, x1 + 1):
            put(x, gy, (225, 225, 225))
    for y in range(y0, y1 + 1):
        put(x0, y, (90, 90, 90))
    for x in range(x0, x1 + 1):
        put(x, y1, (90, 90, 90))
    every = [p for points, _ in series for p in points]
    if every:
        # Both axes from zero; a little room above the highest point.
        xs, ys = [p[0] for p in every], [p[1] for p in every]
        lx, hx = min(0.0, *xs), max(xs)
        ly, hy = min(0.0, *ys), max(ys) * 1.05
        hx, hy = (hx if hx > lx else lx + 1), (hy if hy > ly else ly + 1)

        def at(point: tuple[float, float]) -> tuple[int, int]:
            x = x0 + round((point[0] - lx) / (hx - lx) * (x1 - x0))
            y = y1 - round((point[1] - ly) / (hy - ly) * (y1 - y0))
            return x, y

        for points, color in series:
            spots = [at(p) for p in points]
            for (ax, ay), (bx, by) in itertools.pairwise(spots):
                for x, y in _segment(ax, ay, bx, by):
                    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):  # 2 px wide
                        put(x + dx, y + dy, color)
            for x, y in spots:  # a 3 × 3 dot at each measurement
                for dx in (-1, 0, 1):
                    for dy in (-1, 0, 1):
                        put(x + dx, y + dy, color)
    path.write_bytes(png_bytes(width, height, [bytes(row) for row in pixels]))


def _segment(ax: int, ay: int, bx: int, by: int) -> list[tuple[int, int]]:
    """The pixels of the line from ``(ax, ay)`` to ``(bx, by)`` (Bresenham)."""
    out = []
    dx, dy = abs(bx - ax), -abs(by - ay)
    sx, sy = (1 if ax < bx else -1), (1 if ay < by else -1)
    err = dx + dy
    x, y = ax, ay
    for _ in range(dx - dy + 1):  # at most that many pixels
        out.append((x, y))
        if x == bx and y == by:
            break
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x += sx
        if e2 <= dx:
            err += dx
            y += sy
    return out
