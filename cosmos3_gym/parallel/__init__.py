"""Multi-GPU inference: the (dp, cfg, tp) mesh, tensor parallel for the transformer and the plan that applies it
(``plan.py``), the SPMD collectives, tile-parallel VAE decode, and the worker processes / Ray replicas that
``cosmos3_gym.load_engine(..., tp=, cfg_parallel=, dp=, backend=)`` starts.
"""

from .mesh import ParallelConfig, ParallelContext, init_parallel
from .tensor_parallel import RowParallelLinear, apply_tensor_parallel, check_tensor_parallel

__all__ = [
    "ParallelConfig", "ParallelContext", "init_parallel", "RowParallelLinear", "apply_tensor_parallel",
    "check_tensor_parallel",
]
