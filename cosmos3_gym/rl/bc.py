"""Behaviour cloning: fit ``PixelGaussianPolicy``'s mean to demonstrated action chunks (mean squared error).

Frames get a random shift of up to ``shift`` pixels (replicate padding then a random crop, per sample: DrQ's and
Diffusion Policy's augmentation for pixel policies) so the policy does not key on exact pixel positions. The
Gaussian's ``log_std`` is not trained here: RL starts from ``PolicyConfig.initial_log_std``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from .policy import PixelGaussianPolicy

__all__ = ["BCConfig", "random_shift", "train_bc"]


@dataclass
class BCConfig:
    steps: int = 3000
    batch_size: int = 256
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    shift: int = 4  # px of random shift augmentation (0: none)
    seed: int = 0


def random_shift(pixels: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """Shift each image ``[B, C, H, W]`` by up to ``shift`` px in x and y (edges replicated)."""
    if shift <= 0:
        return pixels
    batch, _, height, width = pixels.shape
    padded = F.pad(pixels, (shift, shift, shift, shift), mode="replicate")
    offsets = torch.randint(0, 2 * shift + 1, (batch, 2), generator=generator).to(pixels.device)
    rows = offsets[:, 1:] + torch.arange(height, device=pixels.device)  # [B, H]
    cols = offsets[:, :1] + torch.arange(width, device=pixels.device)  # [B, W]
    batch_index = torch.arange(batch, device=pixels.device)[:, None, None]
    # Advanced indexing around the channel slice puts the indexed dimensions first: [B, H, W, C].
    return padded[batch_index, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


def train_bc(policy: PixelGaussianPolicy, observations: np.ndarray, action_chunks: np.ndarray,
             config: BCConfig | None = None, progress: bool = True) -> list[float]:
    """Train ``policy`` (in place, on its device) on ``observations`` uint8 ``[M, s, s, 3]`` and ``action_chunks``
    ``[M, chunk, D]`` in [-1, 1]. Returns the loss of every step."""
    from tqdm.auto import tqdm

    config = config or BCConfig()
    observations = np.asarray(observations)
    action_chunks = np.asarray(action_chunks, np.float32)
    if len(observations) != len(action_chunks) or not len(observations):
        raise InputError(f"observations/action_chunks: expected the same non-zero count, got {len(observations)} and "
                         f"{len(action_chunks)}.")
    if tuple(action_chunks.shape[1:]) != policy.action_shape:
        raise InputError(f"action_chunks: expected [M, {policy.action_shape[0]}, {policy.action_shape[1]}], got "
                         f"{list(action_chunks.shape)}.")
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    device = policy.device
    # The frames stay on the CPU as uint8 (a few GB for big sets); each batch is moved and normalised on the device.
    frames = torch.from_numpy(observations)
    targets = torch.from_numpy(action_chunks.reshape(len(action_chunks), -1))
    optimizer = torch.optim.AdamW([p for name, p in policy.named_parameters() if name != "log_std"],
                                  lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.steps)
    policy.train()
    losses = []
    for _ in tqdm(range(config.steps), desc="behaviour cloning", disable=not progress):
        index = torch.randint(0, len(frames), (min(config.batch_size, len(frames)),), generator=generator)
        pixels = policy.preprocess(frames[index])
        pixels = random_shift(pixels, config.shift, generator)
        loss = F.mse_loss(policy(pixels), targets[index].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    policy.eval()
    return losses
