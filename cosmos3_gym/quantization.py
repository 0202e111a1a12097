"""FP8 GEMMs for the GEN tower: a plan applied to a plain, loaded ``Cosmos3Transformer`` (torchtitan style).

``apply_fp8(transformer, layers=...)`` swaps the weights of the chosen GEN-layer ``nn.Linear``s for torchao float8
tensors (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` through ``quantize_``): weights are
quantized once, per output row; every call quantizes its activations per token (dynamic rowwise scaling) and runs
one ``torch._scaled_mm`` on Hopper's FP8 tensor cores, with the output in bf16. ``torch.compile`` (``compile_blocks``)
fuses the activation quantization into the surrounding kernels; without compile it costs more than it saves
(torchao reports no gain eager), so apply it before ``Cosmos3Engine.optimize`` (compile, CUDA-graph capture).

Which layers stay bf16 is a named policy (``FP8_LAYER_POLICIES``), chosen by ``benchmarks/fp8_gpu.py``'s speed and
error tables. Never FP8, whatever the policy: the UND (text) tower, which runs once per prompt and whose K/V every
GEN layer attends to; ``proj_in`` / ``proj_out`` (video patch embedding and velocity head), the fp32 time embedder,
the action heads (``DomainAwareLinear``, per-domain embedding tables, not GEMMs) and all norms: the layers serving
stacks keep in bf16, they are a negligible share of the FLOPs. The fused q/k/v projection is one GEMM, so keeping
Q/K in bf16 (vLLM-Omni's best trade-off for Cosmos3) keeps V with them.

FP8 needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper and later) and torchao (the ``fp8`` extra).
Under tensor parallelism the plan quantizes the shards: the column-parallel ``attn.qkv`` / ``mlp.gate_up`` are plain
``nn.Linear``s, and ``RowParallelLinear`` (``attn.out`` / ``mlp.down``) multiplies through ``F.linear`` before its
NCCL all-reduce, which takes a float8 weight too (each rank scales its slice of the input features on its own). Its
symmetric-memory all-reduce (``torch.mm`` into the shared buffer) cannot, so the parallel plan keeps NCCL for FP8
weights and compiles the blocks whole instead of overlapping the all-reduces (``parallel/plan.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn

from .errors import InputError
from .models.transformer import Cosmos3Transformer
from .parallel.tensor_parallel import RowParallelLinear

PRECISIONS = ("bf16", "fp8")

# The four GEMMs of a GEN layer, by their name inside the block.
GEN_LINEARS = ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")


@dataclass(frozen=True)
class Fp8LayerPolicy:
    """Which of a GEN layer's four GEMMs run in FP8: ``selects(layer_index, num_layers, linear_name)``."""

    description: str
    selects: Callable[[int, int, str], bool]


def _is_edge(index: int, num_layers: int) -> bool:
    return index in (0, num_layers - 1)


FP8_LAYER_POLICIES: dict[str, Fp8LayerPolicy] = {
    "all": Fp8LayerPolicy("every GEN-layer GEMM (qkv, out, gate_up, down) of every GEN layer", lambda i, n, name: True),
    "keep_qkv": Fp8LayerPolicy(
        "as 'all' but the fused q/k/v projection stays bf16 (Q/K precision)", lambda i, n, name: name != "attn.qkv"
    ),
    "keep_edges": Fp8LayerPolicy(
        "as 'all' but the first and last GEN layers stay bf16", lambda i, n, name: not _is_edge(i, n)
    ),
    "keep_qkv_edges": Fp8LayerPolicy(
        "'keep_qkv' and the first and last GEN layers stay bf16",
        lambda i, n, name: name != "attn.qkv" and not _is_edge(i, n),
    ),
    "mlp_only": Fp8LayerPolicy(
        "only the MLP GEMMs (gate_up, down; ~78% of a GEN layer's GEMM FLOPs)",
        lambda i, n, name: name.startswith("mlp."),
    ),
}

# The policy ``precision="fp8"`` uses, chosen by measurement (benchmarks/RESULTS.md, issue 23): every GEN GEMM in FP8
# is the fastest (GEN forward 1.49x / 1.44x over compiled bf16 at tier 480, batch 1 / 16, where keeping Q/K in bf16,
# vLLM-Omni's choice for Cosmos3-Nano, gives 1.40x / 1.36x), and on trained weights (the built-in model's fidelity
# targets, same run as bf16) no metric moved beyond its 95% interval.
DEFAULT_FP8_LAYERS = "all"


