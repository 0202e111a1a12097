"""Multi-GPU inference: the (dp, cfg, tp) mesh, tensor parallel for the transformer, tile-parallel VAE decode and
the client mode that starts SPMD workers. ``Cosmos3Engine.from_pretrained(..., tp=, cfg=, dp=)`` is the entry point.
"""

from .mesh import ParallelConfig, ParallelContext, init_parallel
from .tensor_parallel import RowParallelLinear, apply_tensor_parallel, check_tensor_parallel

__all__ = [
    "ParallelConfig", "ParallelContext", "init_parallel", "RowParallelLinear", "apply_tensor_parallel",
    "check_tensor_parallel",
]
