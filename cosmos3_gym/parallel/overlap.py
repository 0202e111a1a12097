"""Overlap of the GEN layers' tensor-parallel all-reduces with compute: a plan applied on top of
``apply_tensor_parallel``.

At tp=4 on the full Nano shape the GEN forward's 72 all-reduces of one [tokens, hidden] activation run alone for
about a third of the forward (benchmarks/results/parallel/parallel_gpu_world4_graphs_symm.json). Each sharded GEN
layer here runs the tokens after attention in ``chunks`` row blocks: the attention output projection of every block
is issued back to back, each block's all-reduce starting as soon as its GEMM is done, and then block i's residual,
norm and gate/up GEMM run while block i+1's sum is still travelling, and block i's MLP sum travels while block i+1's
MLP computes. Attention needs every token and runs whole. Only the last block's MLP sum waits alone.

With ``all_reduce="symm_mem"`` the sums run on a second CUDA stream with PyTorch's two-shot kernel, which takes 24
of the GPU's SMs and leaves the rest to the GEMMs; with NCCL (and gloo on CPU) they are async collectives. The math
is the layer's own: every row goes through the same per-row ops, the sums are the same sums.

The orchestration is eager Python between compiled regions (the attention, and the residual + norm + gate/up of a
block): torch.compile would have to trace the stream switches. It is meant to be replayed as a CUDA graph
(``Cosmos3Engine.optimize()``), which removes the extra launches from the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ..errors import InputError
from ..models.transformer import Cosmos3Transformer, DecoderBlock
from .tensor_parallel import RowParallelLinear


def overlap_communication(model: Cosmos3Transformer, chunks: int = 2) -> Cosmos3Transformer:
    """Make every tensor-parallel GEN layer of ``model`` overlap its all-reduces with compute over ``chunks`` row
    blocks (module docstring). Call after ``apply_tensor_parallel`` and before ``compile_blocks``.

    Keeping SMs out of the overlapped GEMMs (cuBLAS' SM count target) was measured and did not help (commit 8280af9,
    benchmarks/results/parallel/parallel_gpu_world4_overlap_carveout.json)."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 2:
        raise InputError(f"overlap chunks: expected an integer >= 2, got {chunks!r}")
    layers = cast("Sequence[DecoderBlock]", model.gen_layers)
    if not all(isinstance(layer.mlp.down, RowParallelLinear) for layer in layers):
        raise InputError("overlap: the model is not tensor-parallel; call apply_tensor_parallel(model, group) first")
    for layer in layers:
        # An instance attribute shadows the method; setattr: mypy rejects assigning to a method (method-assign).
        setattr(layer, "gen_forward", OverlappedGenForward(layer, chunks))  # noqa: B010
    return model


def _residual_mlp_input(block: DecoderBlock, x: torch.Tensor, attention: torch.Tensor):
    x = x + attention
    return x, block.mlp.activation(block.post_attn_norm(x))


class OverlappedGenForward:
    """``DecoderBlock.gen_forward`` of a tensor-parallel layer with its all-reduces overlapped (module docstring)."""

    def __init__(self, block: DecoderBlock, chunks: int):
        self.block, self.chunks = block, chunks
        self.attention = block.gen_attention
        self.residual_mlp_input = _residual_mlp_input

    def compile_regions(self) -> None:
        """What ``Cosmos3Transformer.compile_blocks`` calls instead of compiling this forward whole."""
        self.attention = torch.compile(self.block.gen_attention)
        self.residual_mlp_input = torch.compile(_residual_mlp_input)

    def __call__(self, x, cos, sin, text_k, text_v, length_groups):
        block = self.block
        batch, seq, hidden = x.shape
        rows = x.reshape(batch * seq, hidden)
        attention = self.attention(x, cos, sin, text_k, text_v, length_groups).reshape(batch * seq, -1)
        total, n = batch * seq, min(self.chunks, batch * seq)
        spans = [(total * i // n, total * (i + 1) // n) for i in range(n)]
        attention_sums = [block.attn.out.start(attention[a:b], slot=i) for i, (a, b) in enumerate(spans)]
        residuals, mlp_sums = [], []
        for i, ((a, b), pending) in enumerate(zip(spans, attention_sums)):
            residual, mlp_input = self.residual_mlp_input(block, rows[a:b], pending.wait())
            residuals.append(residual)
            mlp_sums.append(block.mlp.down.start(mlp_input, slot=len(spans) + i))
        out = torch.empty_like(rows)
        for (a, b), residual, pending in zip(spans, residuals, mlp_sums):
            torch.add(residual, pending.wait(), out=out[a:b])
        return out.view(batch, seq, hidden)
