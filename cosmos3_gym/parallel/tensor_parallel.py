"""Megatron-style tensor parallelism for both towers of a loaded ``Cosmos3Transformer``, applied from outside.

Per layer (UND and GEN alike), as the native PhyAI implementation (QKVParallelLinear / RowParallelLinear):
- ``attn.qkv`` (fused q/k/v) and ``mlp.gate_up`` (fused gate/up) are column-parallel: each rank keeps the rows of
  its own query heads, KV heads and intermediate features, so attention (GQA over local heads) and the SwiGLU run
  locally with no communication;
- ``attn.out`` and ``mlp.down`` are row-parallel: each rank multiplies its slice of the input features and one
  all-reduce sums the partial outputs, i.e. 2 all-reduces per layer per tower;
- everything else (embeddings, proj_in/out, time embedder, action heads, all norms) stays replicated.

The per-head q/k RMSNorm (diffusers: ``RMSNorm(head_dim)`` applied to ``[..., heads, head_dim]``) normalises each
head on its own, so it is exact under head sharding; Wan's across-heads q/k norm would not be. The UND K/V that
``encode_text`` returns are then sharded by KV head with the same split the GEN attention expects.

Why plain tensors and one ``dist.all_reduce`` instead of DTensor ``ColwiseParallel`` / ``RowwiseParallel``: the
fused q/k/v and gate/up weights need a rank-major re-layout that DTensor's even row split does not do, the model
code would have to cope with DTensor activations (views over heads, SDPA, ``chunk``), and DTensor adds per-op
dispatch on the CPU for every one of the ~10 ops per layer x 72 layers per forward. With plain local tensors the
model code runs unchanged and the only distributed op is the all-reduce, which torch.compile also traces.
Autograd is not supported (``dist.all_reduce`` is not differentiable); this is for inference.

**Sequence parallel** (``sequence_parallel=True``, GEN tower; Megatron-SP / torchtitan's async TP): between the
decoder layers each rank keeps only 1/tp of the tokens of the residual stream. A layer all-gathers the normed
tokens before each column-parallel GEMM and reduce-scatters the output of each row-parallel GEMM back to the rank's
tokens: the same bytes as the all-reduce, but the norms and residual adds that every rank used to repeat on all
tokens run on 1/tp of them, and on CUDA the all-gather -> matmul and matmul -> reduce-scatter pairs are what
inductor's micro-pipeline pass (``_micro_pipeline_tp``) fuses into symmetric-memory kernels that move the data on the
copy engines while the GEMM runs. The UND tower, run once per prompt, keeps the all-reduce form.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from ..errors import InputError
from ..models.transformer import (
    MLP, Attention, Cosmos3Transformer, Cosmos3TransformerConfig, DecoderBlock, GenLayout, TextKV, apply_rope,
    gen_attention,
)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the input features are split across the group, the output is
    the full (replicated) result. The bias is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features_local={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


def check_tensor_parallel(config: Cosmos3TransformerConfig, tp: int) -> None:
    """Raise ``InputError`` unless the heads and the MLP width split evenly over ``tp`` ranks (cheap, no weights:
    call it before loading a large checkpoint)."""
    for name, count in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if count % tp:
            raise InputError(
                f"tp: tensor parallel size {tp} must divide the transformer's {name} ({count}); "
                f"each rank holds {name}/tp of them"
            )


def apply_tensor_parallel(
    model: Cosmos3Transformer, tp_group: dist.ProcessGroup, *, sequence_parallel: bool = False
) -> Cosmos3Transformer:
    """Shard ``model`` (a plain, fully loaded ``Cosmos3Transformer``) in place over ``tp_group`` and return it.

    Every rank of the group must call this on identical weights. Afterwards each rank holds 1/tp of the attention
    and MLP weights of both towers; ``encode_text`` and ``forward`` must then be called on every rank of the group
    with the same inputs, and return the same (replicated) outputs on all of them. ``sequence_parallel`` also
    shards the GEN tower's residual stream by token (module docstring); apply it before ``compile_blocks``.
    """
    tp = dist.get_world_size(tp_group)
    rank = dist.get_rank(tp_group)
    check_tensor_parallel(model.config, tp)
    if tp == 1:
        return model
    for layer in list(model.text_layers) + list(model.gen_layers):
        _shard_attention(layer.attn, tp, rank, tp_group)
        _shard_mlp(layer.mlp, tp, rank, tp_group)
    if sequence_parallel:
        _apply_sequence_parallel(model, tp_group)
    return model


def _apply_sequence_parallel(model: Cosmos3Transformer, group: dist.ProcessGroup) -> None:
    # Bound methods, like the originals, so that compile_blocks' regional compile still shares one graph.
    for block in model.gen_layers:
        block.gen_forward = types.MethodType(_sequence_parallel_gen_forward, block)
    model.run_gen_layers = types.MethodType(_sequence_parallel_gen_layers, model)


def _sequence_parallel_gen_layers(self: Cosmos3Transformer, x: torch.Tensor, layout: GenLayout,
                                  text: TextKV) -> torch.Tensor:
    """``run_gen_layers`` with the tokens (batch and sequence flattened, zero-padded to a multiple of tp) split into
    contiguous per-rank slices for the layers, gathered again at the end."""
    group = self.gen_layers[0].attn.out.group
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    b, s, hidden = x.shape
    tokens = F.pad(x.reshape(b * s, hidden), (0, 0, 0, (-b * s) % tp))
    local = tokens.chunk(tp)[rank]
    for layer, k, v in zip(self.gen_layers, text.keys, text.values):
        local = layer.gen_forward(local, layout.cos, layout.sin, k, v, layout.length_groups)
    return funcol.all_gather_tensor(local, 0, group)[: b * s].view(b, s, hidden)


def _sequence_parallel_gen_forward(self: DecoderBlock, x, cos, sin, text_k, text_v, length_groups):
    """``DecoderBlock.gen_forward`` on this rank's tokens ``x`` [T/tp, hidden] (T = B*S padded to a multiple of tp);
    ``cos`` [B, 1, S, D] gives B and S. Pad rows stay zero-valued through the norms and never reach attention."""
    group = self.attn.out.group
    b, s = cos.shape[0], cos.shape[2]
    normed = funcol.all_gather_tensor(self.input_norm(x), 0, group)  # [T, hidden]
    q, k, v, _ = self.attn.split_heads(self.attn.qkv(normed)[: b * s], b, s)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = gen_attention(q, k, v, text_k, text_v, length_groups).transpose(1, 2).reshape(b * s, -1)
    x = x + _matmul_reduce_scatter(F.pad(o, (0, 0, 0, normed.shape[0] - b * s)), self.attn.out, group)
    normed = funcol.all_gather_tensor(self.post_attn_norm(x), 0, group)
    return x + _matmul_reduce_scatter(self.mlp.activation(normed), self.mlp.down, group)


def _matmul_reduce_scatter(x: torch.Tensor, row_parallel: "RowParallelLinear", group) -> torch.Tensor:
    """The row-parallel GEMM's partial sums, reduce-scattered over the token dimension; bias added once after."""
    y = funcol.reduce_scatter_tensor(F.linear(x, row_parallel.weight), "sum", 0, group)
    return y + row_parallel.bias if row_parallel.bias is not None else y


