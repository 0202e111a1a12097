"""Reinforcement learning that runs in both worlds (the world model and gym-pusht): a pixel policy, behaviour
cloning, DAgger and GRPO.

``policy``: ``PixelGaussianPolicy`` and its safetensors files (``load_policy_file``). ``bc``: behaviour cloning.
``dagger``: DAgger with a simulator that labels the states the policy visits. ``grpo``: group-relative policy
optimisation on any vector env with group resets.
"""

from .bc import BCConfig, train_bc
from .dagger import DAggerConfig, train_dagger
from .policy import PixelGaussianPolicy, PolicyConfig, load_policy_file, read_policy_metadata, save_policy_file

__all__ = ["BCConfig", "DAggerConfig", "PixelGaussianPolicy", "PolicyConfig", "load_policy_file",
           "read_policy_metadata", "save_policy_file", "train_bc", "train_dagger"]
