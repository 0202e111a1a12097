"""One training step of the FULL Cosmos3-Nano transformer (random weights) on one GPU: time and peak memory.

    python -m cosmos3_gym.training.nano_step --out DIR [--plans adamw,adamw-frozen-und,sgd] [--steps 3]

Runs the trainer's own pieces (``FlowMatchingObjective``, ``set_trainable``, ``enable_gradient_checkpointing``,
``build_optimizer``, ``training_step``) on a synthetic batch of the engine's policy shape: a 480x832 canvas at tier
480 (latent 9x30x52 for chunk 32: 3510 video + 32 action tokens) and a 150-token prompt.

Memory: Nano has 14.55 B parameters here (the unused LM head is not built). Weights are bf16 (29 GB); fp32 master
weights would not fit with AdamW on one 80 GB card. Each plan is tried in turn on the same model, and a plan that
runs out of memory is recorded as such (measured peaks, torch 2.11, batch 1, gradient checkpointing):
  adamw             every trained parameter (14.38 B), AdamW with bf16 states: weights + grads + 2 states = 4 x 29 GB;
                    peak 115.6 GB, 0.9-1.1 s/step on an H200; out of memory on an H100 80 GB;
  adamw-frozen-und  the UND (text) tower and embeddings frozen, AdamW on the GEN tower (6.98 B): peak 72.0 GB,
                    0.61 s/step on an H100 (0.59 s on an H200);
  sgd               every trained parameter, plain SGD (no optimizer state): peak 58.0 GB, 0.80 s/step (H100).
Activations are kept small by gradient checkpointing over the layers (on by default). Writes DIR/nano_step.json.
DDP keeps a full replica per GPU, which fits Nano only in the frozen-UND / SGD forms above; full AdamW fine-tuning
shards weights, gradients and AdamW states over GPUs (``WorldModelTrainConfig(data_parallel="fsdp")``, fsdp.py) or
trains LoRA adapters (``lora_rank``); ``benchmarks/training_fsdp_gpu.py`` measures both.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from ..models.transformer import Cosmos3RotaryEmbedding, Cosmos3Transformer, Cosmos3TransformerConfig, build_on_meta
from .flow_matching import POLICY, FlowMatchingBatch, FlowMatchingObjective, sample_sigmas
from .world_model import (
    WorldModelTrainConfig,
    build_optimizer,
    enable_gradient_checkpointing,
    set_trainable,
    training_step,
)

PLANS = ("adamw", "adamw-frozen-und", "sgd")


def build_random_nano(device: torch.device) -> Cosmos3Transformer:
    """The Nano config (diffusers' Cosmos3OmniTransformer defaults, action_gen) with N(0, 0.02) bf16 weights,
    built on the meta device and materialised on ``device`` (no fp32 copy, no CPU init)."""
    config = Cosmos3TransformerConfig(action_gen=True, action_dim=64)
    model = build_on_meta(Cosmos3Transformer, config, dtype=torch.bfloat16).to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.time_embedder.float()  # kept in fp32, as diffusers does
    model.rotary = Cosmos3RotaryEmbedding(config).to(device)  # its buffers were left uninitialised by to_empty
    return model


def synthetic_batch(model: Cosmos3Transformer, args, device: torch.device) -> FlowMatchingBatch:
    c = model.config
    action_dim = c.action_dim
    assert action_dim is not None  # a policy model (action_gen)
    generator = torch.Generator().manual_seed(0)
    latent_t = args.chunk // c.temporal_compression + 1
    shape = (args.batch_size, c.latent_channel, latent_t, args.latent_h, args.latent_w)
    prompt = torch.randint(c.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
    b = args.batch_size
    return FlowMatchingBatch(
        prompt_ids=[prompt] * b,
        fps=[15.0] * b,
        video=torch.randn(shape, generator=generator),
        actions=torch.rand(b, args.chunk, action_dim) * 2 - 1,
        raw_action_dims=torch.full((b,), 8),
        domain_ids=torch.full((b,), 8),
        modes=torch.full((b,), POLICY),
        sigmas=sample_sigmas(b, generator, shift=5.0),
        video_noise=torch.randn(shape, generator=generator),
        action_noise=torch.randn(b, args.chunk, action_dim, generator=generator),
    ).to(device)


def run_plan(model: Cosmos3Transformer, plan: str, batch: FlowMatchingBatch, steps: int, device) -> dict:
    freeze_und = plan == "adamw-frozen-und"
    config = WorldModelTrainConfig(lr=1e-5, param_dtype="bfloat16", freeze_text_tower=freeze_und, bf16=False)
    trainable = set_trainable(model, freeze_text_tower=freeze_und)
    params = [p for p in model.parameters() if p.requires_grad]
    objective = FlowMatchingObjective(model, freeze_text_tower=freeze_und)
    result = {
        "plan": plan,
        "trainable_parameters": sum(p.numel() for p in params),
        "optimizer": "SGD (no momentum)" if plan == "sgd" else "AdamW (fused, bf16 states)",
    }
    optimizer: torch.optim.Optimizer | None = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        if plan == "sgd":
            optimizer = torch.optim.SGD(params, lr=config.lr, foreach=False)
        else:
            optimizer = build_optimizer(model, config)
        times, losses = [], []
        for _ in range(steps):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            out, grad_norm = training_step(objective, batch, optimizer, params, config.grad_clip, autocast=False)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            losses.append(out["loss"].detach().item())
        result.update(status="ok", step_seconds=times, losses=losses, grad_norm=grad_norm.item())
    except torch.cuda.OutOfMemoryError as error:
        result.update(status="out_of_memory", error=str(error).splitlines()[0][:400])
    result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    result["num_trained_names"] = len(trainable)
    del optimizer
    for p in model.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for nano_step.json")
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, from {list(PLANS)}")
    parser.add_argument("--steps", type=int, default=3, help="steps per plan (the first includes warm-up)")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--latent-h", type=int, default=30, help="content latent height (480x832 canvas: 30)")
    parser.add_argument("--latent-w", type=int, default=52, help="content latent width (480x832 canvas: 52)")
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    plans = [p for p in args.plans.split(",") if p]
    unknown = sorted(set(plans) - set(PLANS))
    if unknown:
        parser.error(f"--plans: unknown {unknown}; expected some of {list(PLANS)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    model = build_random_nano(device)
    build_seconds = time.perf_counter() - start
    if not args.no_gradient_checkpointing:
        enable_gradient_checkpointing(model)
    batch = synthetic_batch(model, args, device)
    c = model.config
    latent_t = args.chunk // c.temporal_compression + 1
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "total_memory_gb": torch.cuda.get_device_properties(device).total_memory / 1e9,
        "parameters": sum(p.numel() for p in model.parameters()),
        "param_dtype": "bfloat16",
        "build_seconds": build_seconds,
        "gradient_checkpointing": not args.no_gradient_checkpointing,
        "batch_size": args.batch_size,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": latent_t * -(-args.latent_h // 2) * -(-args.latent_w // 2) + args.chunk,
        "weights_memory_gb": torch.cuda.memory_allocated(device) / 1e9,
        "plans": [],
    }
    for plan in plans:
        report["plans"].append(run_plan(model, plan, batch, args.steps, device))
        (out / "nano_step.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report["plans"][-1]), flush=True)
    (out / "nano_step.json").write_text(json.dumps(report, indent=2))
    return 0 if any(p["status"] == "ok" for p in report["plans"]) else 1


if __name__ == "__main__":
    sys.exit(main())