def _rows(t: torch.Tensor | None, sizes: list[int], tp: int, rank: int) -> torch.Tensor | None:
    """Split ``t`` along dim 0 into consecutive blocks of ``sizes`` (e.g. q, k, v), take this rank's 1/tp of each
    block and concatenate them: the rank-major layout of a fused column-parallel weight."""
    if t is None:
        return None
    parts = []
    for block in t.split(sizes, dim=0):
        local = block.shape[0] // tp
        parts.append(block[rank * local : (rank + 1) * local])
    return torch.cat(parts).contiguous()


def _columns(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    local = t.shape[1] // tp
    return t[:, rank * local : (rank + 1) * local].contiguous()


def _replace_linear(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def _shard_attention(attn: Attention, tp: int, rank: int, group: dist.ProcessGroup) -> None:
    # Query head h belongs to rank h // (H/tp) and uses KV head h // (H/KV); since H/tp = (H/KV) * (KV/tp) its KV
    # head is on the same rank, and local query head i uses local KV head i // (H/KV): GQA stays local.
    q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    sizes = [q_rows, kv_rows, kv_rows]
    _replace_linear(attn.qkv, _rows(attn.qkv.weight, sizes, tp, rank), _rows(attn.qkv.bias, sizes, tp, rank))
    attn.num_heads //= tp
    attn.num_kv_heads //= tp
    attn.out = RowParallelLinear(_columns(attn.out.weight, tp, rank), attn.out.bias, group)


def _shard_mlp(mlp: MLP, tp: int, rank: int, group: dist.ProcessGroup) -> None:
    # Fused [gate; up] rows become [gate_r; up_r] so that MLP.forward's chunk(2) still splits gate from up.
    sizes = [mlp.intermediate] * (2 if mlp.gated else 1)
    _replace_linear(mlp.gate_up, _rows(mlp.gate_up.weight, sizes, tp, rank), _rows(mlp.gate_up.bias, sizes, tp, rank))
    mlp.intermediate //= tp
    mlp.down = RowParallelLinear(_columns(mlp.down.weight, tp, rank), mlp.down.bias, group)