def fp8_linear_names(transformer: Cosmos3Transformer, layers: str = DEFAULT_FP8_LAYERS) -> list[str]:
    """The module names (``gen_layers.{i}.attn.qkv``, ...) that ``apply_fp8(transformer, layers)`` quantizes, in
    module order. Pure: reads the module tree only, runs anywhere (CPU, meta)."""
    policy = _policy(layers)
    num_layers = len(transformer.gen_layers)
    names = []
    for i, block in enumerate(transformer.gen_layers):
        for name in GEN_LINEARS:
            module = block.get_submodule(name)
            # Sharded, the local shapes count. torch._scaled_mm needs both dimensions multiples of 16; torchao would
            # silently keep others in bf16.
            out_features, in_features = cast(torch.Tensor, module.weight).shape  # Module.__getattr__: Tensor | Module
            fits = type(module) in (nn.Linear, RowParallelLinear) and in_features % 16 == 0 and out_features % 16 == 0
            if fits and policy.selects(i, num_layers, name):
                names.append(f"gen_layers.{i}.{name}")
    return names


def check_fp8_supported(device: torch.device | str) -> None:
    """Raise ``InputError`` unless FP8 GEMMs can run on ``device``: a CUDA GPU of compute capability >= 8.9 with
    torchao installed."""
    device = torch.device(device)
    if device.type != "cuda":
        raise InputError(
            f"precision: 'fp8' needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or "
            f"later); this model is on {device}. Use precision='bf16'."
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise InputError(
            f"precision: 'fp8' needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or later); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}. Use precision='bf16'."
        )
    try:
        import torchao  # noqa: F401
    except ImportError as error:
        raise InputError("precision: 'fp8' needs torchao (pip install 'cosmos3_gym[fp8]', torchao>=0.18)") from error


def apply_fp8(transformer: Cosmos3Transformer, layers: str = DEFAULT_FP8_LAYERS) -> Cosmos3Transformer:
    """Quantize the GEN-layer GEMMs that policy ``layers`` selects (``FP8_LAYER_POLICIES``) to FP8, in place, and
    return ``transformer``. Call it on the loaded bf16 model before ``compile_blocks`` / ``Cosmos3Engine.optimize``
    (compile and CUDA graphs then capture the FP8 GEMMs). On a tensor-parallel model it quantizes this rank's
    shards. Inference only (the weights no longer train)."""
    names = fp8_linear_names(transformer, layers)  # validates the policy name first, on any device
    if any(
        isinstance(module, RowParallelLinear) and module.all_reduce == "symm_mem"
        for module in transformer.gen_layers.modules()
    ):
        raise InputError(
            "precision: the row-parallel layers already use the symmetric-memory all-reduce, which "
            "multiplies plain weights only; apply FP8 before optimize() (the plan then keeps NCCL)"
        )
    check_fp8_supported(transformer.device)
    if transformer.blocks_compiled:
        raise InputError("precision: apply FP8 before compile_blocks / Cosmos3Engine.optimize, not after")
    if transformer.dtype != torch.bfloat16:
        raise InputError(
            f"precision: 'fp8' needs the transformer loaded in bf16 (dtype='bf16'), it is {transformer.dtype}"
        )
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    # set_inductor_config=False: torchao would otherwise switch on inductor's coordinate-descent tuning process-wide,
    # which multiplies compile time and changes the bf16 kernels too (the benchmark compares like with like).
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    selected = set(names)
    quantize_(transformer, config, filter_fn=lambda module, fqn: fqn in selected)
    return transformer


def apply_precision(transformer: Cosmos3Transformer, precision: str) -> Cosmos3Transformer:
    """The ``precision`` argument of ``Cosmos3Engine.from_pretrained``: "bf16" leaves the GEMMs in the model dtype,
    "fp8" applies ``apply_fp8`` with ``DEFAULT_FP8_LAYERS``."""
    check_precision(precision)
    if precision == "fp8":
        apply_fp8(transformer, DEFAULT_FP8_LAYERS)
    return transformer


def check_precision(precision: str) -> None:
    """Raise ``InputError`` for an unknown ``precision`` (cheap: call it before loading weights)."""
    if precision not in PRECISIONS:
        raise InputError(f"precision: expected one of {list(PRECISIONS)}, got {precision!r}")


def _policy(layers: str) -> Fp8LayerPolicy:
    if layers not in FP8_LAYER_POLICIES:
        raise InputError(f"layers: expected an FP8 layer policy, one of {list(FP8_LAYER_POLICIES)}, got {layers!r}")
    return FP8_LAYER_POLICIES[layers]
