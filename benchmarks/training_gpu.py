"""GPU smoke benchmark of the training code: VAE + world model with the default (PushT-sized) configs on a small
synthetic dataset, then the exported checkpoint in the engine (all three modes, timed by ``common.timed``). Writes
training_gpu.json to ``--out DIR``.

    python benchmarks/training_gpu.py --out $OUT [--vae-steps 300] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]
from common import add_output_arguments, check_results_target, provenance, timed, write_results  # noqa: E402
from test_training import make_dataset  # noqa: E402

from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request  # noqa: E402
from cosmos3_gym.training import VAETrainConfig, WorldModelTrainConfig, train_vae, train_world_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    add_output_arguments(parser)
    parser.add_argument("--work", default="/tmp/training_gpu")
    parser.add_argument("--vae-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    check_results_target("training_gpu.json", args.out, args.overwrite)
    work = Path(args.work)
    dataset = work / "dataset"
    if not dataset.exists():
        make_dataset(dataset, num_episodes=8, steps=64, size=96)
    report = {"provenance": provenance()}

    start = time.perf_counter()
    vae_dir = train_vae(dataset, work / "vae", VAETrainConfig(steps=args.vae_steps, batch_size=16, frames_per_clip=9,
                                                              log_every=50, progress=False))
    report["vae_seconds"] = time.perf_counter() - start
    report["vae_log"] = [json.loads(line) for line in (vae_dir / "train_log.jsonl").read_text().splitlines()]

    start = time.perf_counter()
    config = WorldModelTrainConfig(steps=args.steps, chunk=args.chunk, batch_size=args.batch_size, log_every=50,
                                   save_every=100, save_dtype="float16", progress=False)
    checkpoint = train_world_model(dataset, work / "checkpoint", config, vae_dir)
    report["world_model_seconds"] = time.perf_counter() - start
    log = (checkpoint / "training" / "log.jsonl").read_text().splitlines()
    report["world_model_log"] = [json.loads(line) for line in log]
    report["checkpoint_bytes"] = {
        str(p.relative_to(checkpoint)): p.stat().st_size for p in checkpoint.rglob("*")
        if p.is_file() and "training" not in p.parts
    }

    engine = Cosmos3Engine.from_pretrained(checkpoint, progress=False)
    frames = np.load(dataset / "episodes" / "episode_000000.npz")["frames"]
    report["engine"] = {}
    for mode in ("policy", "forward_dynamics", "inverse_dynamics"):
        request = Cosmos3Request(
            mode=mode, observation=frames[: args.chunk + 1] if mode == "inverse_dynamics" else frames[0],
            task="move the red square", domain="pusht", chunk=args.chunk, resolution_tier=256, fps=10.0, seed=0,
            action=np.zeros((args.chunk, 2), np.float32) if mode == "forward_dynamics" else None,
        )
        seconds, _, result = timed(lambda: engine.step(request), repeats=1, warmup=1, keep_output=True)
        report["engine"][mode] = {"seconds": seconds, "action_shape": list(result.action.shape),
                                  "pixels_shape": list(result.pixels.shape)}
    write_results(report, "training_gpu.json", args.out, args.overwrite)
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_log")}, indent=1))


if __name__ == "__main__":
    main()
