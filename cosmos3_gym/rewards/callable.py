"""``CallableRewardModel``: any ``(frames, tasks) -> rewards`` function as a reward model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from .base import reward_model_name

__all__ = ["CallableRewardModel"]


class CallableRewardModel:
    """Wraps ``fn(frames [B, T, 3, H, W], tasks) -> rewards`` (a tensor, numpy array or list of ``B`` numbers).

    The output is returned as a float32 tensor on the device given to ``to``, its shape kept (``validate_reward``
    checks it). The frames are passed as the caller gave them: the function decides where it computes.
    """

    def __init__(self, fn: Callable[[torch.Tensor, list[str]], Any], name: str | None = None):
        if not callable(fn):
            raise InputError(f"reward_model: expected a callable (frames, tasks) -> rewards, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or reward_model_name(fn)
        self.device = torch.device("cpu")

    def to(self, device: torch.device | str) -> CallableRewardModel:
        self.device = torch.device(device)
        return self

    def __call__(self, frames: torch.Tensor, tasks: list[str]) -> torch.Tensor:
        rewards = self.fn(frames, tasks)
        if isinstance(rewards, torch.Tensor):
            return rewards.detach().to(device=self.device, dtype=torch.float32)
        try:
            values = np.asarray(rewards, dtype=np.float32)
        except (TypeError, ValueError) as error:
            raise InputError(
                f"reward_model {self.name!r}: expected numeric rewards, got {type(rewards).__name__} ({error})"
            ) from error
        return torch.from_numpy(values).to(self.device)
