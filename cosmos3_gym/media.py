"""Writing frames people look at: mp4 (imageio-ffmpeg), gif and png."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import imageio.v3 as iio
import numpy as np


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """[..., 3] floats in [0, 1] (or uint8) -> uint8."""
    if frames.dtype == np.uint8:
        return frames
    return (np.clip(frames, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float) -> Path:
    """frames [T, H, W, 3] (uint8, or floats in [0, 1]) -> mp4 with H.264 (or gif, by suffix); returns the path
    written. Odd sizes are padded to even for H.264. imageio-ffmpeg is a core dependency, but bare machines (the GPU
    hosts) may lack it: an mp4 is then written with OpenCV's MPEG-4 encoder, else as a GIF at ``path`` with the
    suffix ``.gif``, so callers should use the returned path."""
    path = Path(path)
    frames = to_uint8(np.asarray(frames))
    if path.suffix.lower() == ".gif":
        iio.imwrite(path, frames, duration=1000.0 / fps, loop=0)
        return path
    if importlib.util.find_spec("imageio_ffmpeg") is None:
        return _write_without_ffmpeg(path, frames, fps)
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    iio.imwrite(path, frames, extension=".mp4", fps=fps, codec="libx264", macro_block_size=1)
    return path


def _write_without_ffmpeg(path: Path, frames: np.ndarray, fps: float) -> Path:
    try:
        import cv2
    except ImportError:
        has_video_writer = False
    else:
        has_video_writer = hasattr(cv2, "VideoWriter")
    if not has_video_writer:  # no OpenCV, or a stand-in without a video writer (bare GPU hosts)
        return write_video(path.with_suffix(".gif"), frames, fps)
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"mp4v"), float(fps), (width, height))
    if not writer.isOpened():
        return write_video(path.with_suffix(".gif"), frames, fps)
    for frame in frames:
        writer.write(np.ascontiguousarray(frame[..., ::-1]))  # OpenCV wants BGR
    writer.release()
    return path
