"""Reward models: a small protocol, a registry (in-process and entry points) and built-in models.

``resolve_reward_model(spec, device)`` turns ``None``, a callable, a reward model or a spec string
(``"classifier:PATH"``, ``"goal_image:PATH?space=latent"``, a registered name) into a model with
``model(frames [B, T, 3, H, W] in [0, 1], tasks) -> rewards [B]``; ``validate_reward`` checks each output.
"""

from .base import RewardModel, check_frames, reward_model_name, validate_reward
from .calibration import fit_success_threshold, success_threshold_table
from .callable import CallableRewardModel
from .classifier import ClassifierRewardModel, train_classifier
from .goal_image import GoalImageRewardModel
from .registry import (
    ENTRY_POINT_GROUP,
    RewardModelSpec,
    available_reward_models,
    register_reward_model,
    resolve_reward_model,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "CallableRewardModel",
    "ClassifierRewardModel",
    "GoalImageRewardModel",
    "RewardModel",
    "RewardModelSpec",
    "available_reward_models",
    "check_frames",
    "fit_success_threshold",
    "register_reward_model",
    "resolve_reward_model",
    "reward_model_name",
    "success_threshold_table",
    "train_classifier",
    "validate_reward",
]
