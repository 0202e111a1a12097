"""Gymnasium environments backed by the Cosmos3 world model.

``WorldModelEnv`` (one rollout), ``WorldModelVectorEnv`` (a batch of rollouts sharing one model call per step) and
``SB3VecEnv`` (Stable-Baselines3's VecEnv API over the vector env). ``register_envs()`` registers
``cosmos3_gym/WorldModel-v0`` (any checkpoint) and ``cosmos3_gym/PushT-v0`` (the built-in PushT model, ``pusht.py``)
with Gymnasium for ``gym.make`` / ``gym.make_vec``.
"""

from __future__ import annotations

from .core import REWARD_MODES, model_frame_size
from .settings import WorldModelSettings
from .initial_states import InitialState, InitialStateSource, load_initial_states
from .pusht import (
    PUSHT_ENV_ID, builtin_checkpoint_dir, make_pusht_env, make_pusht_vector_env,
)
from ..registration import ENV_ID, register_envs
from .sb3 import SB3VecEnv
from .vector_env import WorldModelVectorEnv
from .world_model_env import WorldModelEnv

__all__ = [
    "ENV_ID",
    "REWARD_MODES",
    "InitialState",
    "InitialStateSource",
    "PUSHT_ENV_ID",
    "SB3VecEnv",
    "WorldModelEnv",
    "WorldModelSettings",
    "WorldModelVectorEnv",
    "load_initial_states",
    "make_pusht_env",
    "make_pusht_vector_env",
    "make_world_model_env",
    "make_world_model_vector_env",
    "model_frame_size",
    "register_envs",
]


def _uses_builtin_model(kwargs: dict) -> bool:
    return kwargs.get("checkpoint") is None and kwargs.get("engine") is None and builtin_checkpoint_dir() is not None


def make_world_model_env(**kwargs) -> WorldModelEnv:
    """``WorldModel-v0``: without ``checkpoint`` or ``engine``, the built-in PushT model with its own settings (its
    domain, chunk and action statistics belong together), else a ``WorldModelEnv`` on the given checkpoint."""
    return make_pusht_env(**kwargs) if _uses_builtin_model(kwargs) else WorldModelEnv(**kwargs)


def make_world_model_vector_env(num_envs: int = 1, **kwargs) -> WorldModelVectorEnv:
    if _uses_builtin_model(kwargs):
        return make_pusht_vector_env(num_envs, **kwargs)
    return WorldModelVectorEnv(num_envs, **kwargs)
