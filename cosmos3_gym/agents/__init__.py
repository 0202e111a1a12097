"""Helper agents built on the engine's other two modes: ``PolicyAgent`` (image + task -> action chunk) and
``InverseDynamicsAgent`` (video -> action chunk); ``SB3PolicyAgent``, a Stable-Baselines3 PPO policy saved as
safetensors (``save_sb3_policy`` / ``load_sb3_policy``); and remote policies over openpi's websocket protocol:
``RemotePolicyAgent`` (a client, ``ws://`` policy specs) and ``PolicyServer`` (``cosmos3-gym serve-policy``).

The names load on first use, so the remote-policy client (msgpack and websockets, no torch) and the policy-spec
registry that needs it import without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .inverse_dynamics import InverseDynamicsAgent, action_errors, video_windows
    from .policy import PolicyAgent
    from .remote import ObservationAdapter, RemotePolicyAgent, RemotePolicyError
    from .sb3_policy import SB3PolicyAgent, load_sb3_policy, read_sb3_policy_metadata, save_sb3_policy
    from .serving import PolicyServer

__all__ = [
    "InverseDynamicsAgent",
    "ObservationAdapter",
    "PolicyAgent",
    "PolicyServer",
    "RemotePolicyAgent",
    "RemotePolicyError",
    "SB3PolicyAgent",
    "action_errors",
    "load_sb3_policy",
    "read_sb3_policy_metadata",
    "save_sb3_policy",
    "video_windows",
]

_LAZY = {
    "InverseDynamicsAgent": "inverse_dynamics",
    "action_errors": "inverse_dynamics",
    "video_windows": "inverse_dynamics",
    "PolicyAgent": "policy",
    "ObservationAdapter": "remote",
    "RemotePolicyAgent": "remote",
    "RemotePolicyError": "remote",
    "SB3PolicyAgent": "sb3_policy",
    "load_sb3_policy": "sb3_policy",
    "read_sb3_policy_metadata": "sb3_policy",
    "save_sb3_policy": "sb3_policy",
    "PolicyServer": "serving",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
