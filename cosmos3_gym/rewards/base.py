"""The reward-model protocol and the checks on both sides of a reward-model call.

A reward model scores generated video chunks: ``model(frames, tasks)`` takes ``frames`` ``[B, T, 3, H, W]`` float
in [0, 1] (the decoded frames of one env step for each of ``B`` env slots) and ``tasks`` (one instruction per slot)
and returns one float reward per slot, ``[B]``, on the model's device. ``model.to(device)`` moves it to the engine's
device. Any object with these two methods is a reward model; nothing has to be subclassed.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import InputError

__all__ = ["RewardModel", "check_frames", "reward_model_name", "validate_reward"]


@runtime_checkable
class RewardModel(Protocol):
    """Scores video chunks: ``frames [B, T, 3, H, W]`` in [0, 1] and ``tasks`` (``B`` strings) -> rewards ``[B]``."""

    def __call__(self, frames: torch.Tensor, tasks: list[str]) -> torch.Tensor: ...

    def to(self, device: torch.device | str) -> RewardModel: ...


def reward_model_name(model: Any) -> str:
    """How error messages name a reward model: its ``name`` attribute, else its function or class name."""
    name = getattr(model, "name", None)
    if isinstance(name, str) and name:
        return name
    if hasattr(model, "__name__"):  # a plain function
        return model.__name__
    return type(model).__name__


def check_frames(frames: Any, tasks: Any) -> tuple[torch.Tensor, list[str]]:
    """Validate a reward-model input: a float tensor ``[B, T, 3, H, W]`` in [0, 1] and ``B`` task strings.

    Numpy arrays are accepted and turned into tensors. Returns ``(frames, tasks)``; ``InputError`` naming the field
    otherwise.
    """
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(frames)
    if not isinstance(frames, torch.Tensor):
        raise InputError(f"frames: expected a float tensor [B, T, 3, H, W] in [0, 1], got {type(frames).__name__}")
    if frames.ndim != 5 or frames.shape[2] != 3 or min(frames.shape) == 0:
        raise InputError(f"frames: expected a non-empty tensor [B, T, 3, H, W], got shape {list(frames.shape)}")
    if not frames.is_floating_point():
        raise InputError(f"frames: expected floating-point pixels in [0, 1], got dtype {frames.dtype}")
    low, high = frames.aminmax()
    if not (0.0 <= low.item() and high.item() <= 1.0):  # also false for NaN
        raise InputError(f"frames: expected pixel values in [0, 1], got range [{low.item()}, {high.item()}]")
    if isinstance(tasks, str) or not isinstance(tasks, (list, tuple)):
        raise InputError(f"tasks: expected a list of {frames.shape[0]} strings, got {type(tasks).__name__}")
    if len(tasks) != frames.shape[0] or not all(isinstance(task, str) for task in tasks):
        raise InputError(f"tasks: expected {frames.shape[0]} strings (one per batch row of frames), got {tasks!r}")
    return frames, list(tasks)


def validate_reward(rewards: Any, batch: int, model: Any = None) -> torch.Tensor:
    """Check a reward model's output: ``batch`` finite numbers, as a float32 tensor ``[batch]`` (device kept).

    Environments call this on every reward-model output so that a faulty model fails at the call that produced the
    bad values, with an ``InputError`` naming the model, instead of corrupting returns downstream.
    """
    who = f"reward_model {reward_model_name(model)!r}" if model is not None else "reward_model"
    if isinstance(rewards, np.ndarray):
        rewards = torch.from_numpy(rewards)
    if not isinstance(rewards, torch.Tensor):
        raise InputError(f"{who}: expected a tensor of {batch} rewards, got {type(rewards).__name__}")
    if tuple(rewards.shape) != (batch,):
        raise InputError(f"{who}: expected rewards of shape [{batch}] (one per batch row), got {list(rewards.shape)}")
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise InputError(f"{who}: expected real-valued rewards, got dtype {rewards.dtype}")
    rewards = rewards.detach().to(torch.float32)
    if not torch.isfinite(rewards).all():
        raise InputError(f"{who}: returned NaN or infinite rewards: {rewards.tolist()}")
    return rewards
