"""GPU smoke run: one bf16 request per mode on a tiny checkpoint, checked against the fp32 engine on the same card.

    python benchmarks/gpu_smoke.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_arguments, check_results_target, provenance, timed, write_results  # noqa: E402

from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request  # noqa: E402
from cosmos3_gym.testing import build_tiny_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    add_output_arguments(parser)
    args = parser.parse_args()
    check_results_target("gpu_smoke_tiny.json", args.out, args.overwrite)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ckpt = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    bf16 = Cosmos3Engine.from_pretrained(ckpt, device=device, dtype="bf16", progress=False)
    fp32 = Cosmos3Engine.from_pretrained(ckpt, device=device, dtype="fp32", progress=False)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
    actions = rng.uniform(-1, 1, (8, 2)).astype(np.float32)
    results = {"provenance": provenance(), "checkpoint": "tiny (random weights)", "modes": {}}
    for mode in ("policy", "forward_dynamics", "inverse_dynamics"):
        request = Cosmos3Request(
            mode=mode, observation=image if mode != "inverse_dynamics" else [image] * 9, task="push the block",
            action=actions if mode == "forward_dynamics" else None, domain="pusht", chunk=8, num_inference_steps=4,
            guidance_scale=3.0, seed=0, resolution_tier=256,
        )
        seconds, _ = timed(lambda: bf16.step(request, decode=True), repeats=3)
        low, high = bf16.step(request, decode=True), fp32.step(request, decode=True)
        finite = bool(np.isfinite(low.action).all() and torch.isfinite(low.pixels).all())
        results["modes"][mode] = {
            "seconds_with_decode": seconds,
            "finite": finite,
            "action_shape": list(low.action.shape),
            "pixels_shape": list(low.pixels.shape),
            "bf16_vs_fp32_latent_rel": float((low.video_latents - high.video_latents).norm()
                                             / high.video_latents.norm()),
            "bf16_vs_fp32_action_abs_max": float(np.abs(low.action - high.action).max()),
        }
        print(mode, results["modes"][mode])
    write_results(results, "gpu_smoke_tiny.json", args.out, args.overwrite)


if __name__ == "__main__":
    main()
