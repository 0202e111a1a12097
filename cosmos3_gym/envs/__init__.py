"""Gymnasium environments backed by the Cosmos3 world model.

``WorldModelEnv`` (one rollout), ``WorldModelVectorEnv`` (a batch of rollouts sharing one model call per step) and
``SB3VecEnv`` (Stable-Baselines3's VecEnv API over the vector env). ``cosmos3_gym/WorldModel-v0`` (any checkpoint) is
registered with Gymnasium by ``cosmos3_gym.registration``; tasks register their own ids there.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..checkpoint import builtin_model_name
from ..data.initial_states import InitialState, InitialStateSource, load_initial_states
from ..registration import ENV_ID, builtin_model, default_builtin_model, register_envs
from .core import REWARD_MODES, model_frame_size
from .sb3 import SB3VecEnv
from .settings import WorldModelSettings
from .vector_env import WorldModelVectorEnv
from .world_model_env import WorldModelEnv

__all__ = [
    "ENV_ID",
    "REWARD_MODES",
    "InitialState",
    "InitialStateSource",
    "SB3VecEnv",
    "WorldModelEnv",
    "WorldModelSettings",
    "WorldModelVectorEnv",
    "load_initial_states",
    "make_world_model_env",
    "make_world_model_vector_env",
    "model_frame_size",
    "register_envs",
]


def _builtin_factory(kwargs: dict[str, Any], vector: bool):
    """The factory of the built-in model the arguments name (``checkpoint="NAME"`` / ``"builtin:NAME"``, or neither a
    checkpoint nor an engine: the default built-in model), with ``checkpoint`` dropped; None for any other checkpoint.
    A built-in model is built by its task's own factory, so ``WorldModel-v0`` with it is the task's env."""
    if kwargs.get("engine") is not None:
        return None
    if kwargs.get("checkpoint") is None:
        model = default_builtin_model()
    else:
        name = builtin_model_name(kwargs["checkpoint"])
        model = builtin_model(name) if name is not None else None
    if model is None:
        return None
    kwargs.pop("checkpoint", None)
    module, _, function = (model.vector_entry_point if vector else model.env_entry_point).partition(":")
    return getattr(importlib.import_module(module), function)


def make_world_model_env(**kwargs: Any) -> WorldModelEnv:
    """``WorldModel-v0``: a ``WorldModelEnv`` on the given checkpoint; a built-in model (by name, or the default one
    when neither ``checkpoint`` nor ``engine`` is given) is built by its task's factory with its own settings."""
    factory = _builtin_factory(kwargs, vector=False)
    return factory(**kwargs) if factory is not None else WorldModelEnv(**kwargs)


def make_world_model_vector_env(num_envs: int = 1, **kwargs: Any) -> WorldModelVectorEnv:
    factory = _builtin_factory(kwargs, vector=True)
    return factory(num_envs, **kwargs) if factory is not None else WorldModelVectorEnv(num_envs, **kwargs)
