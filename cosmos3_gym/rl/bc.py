"""Behaviour cloning: fit ``PixelGaussianPolicy``'s mean to demonstrated action chunks (mean squared error).

Frames get a random shift of up to ``shift`` pixels (replicate padding then a random crop, per sample: DrQ's and
Diffusion Policy's augmentation for pixel policies) so the policy does not key on exact pixel positions. The
Gaussian's ``log_std`` is not trained here: RL starts from ``PolicyConfig.initial_log_std``.

The whole data set lives on the policy's device (uint8 frames, a few GB for 1000 episodes) and batches are drawn,
shifted and normalised there: with the frames on the CPU, gathering and copying a batch took most of a step. The loss
is L1 by default (ACT's): with two ways round the T in the demonstrations, the median of the modes moves less into
the T than their mean. ``max_seconds`` bounds the wall clock: the step count is cut to what fits after timing the
steps after the first ``WARMUP_STEPS``, and the cosine schedule is laid over the steps that will run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from .policy import PixelGaussianPolicy

__all__ = ["BCConfig", "random_shift", "train_bc"]

WARMUP_STEPS, TIMING_STEPS = 10, 50
LOSSES = ("l1", "mse")


@dataclass
class BCConfig:
    steps: int = 3000
    batch_size: int = 256
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    shift: int = 4  # px of random shift augmentation (0: none)
    loss: str = "l1"  # "l1" or "mse"
    max_seconds: float | None = None  # wall-clock budget: fewer steps if ``steps`` would not fit
    seed: int = 0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise InputError(f"loss: expected one of {LOSSES}, got {self.loss!r}.")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise InputError(f"steps: expected an integer >= 1, got {self.steps!r}.")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise InputError(f"max_seconds: expected a positive number of seconds or None, got {self.max_seconds!r}.")


def random_shift(pixels: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """Shift each image ``[B, C, H, W]`` by up to ``shift`` px in x and y (edges replicated)."""
    if shift <= 0:
        return pixels
    batch, _, height, width = pixels.shape
    padded = F.pad(pixels, (shift, shift, shift, shift), mode="replicate")
    offsets = torch.randint(0, 2 * shift + 1, (batch, 2), generator=generator, device=generator.device)
    offsets = offsets.to(pixels.device)
    rows = offsets[:, 1:] + torch.arange(height, device=pixels.device)  # [B, H]
    cols = offsets[:, :1] + torch.arange(width, device=pixels.device)  # [B, W]
    batch_index = torch.arange(batch, device=pixels.device)[:, None, None]
    # Advanced indexing around the channel slice puts the indexed dimensions first: [B, H, W, C].
    return padded[batch_index, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


def train_bc(
    policy: PixelGaussianPolicy,
    observations: np.ndarray,
    action_chunks: np.ndarray,
    config: BCConfig | None = None,
    progress: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Train ``policy`` (in place, on its device) on ``observations`` uint8 ``[M, s, s, 3]`` and ``action_chunks``
    ``[M, chunk, D]`` in [-1, 1]. Returns the loss of every step. ``on_step(n)`` runs after the n-th optimizer step
    (snapshots of the run)."""
    from tqdm.auto import tqdm

    config = config or BCConfig()
    observations = np.asarray(observations)
    action_chunks = np.asarray(action_chunks, np.float32)
    if len(observations) != len(action_chunks) or not len(observations):
        raise InputError(
            f"observations/action_chunks: expected the same non-zero count, got {len(observations)} and "
            f"{len(action_chunks)}."
        )
    if tuple(action_chunks.shape[1:]) != policy.action_shape:
        raise InputError(
            f"action_chunks: expected [M, {policy.action_shape[0]}, {policy.action_shape[1]}], got "
            f"{list(action_chunks.shape)}."
        )
    torch.manual_seed(config.seed)
    device = policy.device
    generator = torch.Generator(device=device).manual_seed(config.seed)
    frames = torch.from_numpy(np.ascontiguousarray(observations)).to(device)
    targets = torch.from_numpy(action_chunks.reshape(len(action_chunks), -1)).to(device)
    criterion = F.l1_loss if config.loss == "l1" else F.mse_loss
    optimizer = torch.optim.AdamW(
        [p for name, p in policy.named_parameters() if name != "log_std"],
        lr=config.learning_rate,
        weight_decay=config.weight_decay,
    )
    total = [config.steps]  # cut once the step time is known (max_seconds); the schedule reads it every step
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1.0 + np.cos(np.pi * min(step, total[0]) / total[0]))
    )
    batch_size = min(config.batch_size, len(frames))
    policy.train()
    losses = []
    started = time.perf_counter()
    with tqdm(total=config.steps, desc="behaviour cloning", disable=not progress) as bar:
        step = 0
        while step < total[0]:
            index = torch.randint(0, len(frames), (batch_size,), generator=generator, device=device)
            pixels = random_shift(policy.preprocess(frames[index]), config.shift, generator)
            loss = criterion(policy(pixels), targets[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.detach())
            step += 1
            bar.update()
            if on_step is not None:
                on_step(step)
            if config.max_seconds is not None and step in (WARMUP_STEPS, WARMUP_STEPS + TIMING_STEPS):
                _synchronize(device)
                if step == WARMUP_STEPS:  # the first steps pay for CUDA's and cuDNN's start-up: not timed
                    warm = time.perf_counter()
                else:
                    per_step = (time.perf_counter() - warm) / TIMING_STEPS
                    left = config.max_seconds - (time.perf_counter() - started)
                    total[0] = max(step, min(config.steps, step + int(left / per_step)))
                    bar.total = total[0]
    policy.eval()
    return torch.stack(losses).float().cpu().tolist()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
