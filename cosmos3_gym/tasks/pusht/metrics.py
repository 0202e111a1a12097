"""Frame metrics for comparing the world model with the simulator."""

from __future__ import annotations

import math

import numpy as np

from ...errors import InputError

__all__ = ["psnr"]


def psnr(reference: np.ndarray, estimate: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images or videos of one shape (inf when equal)."""
    if reference.shape != estimate.shape:
        raise InputError(f"psnr: the frames differ in shape, {reference.shape} vs {estimate.shape}.")
    error = np.mean((reference.astype(np.float64) - estimate.astype(np.float64)) ** 2) / 255.0**2
    return math.inf if error == 0 else float(10.0 * math.log10(1.0 / error))
