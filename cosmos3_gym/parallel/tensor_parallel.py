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

``all_reduce="symm_mem"`` swaps NCCL for PyTorch's two-shot symmetric-memory all-reduce on GPUs: the row-parallel
GEMM writes its partial sum straight into a buffer that every rank of the group has mapped, and one kernel reduces
and gathers it over NVLink loads and stores (benchmarks/allreduce_gpu.py measures both collectives on their own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast, overload

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..errors import InputError
from ..models.transformer import MLP, Attention, Cosmos3Transformer, Cosmos3TransformerConfig, DecoderBlock

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

ALL_REDUCES = ("nccl", "symm_mem")

# (group name, dtype, device, slot) -> the symmetric-memory buffers every rank of the group has mapped, largest last.
# A slot is one all-reduce that may be in flight at a time (parallel/overlap.py has several). A call uses a prefix of
# the largest buffer; a larger activation allocates a buffer twice the size (a collective, which the ranks reach
# together since they run the same forwards). Outgrown buffers are kept: CUDA graphs may have captured them.
_SYMM_BUFFERS: dict[tuple, list[torch.Tensor]] = {}
_COMM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _symm_buffer(group_name: str, numel: int, dtype: torch.dtype, device: torch.device, slot: int) -> torch.Tensor:
    buffers = _SYMM_BUFFERS.setdefault((group_name, dtype, device, slot), [])
    if not buffers or buffers[-1].numel() < numel:
        import torch.distributed._symmetric_memory as symm_mem

        capacity = max(numel, 2 * buffers[-1].numel() if buffers else 0)
        buffer = symm_mem.empty(capacity, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, cast("GroupName", group_name))  # a GroupName is a str (NewType)
        buffers.append(buffer)
    return buffers[-1][:numel]


def release_symmetric_buffers(group_name: str) -> None:
    """Drop the symmetric-memory buffers of ``group_name`` (``Cosmos3Engine.offload``). Every rank of the group must
    call it together, and only after resetting any CUDA graph that captured the buffers; the next all-reduce
    allocates them again (collectively, as the ranks run the same forwards)."""
    for key in [key for key in _SYMM_BUFFERS if key[0] == group_name]:
        del _SYMM_BUFFERS[key]


def _linear_two_shot(
    x: torch.Tensor, weight: torch.Tensor, group_name: str, slot: int, stream: torch.cuda.Stream | None = None
) -> torch.Tensor:
    """``all_reduce(x @ weight^T)`` for the rows ``x`` ([rows, in_features]): the GEMM writes into the slot's
    symmetric buffer, the two-shot kernel sums it into a new tensor on ``stream`` (default: the current one)."""
    buffer = _symm_buffer(group_name, x.shape[0] * weight.shape[0], x.dtype, x.device, slot)
    torch.mm(x, weight.t(), out=buffer.view(x.shape[0], weight.shape[0]))
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(x.device))  # the GEMM above has filled the buffer
    with torch.cuda.stream(stream):  # (None: the current stream)
        torch.ops.symm_mem.two_shot_all_reduce_out(buffer, "sum", group_name, out.view(-1))
    return out


