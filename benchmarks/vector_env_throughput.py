"""Vector-env throughput: env steps/s and actions/s of ``WorldModelVectorEnv`` at 1, 4 and 16 envs against
stepping the same number of single ``WorldModelEnv``s one at a time on the same engine, in the same run.

    python benchmarks/vector_env_throughput.py                                   # CPU, tiny checkpoint
    python benchmarks/vector_env_throughput.py --full-nano --out $OUT            # GPU, Cosmos3-Nano, random weights

One env step = one action chunk through forward dynamics, VAE decode included (the env always decodes: its
observation is the chunk's last frame). Each timing is the median of ``--repeats`` steps after one warm-up step.
``--full-nano`` builds the full Nano transformer and the Wan2.2 VAE with random weights (speed does not depend on
weight values) through benchmarks/gpu_suite.py's ``make_models`` and runs tier 256, chunk 32, 4 denoising steps,
guidance 3, like gpu_suite's env-throughput table. The results JSON (with provenance) goes to
benchmarks/results/ (or ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_arguments, provenance, timed, write_results  # noqa: E402

from cosmos3_gym.engine import Cosmos3Engine  # noqa: E402
from cosmos3_gym.envs import WorldModelEnv, WorldModelVectorEnv  # noqa: E402
from cosmos3_gym.testing import cached_tiny_checkpoint  # noqa: E402

TASK = "pick up the cup and put it in the bowl"


def build_engine(args: argparse.Namespace) -> Cosmos3Engine:
    if not args.full_nano:
        return Cosmos3Engine.from_pretrained(args.checkpoint or cached_tiny_checkpoint(), device=args.device,
                                             dtype=args.dtype, progress=False)
    from gpu_suite import make_models

    pipe, engine, _ = make_models(tiny=False, device=args.device or "cuda")
    del pipe  # the diffusers reference is not needed here; free its weights
    gc.collect()
    torch.cuda.empty_cache()
    return engine


def scene(seed: int, size: tuple[int, int] = (256, 256)) -> np.ndarray:
    """A smooth synthetic frame (one per env, so the envs do not all see the same image)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : size[0], 0 : size[1]] / max(size)
    frame = np.stack([np.sin(6 * x + rng.uniform(0, 6)), np.cos(5 * y + rng.uniform(0, 6)), x * y], -1)
    return ((frame - frame.min()) / (frame.max() - frame.min()) * 255).astype(np.uint8)


def peak_memory_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def measure(engine: Cosmos3Engine, num_envs: int, args: argparse.Namespace) -> dict:
    settings = dict(engine=engine, domain=args.domain, task=TASK, chunk=args.chunk, num_steps=args.num_steps,
                    guidance_scale=args.guidance_scale, resolution_tier=args.resolution_tier)
    states = [scene(i) for i in range(num_envs)]
    rng = np.random.default_rng(0)

    vector_env = WorldModelVectorEnv(num_envs, initial_states=states, **settings)
    vector_env.reset(seed=0, options={"initial_state_index": list(range(num_envs))})
    actions = rng.uniform(-1, 1, vector_env.action_space.shape).astype(np.float32)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    vector_s, _ = timed(lambda: vector_env.step(actions), repeats=args.repeats)
    vector_memory = peak_memory_gb()
    vector_env.close()

    single_envs = [WorldModelEnv(initial_states=states, **settings) for _ in range(num_envs)]
    for index, env in enumerate(single_envs):
        env.reset(seed=index, options={"initial_state_index": index})
    sequential_s, _ = timed(lambda: [env.step(action) for env, action in zip(single_envs, actions)],
                            repeats=args.repeats)
    for env in single_envs:
        env.close()

    def rates(seconds: float) -> dict:
        return {"step_s": seconds, "env_steps_per_s": num_envs / seconds,
                "actions_per_s": num_envs * args.chunk / seconds}

    return {
        "vector_env": {**rates(vector_s), "peak_memory_gb": vector_memory},
        "one_env_at_a_time": rates(sequential_s),
        "speedup": sequential_s / vector_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="default: the tiny random-weight checkpoint (cached)")
    parser.add_argument("--full-nano", action="store_true", help="full Cosmos3-Nano with random weights (GPU)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (checkpoint runs; Nano runs in bf16)")
    parser.add_argument("--env-counts", default="1,4,16")
    parser.add_argument("--domain", default="droid_lerobot")
    parser.add_argument("--chunk", type=int, default=None, help="default: 32 with --full-nano, else 8")
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--guidance-scale", type=float, default=3.0)
    parser.add_argument("--resolution-tier", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--name", default=None, help="results file name (default: from device and model)")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.chunk is None:
        args.chunk = 32 if args.full_nano else 8
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = build_engine(args)
    results: dict = {
        "provenance": provenance(),
        "settings": {
            "model": "cosmos3-nano (random weights)" if args.full_nano else str(args.checkpoint or "tiny (cached)"),
            "device": str(engine.device), "dtype": str(engine.transformer.dtype), "domain": args.domain,
            "chunk": args.chunk, "num_steps": args.num_steps, "guidance_scale": args.guidance_scale,
            "resolution_tier": args.resolution_tier, "image_size": [256, 256], "decode": True,
            "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        },
    }
    for num_envs in [int(n) for n in args.env_counts.split(",")]:
        try:
            results[f"envs_{num_envs}"] = entry = measure(engine, num_envs, args)
        except torch.OutOfMemoryError as error:
            results[f"envs_{num_envs}"] = {"error": f"OOM: {error}"[:200]}
            torch.cuda.empty_cache()
            continue
        print(f"{num_envs:3d} envs: vector {entry['vector_env']['env_steps_per_s']:.3f} env steps/s "
              f"({entry['vector_env']['actions_per_s']:.1f} actions/s), one at a time "
              f"{entry['one_env_at_a_time']['env_steps_per_s']:.3f} env steps/s, speedup {entry['speedup']:.2f}x")
    name = args.name or f"vector_env_throughput_{engine.device.type}_{'nano' if args.full_nano else 'tiny'}.json"
    write_results(results, name, args.out, args.overwrite, args=args)


if __name__ == "__main__":
    main()
