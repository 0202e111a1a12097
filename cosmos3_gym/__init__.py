"""cosmos3_gym: NVIDIA Cosmos3 as Gymnasium environments."""

from .engine import Cosmos3Engine, Cosmos3Request, Cosmos3Result
from .envs import register_envs
from .errors import CheckpointError, InputError

register_envs()

__all__ = ["Cosmos3Engine", "Cosmos3Request", "Cosmos3Result", "CheckpointError", "InputError"]
__version__ = "0.1.0"
