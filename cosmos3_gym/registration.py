"""Registering the env ids with Gymnasium without importing the envs (torch, diffusers): entry points are strings,
and the one setting the spec needs from the built-in model, its episode length, is read from its ``meta.json``.

``import cosmos3_gym`` calls ``register_envs()``, so ``gym.make("cosmos3_gym/PushT-v0")`` works after it while the
package import (and the CLI's ``--help``) stays fast. ``cosmos3_gym.envs.register_envs`` registers the same ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["ENV_ID", "PUSHT_ENV_ID", "builtin_max_episode_steps", "register_envs"]

ENV_ID = "cosmos3_gym/WorldModel-v0"
PUSHT_ENV_ID = "cosmos3_gym/PushT-v0"
ASSETS_ENV_VAR = "COSMOS3_GYM_PUSHT_ASSETS"  # envs/pusht.py: another folder of the built-in model's layout


def builtin_max_episode_steps() -> int | None:
    """The built-in PushT checkpoint's episode length (its meta.json ``max_episode_steps``); None if not installed."""
    override = os.environ.get(ASSETS_ENV_VAR)
    root = Path(override).expanduser() if override else Path(__file__).resolve().parent / "assets" / "pusht"
    try:
        value = json.loads((root / "checkpoint" / "meta.json").read_text()).get("max_episode_steps")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def register_envs() -> None:
    """Register ``cosmos3_gym/PushT-v0`` (spec ``max_episode_steps``: the built-in model's) and
    ``cosmos3_gym/WorldModel-v0`` (idempotent; a no-op without Gymnasium). Gymnasium's ``OrderEnforcing`` is off: the
    envs check the order of calls themselves.

    ``gym.make(ENV_ID, checkpoint=..., ...)`` builds a ``WorldModelEnv`` and ``gym.make_vec(ENV_ID, num_envs=N, ...)``
    a ``WorldModelVectorEnv`` (through ``vector_entry_point``; ``autoreset_mode=`` and ``group_size=`` go to it);
    ``gym.make(max_episode_steps=...)`` adds a ``TimeLimit``, ``make_vec`` hands it to the vector env (per slot)."""
    try:
        import gymnasium
    except ImportError:  # `cosmos3-gym infer` works without Gymnasium
        return
    for env_id, module, max_episode_steps in (
        (PUSHT_ENV_ID, "cosmos3_gym.envs.pusht:make_pusht", builtin_max_episode_steps()),
        (ENV_ID, "cosmos3_gym.envs:make_world_model", None),
    ):
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=f"{module}_env", vector_entry_point=f"{module}_vector_env",
                               order_enforce=False, max_episode_steps=max_episode_steps)
