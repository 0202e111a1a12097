"""Line charts as PNG with Pillow alone (matplotlib is not a dependency of the project)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["line_chart"]

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def line_chart(path: str | os.PathLike, panels: Sequence[dict], *, title: str = "", panel_size=(420, 300)) -> Path:
    """Panels side by side; each ``{"title", "xlabel", "ylabel", "series": [{"label", "x", "y", "dashed"?}]}``.
    NaN points are skipped. Returns ``path``."""
    from PIL import Image, ImageDraw

    width, height = panel_size
    margin_left, margin_bottom, margin_top, margin_right = 48, 34, 24, 10
    image = Image.new("RGB", (width * len(panels), height + (18 if title else 0)), "white")
    draw = ImageDraw.Draw(image)
    top = 18 if title else 0
    if title:
        draw.text((6, 3), title, fill=(0, 0, 0))
    for p, panel in enumerate(panels):
        left = p * width
        box = (left + margin_left, top + margin_top, left + width - margin_right, top + height - margin_bottom)
        xs = [v for s in panel["series"] for v in s["x"] if math.isfinite(v)]
        ys = [v for s in panel["series"] for v in s["y"] if math.isfinite(v)]
        x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        y0, y1 = (min(ys + [0.0]), max(ys + [1.0])) if ys else (0.0, 1.0)
        x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

        def to_pixel(x, y, box=box, x0=x0, x1=x1, y0=y0, y1=y1):  # bound now: defined per panel
            return (
                box[0] + (x - x0) / (x1 - x0) * (box[2] - box[0]),
                box[3] - (y - y0) / (y1 - y0) * (box[3] - box[1]),
            )

        draw.rectangle(box, outline=(0, 0, 0))
        for fraction in np.linspace(0, 1, 5):
            y = y0 + fraction * (y1 - y0)
            _, py = to_pixel(x0, y)
            draw.line([(box[0] - 3, py), (box[0], py)], fill=(0, 0, 0))
            draw.text((left + 4, py - 6), f"{y:.2f}", fill=(0, 0, 0))
            x = x0 + fraction * (x1 - x0)
            px, _ = to_pixel(x, y0)
            draw.line([(px, box[3]), (px, box[3] + 3)], fill=(0, 0, 0))
            draw.text((px - 12, box[3] + 5), f"{x:.4g}", fill=(0, 0, 0))
        draw.text((left + margin_left, top + 4), panel.get("title", ""), fill=(0, 0, 0))
        draw.text(
            (left + margin_left, top + height - 14),
            f"x: {panel.get('xlabel', '')}   y: {panel.get('ylabel', '')}",
            fill=(90, 90, 90),
        )
        for s, series in enumerate(panel["series"]):
            colour = COLOURS[s % len(COLOURS)]
            points = [to_pixel(x, y) for x, y in zip(series["x"], series["y"]) if math.isfinite(x) and math.isfinite(y)]
            if len(points) > 1:
                if series.get("dashed"):
                    for a, b in zip(points[::2], points[1::2]):
                        draw.line([a, b], fill=colour, width=2)
                else:
                    draw.line(points, fill=colour, width=2)
            for px, py in points:
                draw.ellipse([px - 2, py - 2, px + 2, py + 2], fill=colour)
            draw.text((box[0] + 6, box[1] + 4 + 12 * s), series["label"], fill=colour)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
