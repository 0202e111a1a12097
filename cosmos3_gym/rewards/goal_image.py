"""``GoalImageRewardModel``: how close a chunk's last frame is to a goal image.

Two spaces:

* ``"pixel"``: ``exp(-mse / scale)`` between the last frame and the goal (both in [0, 1]), in (0, 1], 1 exactly at
  the goal. ``scale`` sets how fast it falls: an MSE of ``scale`` gives ``1/e``.
* ``"latent"``: cosine similarity, in [-1, 1], between the Cosmos3 VAE latents of the last frame and of the goal
  (the goal is encoded once, at construction). Latents compare layout and content more than exact pixel values.

Frames are resized to the goal's size (snapped down to a multiple of the VAE's 16-pixel grid in latent space) before
comparing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..processor import load_frames
from .base import check_frames

__all__ = ["GoalImageRewardModel", "SPACES"]

SPACES = ("pixel", "latent")


class GoalImageRewardModel:
    """Similarity of each chunk's last frame to ``goal`` (anything ``processor.load_frames`` reads: a path, PIL
    image, array or tensor holding one image). ``space="latent"`` needs ``vae`` (a ``Cosmos3VAE``, e.g.
    ``engine.vae``); the VAE stays where it is (``to`` moves only this model's tensors and outputs)."""

    def __init__(
        self,
        goal: Any,
        *,
        space: str = "pixel",
        scale: float = 0.05,
        vae: Any = None,
        device: torch.device | str = "cpu",
        name: str | None = None,
    ):
        if space not in SPACES:
            raise InputError(f"space: expected one of {list(SPACES)}, got {space!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise InputError(f"scale: expected a positive number, got {scale!r}")
        if space == "latent" and vae is None:
            raise InputError(
                "vae: space='latent' needs a Cosmos3VAE, e.g. engine.vae (resolve_reward_model(..., vae=) passes it on)"
            )
        goal_frames = load_frames(goal)
        if goal_frames.shape[0] != 1:
            raise InputError(f"goal: expected one image, got {goal_frames.shape[0]} frames")
        goal_image = torch.from_numpy(goal_frames[0]).permute(2, 0, 1)[None]  # [1, 3, H, W] in [0, 1]

        self.space = space
        self.scale = float(scale)
        self.vae = vae if space == "latent" else None
        self.name = name or f"goal_image(space={space})"
        height, width = goal_image.shape[-2:]
        if space == "latent":
            grid = vae.spatial_compression
            self.size = (max(grid, height // grid * grid), max(grid, width // grid * grid))
            goal_target = self._encode(_resize(goal_image, self.size))
        else:
            self.size = (height, width)
            goal_target = goal_image
        self.goal = goal_target.to(device)  # [1, 3, H, W] pixels or [1, C * h * w] latents

    @property
    def device(self) -> torch.device:
        return self.goal.device

    def to(self, device: torch.device | str) -> GoalImageRewardModel:
        self.goal = self.goal.to(device)
        return self

    @torch.no_grad()
    def __call__(self, frames: torch.Tensor, tasks: list[str]) -> torch.Tensor:
        frames, _ = check_frames(frames, tasks)
        last = _resize(frames[:, -1].float(), self.size)
        if self.space == "pixel":
            mse = (last.to(self.device) - self.goal).square().flatten(1).mean(dim=1)
            return torch.exp(-mse / self.scale)
        latents = self._encode(last).to(self.device)
        return F.cosine_similarity(latents, self.goal.expand_as(latents), dim=1)

    def _encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[N, 3, H, W]`` in [0, 1] -> flattened VAE latents ``[N, C * h * w]`` (one latent frame each)."""
        vae = self.vae
        assert vae is not None  # only the latent space encodes
        vae_device = vae.latents_mean.device
        latents = vae.encode((images * 2.0 - 1.0)[:, :, None].to(vae_device))
        return latents.flatten(1).float()


def _resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    return F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=True).clamp(0, 1)