# An opaque op for torch.compile: inductor cannot trace the buffer lookup, and must not reorder the GEMM's write into
# the shared buffer away from the collective that reads it.
@torch.library.custom_op("cosmos3_gym::linear_all_reduce_symm_mem", mutates_args=())
def linear_all_reduce_symm_mem(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> torch.Tensor:
    """``all_reduce(x @ weight^T)`` over ``group_name`` with the two-shot symmetric-memory kernel."""
    out = _linear_two_shot(x.reshape(-1, x.shape[-1]), weight, group_name, slot=-1)
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_all_reduce_symm_mem.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def is_quantized(weight: torch.Tensor) -> bool:
    """Whether a quantization plan (``precision="fp8"``) swapped ``weight`` for a tensor subclass (torchao's
    ``Float8Tensor``): ``F.linear`` dispatches it to the quantized GEMM, code that multiplies the plain tensor itself
    (``torch.mm(..., out=)``) cannot take it."""
    return type(weight) not in (torch.Tensor, nn.Parameter)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the input features are split across the group, the output is
    the full (replicated) result. The bias is added once, after the sum. ``all_reduce``: "nccl" (``dist.all_reduce``,
    any backend) or "symm_mem" (CUDA only, see the module docstring)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup, all_reduce: str = "nccl"
    ):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group
        self.set_all_reduce(all_reduce)

    def set_all_reduce(self, all_reduce: str) -> None:
        """Switch the collective ("nccl" or "symm_mem"); before ``compile_blocks``, which bakes it in."""
        if all_reduce == "symm_mem" and is_quantized(self.weight):
            raise InputError(
                f"all_reduce: 'symm_mem' multiplies the plain weight into the shared buffer (torch.mm), and this "
                f"layer's weight is quantized ({type(self.weight).__name__}); keep 'nccl'"
            )
        check_all_reduce(all_reduce, self.weight.device)
        self.all_reduce = all_reduce
        # A plain string for the compiled graphs (dynamo treats it as a constant; the group object is opaque to it).
        self.group_name: str | None = self.group.group_name if all_reduce == "symm_mem" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce == "symm_mem":
            y = linear_all_reduce_symm_mem(x, self.weight, self.group_name)
        else:
            y = F.linear(x, self.weight)
            dist.all_reduce(y, group=self.group)
        return y + self.bias if self.bias is not None else y

    def start(self, x: torch.Tensor, slot: int) -> PendingSum:
        """``forward`` of the rows ``x`` ([rows, in_features_local]) with the all-reduce left in flight: the caller
        computes something else and then calls ``wait()``. Up to one pending sum per ``slot`` (symm_mem: the slot's
        shared buffer must not be rewritten before its sum is waited for). Not for torch.compile'd code."""
        if self.all_reduce == "symm_mem":
            if x.device not in _COMM_STREAMS:
                # High priority: the collective's blocks are scheduled ahead of the waiting GEMM blocks.
                _COMM_STREAMS[x.device] = torch.cuda.Stream(x.device, priority=-1)
            comm = _COMM_STREAMS[x.device]
            assert self.group_name is not None  # set with all_reduce="symm_mem"
            out = _linear_two_shot(x, self.weight, self.group_name, slot, stream=comm)
            done = torch.cuda.Event()
            done.record(comm)
            return PendingSum(out, self.bias, event=done)
        y = F.linear(x, self.weight)
        return PendingSum(y, self.bias, work=dist.all_reduce(y, group=self.group, async_op=True))

    def extra_repr(self) -> str:
        return f"in_features_local={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class PendingSum:
    """An all-reduce in flight (``RowParallelLinear.start``); ``wait()`` orders the current stream after it and
    returns the sum plus the bias."""

    def __init__(self, tensor: torch.Tensor, bias: torch.Tensor | None, event=None, work=None):
        self.tensor, self.bias, self.event, self.work = tensor, bias, event, work

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
        else:
            self.work.wait()
        return self.tensor + self.bias if self.bias is not None else self.tensor


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
    model: Cosmos3Transformer, tp_group: dist.ProcessGroup, all_reduce: str = "nccl"
) -> Cosmos3Transformer:
    """Shard ``model`` (a plain, fully loaded ``Cosmos3Transformer``) in place over ``tp_group`` and return it.

    Every rank of the group must call this on identical weights. Afterwards each rank holds 1/tp of the attention
    and MLP weights of both towers; ``encode_text`` and ``forward`` must then be called on every rank of the group
    with the same inputs, and return the same (replicated) outputs on all of them.
    """
    check_all_reduce(all_reduce, model.device)
    tp = dist.get_world_size(tp_group)
    rank = dist.get_rank(tp_group)
    check_tensor_parallel(model.config, tp)
    if tp == 1:
        return model
    for layer in cast("list[DecoderBlock]", list(model.text_layers) + list(model.gen_layers)):
        _shard_attention(layer.attn, tp, rank, tp_group, all_reduce)
        _shard_mlp(layer.mlp, tp, rank, tp_group, all_reduce)
    return model


def check_all_reduce(all_reduce: str, device: torch.device) -> None:
    if all_reduce not in ALL_REDUCES:
        raise InputError(f"all_reduce: expected one of {ALL_REDUCES}, got {all_reduce!r}")
    if all_reduce == "symm_mem" and torch.device(device).type != "cuda":
        raise InputError(f"all_reduce: 'symm_mem' needs the model on a CUDA device, it is on {device}")


@overload
def _rows(t: torch.Tensor, sizes: list[int], tp: int, rank: int) -> torch.Tensor: ...
@overload
def _rows(t: torch.Tensor | None, sizes: list[int], tp: int, rank: int) -> torch.Tensor | None: ...
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


def _shard_attention(attn: Attention, tp: int, rank: int, group: dist.ProcessGroup, all_reduce: str) -> None:
    # Query head h belongs to rank h // (H/tp) and uses KV head h // (H/KV); since H/tp = (H/KV) * (KV/tp) its KV
    # head is on the same rank, and local query head i uses local KV head i // (H/KV): GQA stays local.
    q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    sizes = [q_rows, kv_rows, kv_rows]
    _replace_linear(attn.qkv, _rows(attn.qkv.weight, sizes, tp, rank), _rows(attn.qkv.bias, sizes, tp, rank))
    attn.num_heads //= tp
    attn.num_kv_heads //= tp
    attn.out = RowParallelLinear(_columns(attn.out.weight, tp, rank), attn.out.bias, group, all_reduce)


def _shard_mlp(mlp: MLP, tp: int, rank: int, group: dist.ProcessGroup, all_reduce: str) -> None:
    # Fused [gate; up] rows become [gate_r; up_r] so that MLP.forward's chunk(2) still splits gate from up.
    sizes = [mlp.intermediate] * (2 if mlp.gated else 1)
    _replace_linear(mlp.gate_up, _rows(mlp.gate_up.weight, sizes, tp, rank), _rows(mlp.gate_up.bias, sizes, tp, rank))
    mlp.intermediate //= tp
    mlp.down = RowParallelLinear(_columns(mlp.down.weight, tp, rank), mlp.down.bias, group, all_reduce)
