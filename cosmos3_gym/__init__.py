"""cosmos3_gym: NVIDIA Cosmos3 as Gymnasium environments."""

from __future__ import annotations

from typing import Any

from .errors import CheckpointError, InputError

__all__ = [
    "Cosmos3Engine",
    "Cosmos3Request",
    "Cosmos3Result",
    "WorldModelEngine",
    "load_engine",
    "ParallelConfig",
    "CheckpointError",
    "InputError",
]
__version__ = "0.1.0"

# The engine (torch, diffusers) loads on first use, so `import cosmos3_gym` - and the CLI's --help, --version and
# argument errors - stay fast.
_LAZY = {
    "Cosmos3Engine": "engine",
    "Cosmos3Request": "engine",
    "Cosmos3Result": "engine",
    "WorldModelEngine": "engine_protocol",
    "load_engine": "launcher",
    "ParallelConfig": "parallel.mesh",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from .registration import register_envs  # noqa: E402  (string entry points: no torch)

register_envs()
