"""Shared pieces of the benchmarks: provenance, timing, and the full-size Cosmos3-Nano / Wan2.2 models with random
weights (speed does not depend on weight values; see shared/reference/performance.md §8)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cosmos3_gym.models.vae import WAN22_FIXED_CONFIG

NANO_TRANSFORMER = dict(action_gen=True, action_dim=64)  # every other field at diffusers' (= Nano's) default
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json (the Cosmos3 VAE).
WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    **WAN22_FIXED_CONFIG,
)
SCHEDULER = dict(
    num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
    solver_order=2, solver_type="bh2", final_sigmas_type="zero", use_karras_sigmas=False,
)


def provenance(command: list[str] | None = None) -> dict:
    """Card, commit and command: every results JSON carries them."""
    # COSMOS3_GYM_COMMIT names the commit of a source snapshot that has no .git of its own (a git repository around
    # the snapshot would report its own, unrelated HEAD).
    commit = os.environ.get("COSMOS3_GYM_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or 'x86'})"
    return {
        "card": card,
        "num_gpus": torch.cuda.device_count(),
        "commit": commit,
        "command": " ".join(command or sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time (s) of ``fn()`` with device synchronisation, after warm-up; also the raw times."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def gemm_peak_tflops(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    median, _ = timed(lambda: a @ b, repeats=repeats, warmup=3)
    return 2 * n**3 / median / 1e12


@torch.no_grad()
def fill_random_(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights (norm scales near 1) so activations stay finite through 36 layers."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        values = torch.randn(p.shape, generator=g, dtype=torch.float32) if p.numel() < 2**20 else None
        if values is None:  # large tensors: draw on the device (CPU RNG for 15 B values would take minutes)
            p.normal_(0.0, std)
        else:
            p.copy_(values.to(p.device, p.dtype) * std)
        if "norm" in name:
            p.add_(1.0)


def build_nano_transformer(device: str = "cuda", dtype=torch.bfloat16, **overrides):
    """diffusers' Cosmos3OmniTransformer at the full Nano config (15.2 B parameters), random weights."""
    from diffusers import Cosmos3OmniTransformer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Cosmos3OmniTransformer(**{**NANO_TRANSFORMER, **overrides})
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    torch.manual_seed(0)
    fill_random_(model)
    model.time_embedder.float()
    # Buffers were created on meta; rebuild the rotary table on the device.
    model.rotary_emb.inv_freq = 1.0 / (
        model.config.rope_theta
        ** (torch.arange(0, model.config.head_dim, 2, dtype=torch.float32, device=device) / model.config.head_dim)
    )
    return model.eval()


def build_wan22_vae(device: str = "cuda", dtype=torch.float32):
    from diffusers import AutoencoderKLWan

    g = torch.Generator().manual_seed(0)
    stats = dict(latents_mean=(0.1 * torch.randn(48, generator=g)).tolist(),
                 latents_std=(0.5 + torch.rand(48, generator=g)).tolist())
    torch.manual_seed(0)
    return AutoencoderKLWan(**WAN22_VAE, **stats).to(device=device, dtype=dtype).eval()


def results_dir(out_dir: str | None = None) -> Path:
    """The folder results are written to: ``out_dir``, else ``$OUT``, else benchmarks/results (created)."""
    out = Path(out_dir or os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_results(results: dict, name: str, out_dir: str | None = None) -> Path:
    path = results_dir(out_dir) / name
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {path}")
    return path
