"""Multi-GPU inference inside an engine: the (dp, cfg, tp) mesh, tensor parallel for the transformer and the plan
that applies it (``plan.py``), the SPMD collectives and tile-parallel VAE decode. The worker processes and Ray
replicas that ``cosmos3_gym.load_engine(..., tp=, cfg_parallel=, dp=, backend=)`` starts are ``cosmos3_gym.executors``.
"""

from .mesh import ParallelConfig, ParallelContext, init_parallel
from .tensor_parallel import RowParallelLinear, apply_tensor_parallel, check_tensor_parallel

__all__ = [
    "ParallelConfig",
    "ParallelContext",
    "init_parallel",
    "RowParallelLinear",
    "apply_tensor_parallel",
    "check_tensor_parallel",
]
