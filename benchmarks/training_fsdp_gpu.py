"""One training step of the FULL Cosmos3-Nano transformer (random weights): FSDP2 over N GPUs, or LoRA on one GPU.

    torchrun --nproc_per_node=2 benchmarks/training_fsdp_gpu.py --mode fsdp --out $OUT     # 2 GPUs, ~3 min
    python benchmarks/training_fsdp_gpu.py --mode lora --out $OUT                          # 1 GPU, ~2 min
    torchrun --nproc_per_node=2 benchmarks/training_fsdp_gpu.py --tiny --mode fsdp --out /tmp/x   # CPU, gloo
    python benchmarks/training_fsdp_gpu.py --tiny --mode lora --out /tmp/x                        # CPU

The step is the trainer's own (``FlowMatchingObjective``, ``set_trainable`` / ``apply_lora``,
``enable_gradient_checkpointing``, ``apply_fsdp``, ``build_optimizer``, ``training_step``) on a synthetic batch of
the engine's tier-480 shapes: a 480x832 canvas (latent 9x30x52 for chunk 32: 3510 video + 32 action tokens) and a
150-token prompt; each rank's batch holds one policy and one forward-dynamics sample (``--batch-size`` 2).

Modes and precisions (``--precision``):
  fsdp / bf16   weights, gradients and AdamW states in bf16, sharded over the N ranks (8 bytes per parameter / N);
  fsdp / mixed  float32 master weights and AdamW states, bf16 compute, fp32 gradient reduce-scatter (16 bytes per
                parameter / N): full-precision full fine-tuning; needs N >= 4 on 80 GB cards (the JSON records the
                estimate for N = 2, 4, 8 from the measured activation memory);
  lora          bf16 frozen base on one GPU, float32 rank-``--lora-rank`` adapters on the GEN tower, AdamW on them.
Activation checkpointing is per block (``--checkpointing full``, the default; ``selective`` keeps the matmul and
attention outputs; ``none``), and ``--compile`` compiles each block. The model is built on the meta device, sharded,
then materialised on the GPU (no full copy on any rank). Reports step time (median of ``--steps`` after one warm-up),
tokens/s (all ranks), peak memory per GPU, and MFU against the card's dense bf16 peak (matmul and attention FLOPs of
forward + backward, recomputation not counted). Writes
``training_fsdp_<mode>_world<N>[_bs<B>][_<checkpointing>_ac][_compiled].json`` through ``benchmarks/common.py``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from common import add_output_arguments, provenance, write_results  # noqa: E402

from cosmos3_gym.models.transformer import (  # noqa: E402
    Cosmos3RotaryEmbedding,
    Cosmos3Transformer,
    Cosmos3TransformerConfig,
    build_on_meta,
)
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG  # noqa: E402
from cosmos3_gym.training.distributed import init_distributed  # noqa: E402
from cosmos3_gym.training.flow_matching import (  # noqa: E402
    FORWARD_DYNAMICS,
    POLICY,
    FlowMatchingBatch,
    FlowMatchingObjective,
    sample_sigmas,
)
from cosmos3_gym.training.fsdp import apply_fsdp  # noqa: E402
from cosmos3_gym.training.lora import apply_lora  # noqa: E402
from cosmos3_gym.training.world_model import (  # noqa: E402
    WorldModelTrainConfig,
    build_optimizer,
    enable_gradient_checkpointing,
    set_trainable,
    training_step,
)

# Dense bf16 tensor-core peak per card (no sparsity), for MFU.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def model_config(tiny: bool) -> Cosmos3TransformerConfig:
    if tiny:
        return Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG, "vocab_size": 64})
    return Cosmos3TransformerConfig(action_gen=True, action_dim=64)  # Nano: diffusers' defaults


def build_transformer_on_meta(config: Cosmos3TransformerConfig, dtype: torch.dtype) -> Cosmos3Transformer:
    model = build_on_meta(Cosmos3Transformer, config, dtype=dtype)
    model.time_embedder.float()  # fp32, as diffusers keeps it
    return model


@torch.no_grad()
def materialise(module: torch.nn.Module, transformer: Cosmos3Transformer, device: torch.device) -> None:
    """Random N(0, 0.02) weights (norms 1) in place of the meta tensors, on ``device`` (sharded or not)."""
    module.to_empty(device=device)
    torch.manual_seed(0)  # the same on every rank: DTensor random ops draw each shard from one seeded stream
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02)
    transformer.rotary = Cosmos3RotaryEmbedding(transformer.config).to(device)  # buffers were left uninitialised


def synthetic_batch(config: Cosmos3TransformerConfig, args, device: torch.device, rank: int) -> FlowMatchingBatch:
    generator = torch.Generator().manual_seed(rank)
    b = args.batch_size
    latent_t = args.chunk // config.temporal_compression + 1
    shape = (b, config.latent_channel, latent_t, args.latent_h, args.latent_w)
    prompt = torch.randint(config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
    return FlowMatchingBatch(
        prompt_ids=[prompt] * b, fps=[15.0] * b, video=torch.randn(shape, generator=generator),
        actions=torch.rand(b, args.chunk, config.action_dim, generator=generator) * 2 - 1,
        raw_action_dims=torch.full((b,), 8), domain_ids=torch.full((b,), 8),
        modes=torch.tensor([POLICY, FORWARD_DYNAMICS] * b)[:b],
        sigmas=sample_sigmas(b, generator, shift=5.0), video_noise=torch.randn(shape, generator=generator),
        action_noise=torch.randn(b, args.chunk, config.action_dim, generator=generator),
    ).to(device)


def step_flops(config: Cosmos3TransformerConfig, args, lora: bool) -> tuple[float, int, int]:
    """(training FLOPs of one rank's batch, GEN tokens, text tokens per sample), 2 FLOPs per multiply-add of every
    block GEMM and attention product. Full fine-tuning: 3x the forward of both towers (forward, input and weight
    gradients). LoRA: 2x the GEN tower's forward (forward and input gradients; the frozen weights get no gradient,
    the adapters' FLOPs are negligible) and no text tower (its K/V are cached per prompt after the first step)."""
    latent_t = args.chunk // config.temporal_compression + 1
    p = config.latent_patch_size
    gen = latent_t * math.ceil(args.latent_h / p) * math.ceil(args.latent_w / p) + args.chunk
    text = args.prompt_tokens
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = 2 * (h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size)  # qkv, out, gated MLP
    layers = config.num_hidden_layers
    gen_fwd = layers * (gen * per_token + 4 * gen * (gen + text) * q)
    text_fwd = layers * (text * per_token + 4 * text * text * q / 2)  # causal: half the score matrix
    total = 2 * gen_fwd if lora else 3 * (gen_fwd + text_fwd)
    return args.batch_size * total, gen, text


def run(args) -> dict:
    ctx = init_distributed("cpu" if args.tiny else "cuda")
    device, world = ctx.device, ctx.world_size
    cuda = device.type == "cuda"
    config = model_config(args.tiny)
    lora = args.mode == "lora"
    if lora and world > 1:
        raise SystemExit("--mode lora runs on one GPU (launch without torchrun)")
    master_dtype = torch.float32 if (args.precision == "mixed" or not cuda) else torch.bfloat16
    precision = ("bf16" if lora else args.precision) if cuda else "float32 (CPU dry run)"
    result = {"mode": args.mode, "precision": precision, "world_size": world,
              "batch_size_per_rank": args.batch_size, "chunk": args.chunk, "tier": 480,
              "latent_hw": [args.latent_h, args.latent_w], "prompt_tokens": args.prompt_tokens, "tiny": args.tiny}
    started = time.perf_counter()
    transformer = build_transformer_on_meta(config, torch.bfloat16 if lora else master_dtype)
    result["parameters"] = sum(p.numel() for p in transformer.parameters())
    if lora:
        trainable = apply_lora(transformer, args.lora_rank, args.lora_rank * 2.0)
        result["lora_rank"] = args.lora_rank
    else:
        trainable = set_trainable(transformer, freeze_text_tower=False)
    if args.checkpointing != "none":
        enable_gradient_checkpointing(transformer, text_tower=not lora, policy=args.checkpointing)
    if args.compile:  # per block, inside the checkpoint wrapper and before sharding (torchtitan's order)
        transformer.compile_blocks()
    result["checkpointing"], result["compiled_blocks"] = args.checkpointing, args.compile
    objective = FlowMatchingObjective(transformer, freeze_text_tower=lora)
    if lora:
        materialise(objective, transformer, device)
        for name, param in transformer.named_parameters():  # PEFT's init: A random, B zero (step 0 = base model)
            if ".lora_A." in name:
                param.data = (torch.randn_like(param, dtype=torch.float32) / math.sqrt(param.shape[1]))
            elif ".lora_B." in name:
                param.data = torch.zeros_like(param, dtype=torch.float32)
    else:
        apply_fsdp(objective, device=device, bf16=True)
        materialise(objective, transformer, device)
    result["build_seconds"] = time.perf_counter() - started
    params = [p for p in transformer.parameters() if p.requires_grad]
    result["trainable_parameters"] = sum(p.numel() for p in params)
    result["trainable_names"] = len(trainable)
    train_config = WorldModelTrainConfig(lr=1e-5, param_dtype="float32" if master_dtype == torch.float32 else
                                         "bfloat16")
    batch = synthetic_batch(config, args, device, ctx.rank)
    autocast = cuda and (args.precision == "mixed" or lora)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    try:
        optimizer = build_optimizer(transformer, train_config)
        for _ in range(args.steps + 1):
            ctx.barrier()
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out, grad_norm = training_step(objective, batch, optimizer, params, 1.0, autocast=autocast)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            losses.append(float(out["loss"].detach()))
        result["status"] = "ok"
    except torch.cuda.OutOfMemoryError as error:
        result.update(status="out_of_memory", error=str(error).splitlines()[0][:400])
    step = statistics.median(times[1:]) if len(times) > 1 else None
    flops, gen_tokens, text_tokens = step_flops(config, args, lora)
    result.update(step_seconds=times, median_step_seconds=step, losses=losses, gen_tokens_per_sample=gen_tokens,
                  text_tokens_per_sample=text_tokens, flops_per_rank_step=flops)
    if step:
        result["tokens_per_second"] = world * args.batch_size * (gen_tokens + text_tokens) / step
    if cuda:
        peaks = torch.tensor([torch.cuda.max_memory_allocated(device) / 1e9], device=device)
        gathered = [torch.zeros_like(peaks) for _ in range(world)]
        if world > 1:
            torch.distributed.all_gather(gathered, peaks)
        else:
            gathered = [peaks]
        result["peak_memory_gb_per_gpu"] = [float(g) for g in gathered]
        result["total_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        if peak and step:
            result["mfu"] = flops / step / peak
            result["peak_bf16_flops"] = peak
        if not lora:
            # Full fine-tuning with fp32 master weights + AdamW (16 B / parameter sharded), plus what this run
            # needed beyond its own sharded states (activations, gathered blocks, buffers).
            states = (8 if master_dtype == torch.bfloat16 else 16) * result["parameters"] / world / 1e9
            beyond = max(result["peak_memory_gb_per_gpu"]) - states
            result["sharded_states_gb_per_gpu"] = states
            result["estimated_mixed_precision_gb_per_gpu"] = {
                n: 16 * result["parameters"] / n / 1e9 + beyond for n in (2, 4, 8)
            }
    ctx.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["fsdp", "lora"], default="fsdp")
    parser.add_argument("--precision", choices=["bf16", "mixed"], default="bf16", help="fsdp: see the docstring")
    add_output_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--batch-size", type=int, default=2, help="samples per rank (policy, forward dynamics, ...)")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--latent-h", type=int, default=30, help="content latent height (480x832 canvas: 30)")
    parser.add_argument("--latent-w", type=int, default=52, help="content latent width (480x832 canvas: 52)")
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--checkpointing", choices=["full", "selective", "none"], default="full",
                        help="activation checkpointing per block: everything recomputed, all but the matmul and "
                             "attention outputs, or none")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (compile_blocks)")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: the tiny config, gloo, small shapes")
    args = parser.parse_args()
    if args.tiny:
        args.chunk, args.latent_h, args.latent_w, args.prompt_tokens, args.steps = 4, 4, 4, 8, 2
    elif not torch.cuda.is_available():
        parser.error("needs CUDA GPUs (or --tiny for the CPU dry run)")
    result = run(args)
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        result["provenance"] = provenance()
        suffix = "" if args.batch_size == 2 else f"_bs{args.batch_size}"
        suffix += "" if args.checkpointing == "full" else f"_{args.checkpointing}_ac"
        suffix += ("_compiled" if args.compile else "") + ("_tiny" if args.tiny else "")
        name = f"training_fsdp_{args.mode}{'' if args.mode == 'lora' else '_' + args.precision}" \
               f"_world{result['world_size']}{suffix}.json"
        write_results(result, name, args.out, args.overwrite)
        print({k: v for k, v in result.items() if k not in ("provenance", "losses")}, flush=True)


if __name__ == "__main__":
    main()
