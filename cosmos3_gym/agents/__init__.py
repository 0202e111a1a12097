"""Helper agents built on the engine's other two modes: ``PolicyAgent`` (image + task -> action chunk) and
``InverseDynamicsAgent`` (video -> action chunk); and ``SB3PolicyAgent``, a Stable-Baselines3 PPO policy saved as
safetensors (``save_sb3_policy`` / ``load_sb3_policy``)."""

from .inverse_dynamics import InverseDynamicsAgent, action_errors, video_windows
from .policy import PolicyAgent
from .sb3_policy import SB3PolicyAgent, load_sb3_policy, read_sb3_policy_metadata, save_sb3_policy

__all__ = [
    "InverseDynamicsAgent",
    "PolicyAgent",
    "SB3PolicyAgent",
    "action_errors",
    "load_sb3_policy",
    "read_sb3_policy_metadata",
    "save_sb3_policy",
    "video_windows",
]
