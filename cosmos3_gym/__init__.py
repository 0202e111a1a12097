"""cosmos3_gym: NVIDIA Cosmos3 as Gymnasium environments."""

from __future__ import annotations

from typing import Any

from .errors import CheckpointError, InputError

__all__ = ["Cosmos3Engine", "Cosmos3Request", "Cosmos3Result", "CheckpointError", "InputError"]
__version__ = "0.1.0"

# The engine (torch, diffusers) loads on first use, so `import cosmos3_gym` - and the CLI's --help, --version and
# argument errors - stay fast.
_LAZY = {"Cosmos3Engine": "engine", "Cosmos3Request": "engine", "Cosmos3Result": "engine"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_envs() -> None:
    """Register the env ids with Gymnasium by entry-point strings: the env modules (and torch) load at gym.make.
    The same ids and entry points as ``cosmos3_gym.envs.register_envs`` (idempotent)."""
    try:
        import gymnasium
    except ImportError:  # the CLI works without Gymnasium for `infer`
        return
    for env_id, module in (("cosmos3_gym/PushT-v0", "cosmos3_gym.envs.pusht:make_pusht"),
                           ("cosmos3_gym/WorldModel-v0", "cosmos3_gym.envs:make_world_model")):
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=f"{module}_env", vector_entry_point=f"{module}_vector_env",
                               order_enforce=False)


_register_envs()
