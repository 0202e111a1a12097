"""The transformer's parallel and speed plan in one place (torchtitan's ``parallelize_*``): which of tensor
parallelism, overlapped all-reduces, regional ``torch.compile`` and CUDA graphs a model gets, applied in the one
order that works. ``Cosmos3Engine.from_pretrained`` calls it to shard the model, ``Cosmos3Engine.optimize`` to speed
it up.

Order: shard (``apply_tensor_parallel``) -> [``precision="fp8"``, between the two calls] -> choose the all-reduce
(symmetric memory where the tp group is on one GPU host) and overlap it with compute (``overlap.py``; both before
compiling, which bakes them in; neither for FP8 row-parallel weights) -> compile the blocks -> capture the whole GEN
forward as CUDA graphs (``cuda_graphs.py``; graphs capture the compiled code). Every step is skipped when already
applied, so the plan can be applied again (``optimize()`` twice changes nothing).
"""

from __future__ import annotations

import os

from ..cuda_graphs import GraphedGenForward
from ..models.transformer import Cosmos3Transformer
from .mesh import ParallelContext
from .overlap import overlap_communication
from .tensor_parallel import RowParallelLinear, apply_tensor_parallel, is_quantized


def is_tensor_parallel(model: Cosmos3Transformer) -> bool:
    return any(isinstance(module, RowParallelLinear) for module in model.modules())


def has_quantized_row_weights(model: Cosmos3Transformer) -> bool:
    """Whether any row-parallel layer's weight is quantized (``precision="fp8"`` applied to a sharded model)."""
    return any(is_quantized(module.weight) for module in model.modules() if isinstance(module, RowParallelLinear))


def parallelize_transformer(
    model: Cosmos3Transformer,
    parallel: ParallelContext,
    *,
    compile: bool = False,
    tp_overlap: bool = False,
    cuda_graphs: bool = False,
    graphed_forward: GraphedGenForward | None = None,
) -> GraphedGenForward | None:
    """Apply the plan to ``model`` in place (module docstring); returns the CUDA-graphed GEN forward to call instead
    of the model (``graphed_forward`` when one is given, it is kept), or None without ``cuda_graphs``.

    - tensor parallel over ``parallel``'s tp group when tp > 1 (every rank of the group calls this together, on
      identical weights);
    - ``compile``: regional ``torch.compile`` of the transformer blocks;
    - ``tp_overlap`` (with ``compile``, tp > 1): the GEN layers' all-reduces overlap the next row block's compute, on
      PyTorch's symmetric-memory all-reduce when the model is on a GPU and the tp group inside one host; ignored
      (NCCL, blocks compiled whole) when the row-parallel weights are FP8;
    - ``cuda_graphs``: the GEN forward replayed as one CUDA graph per input signature (needs a CUDA device).
    """
    tp = parallel.config.tp
    if tp > 1 and not is_tensor_parallel(model):
        apply_tensor_parallel(model, parallel.group("tp"))
    if compile:
        # FP8 row-parallel weights: the symmetric-memory GEMM is a plain torch.mm into the shared buffer, which a
        # float8 weight cannot run, and the overlap runs the out/down GEMMs eagerly between compiled regions, where
        # their per-token activation quantization would not fuse (torchao: no gain eager). Compiled whole, the blocks
        # fuse it and trace the NCCL all-reduces.
        if tp_overlap and tp > 1 and not model.blocks_compiled and not has_quantized_row_weights(model):
            # Symmetric memory maps the peers' buffers over NVLink: only for a tp group inside one host (tp ranks are
            # adjacent, so a host's LOCAL_WORLD_SIZE ranks hold whole groups when tp divides it).
            if model.device.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", tp)) % tp == 0:
                for module in model.modules():
                    if isinstance(module, RowParallelLinear):
                        module.set_all_reduce("symm_mem")
            overlap_communication(model)
        model.compile_blocks()
    if cuda_graphs and graphed_forward is None:
        graphed_forward = GraphedGenForward(model)
    return graphed_forward
