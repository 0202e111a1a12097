"""cosmos3_gym: NVIDIA Cosmos3 as Gymnasium environments."""

from .engine import Cosmos3Engine, Cosmos3Request, Cosmos3Result
from .engine_protocol import WorldModelEngine
from .envs import register_envs
from .errors import CheckpointError, InputError
from .launcher import load_engine
from .parallel.mesh import ParallelConfig

register_envs()

__all__ = [
    "Cosmos3Engine", "Cosmos3Request", "Cosmos3Result", "WorldModelEngine", "load_engine", "ParallelConfig",
    "CheckpointError", "InputError",
]
__version__ = "0.1.0"
