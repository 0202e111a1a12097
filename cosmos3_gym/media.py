"""Writing frames people look at: mp4 (imageio-ffmpeg), gif and png."""

from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """[..., 3] floats in [0, 1] (or uint8) -> uint8."""
    if frames.dtype == np.uint8:
        return frames
    return (np.clip(frames, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def write_video(path: str | Path, frames: np.ndarray, fps: float) -> Path:
    """frames [T, H, W, 3] -> mp4 (or gif, by suffix). Odd sizes are padded to even for H.264."""
    path = Path(path)
    frames = to_uint8(np.asarray(frames))
    if path.suffix.lower() == ".gif":
        iio.imwrite(path, frames, duration=1000.0 / fps, loop=0)
        return path
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    iio.imwrite(path, frames, extension=".mp4", fps=fps, codec="libx264", macro_block_size=1)
    return path
