"""Reinforcement learning that runs in any world with the world-model env's spaces (the world model, or a real
simulator behind the same vector-env interface): a pixel policy, behaviour cloning and GRPO.

``policy``: ``PixelGaussianPolicy`` and its safetensors files (``load_policy_file``). ``bc``: behaviour cloning.
``grpo``: group-relative policy optimisation on any vector env with group resets.
"""

from .bc import BCConfig, train_bc
from .policy import PixelGaussianPolicy, PolicyConfig, load_policy_file, read_policy_metadata, save_policy_file

__all__ = [
    "BCConfig",
    "PixelGaussianPolicy",
    "PolicyConfig",
    "load_policy_file",
    "read_policy_metadata",
    "save_policy_file",
    "train_bc",
]
