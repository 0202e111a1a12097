"""cosmos3_gym: NVIDIA Cosmos3 as Gymnasium environments."""

from .engine import Cosmos3Engine, Cosmos3Request, Cosmos3Result
from .errors import CheckpointError, InputError

__all__ = ["Cosmos3Engine", "Cosmos3Request", "Cosmos3Result", "CheckpointError", "InputError"]
__version__ = "0.1.0"
