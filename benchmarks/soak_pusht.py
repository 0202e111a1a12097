"""Soak: does a long PushT-v0 run keep its memory flat? Host RSS and GPU memory every ``--every`` env steps.

    python benchmarks/soak_pusht.py --envs 16 --steps 100000 --out $OUT        # one GPU (100k env steps)
    python benchmarks/soak_pusht.py --envs 64 --steps 100000 --out $OUT
    python benchmarks/soak_pusht.py --device cpu --envs 4 --steps 2000 --every 100   # CPU

An env step is one slot's step: ``--steps`` env steps are ``--steps / --envs`` vector steps, random actions, default
autoreset (episodes end at the PushT horizon or on success, so resets and their bookkeeping are exercised). Samples:
host RSS (``/proc/self/statm``), ``torch.cuda.memory_allocated`` / ``memory_reserved``, the engine's text-cache and
prompt-cache sizes and the number of CUDA graphs. The summary gives the growth from the sample at ``--from-step``
(default 1000: after warm-up, compiles and graph captures) to the last, in MB and percent (the issue's target:
< 1 %). Results JSON via benchmarks/common.py; progress on tqdm.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym.envs.pusht import make_pusht_vector_env  # noqa: E402


def host_rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def sample(env, env_steps: int, started: float) -> dict:
    engine = env.engine
    graphed = getattr(engine, "_graphed_forward", None)
    entry = {
        "env_steps": env_steps,
        "seconds": time.perf_counter() - started,
        "host_rss_mb": host_rss_mb(),
        "text_cache": len(getattr(engine, "_text_cache", ())),
        "prompt_cache": len(getattr(engine, "_prompt_ids", ())),
        "cuda_graphs": graphed.num_graphs if graphed is not None else 0,
    }
    if torch.cuda.is_available():
        entry["gpu_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
        entry["gpu_reserved_mb"] = torch.cuda.memory_reserved() / 2**20
    return entry


def growth(samples: list[dict], key: str, from_step: int) -> dict | None:
    if key not in samples[0]:
        return None
    start = next((s for s in samples if s["env_steps"] >= from_step), samples[0])
    end = samples[-1]
    delta = end[key] - start[key]
    # Host RSS swings by tens of MB as the allocator takes and returns the large temporaries of a step; a leak
    # raises the floor. So also: the lowest sample of the last quarter against the lowest of the first quarter.
    after = [s[key] for s in samples if s["env_steps"] >= start["env_steps"]]
    quarter = max(1, len(after) // 4)
    floor_delta = min(after[-quarter:]) - min(after[:quarter])
    return {"from_env_step": start["env_steps"], "to_env_step": end["env_steps"], "start_mb": start[key],
            "end_mb": end[key], "growth_mb": delta, "growth_percent": 100 * delta / start[key] if start[key] else None,
            "floor_growth_mb": floor_delta,
            "floor_growth_percent": 100 * floor_delta / min(after[:quarter]) if min(after[:quarter]) else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100_000, help="env steps (slot steps) in all")
    parser.add_argument("--every", type=int, default=500, help="sample memory every this many env steps")
    parser.add_argument("--from-step", type=int, default=1000, help="growth is measured from this env step")
    parser.add_argument("--optimize", type=int, default=1, help="0: the baseline path (optimize=False)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop early (results still written) after this long, e.g. to fit a time limit")
    parser.add_argument("--threads", type=int, default=None)
    add_output_arguments(parser)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    device = "cpu" if args.device == "cpu" else "gpu"
    name = args.name or f"soak_pusht_{device}_{args.envs}envs.json"
    check_results_target(name, args.out, args.overwrite)  # before measuring
    if args.threads:
        torch.set_num_threads(args.threads)

    env = make_pusht_vector_env(args.envs, device=args.device, optimize=bool(args.optimize))
    samples = []
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        started = time.perf_counter()
        samples.append(sample(env, 0, started))
        env_steps, next_sample = 0, args.every
        vector_steps = -(-args.steps // args.envs)
        for _ in tqdm(range(vector_steps), desc=f"soak {args.envs} envs", unit="step"):
            env.step(env.action_space.sample())
            env_steps += args.envs
            if env_steps >= next_sample:
                gc.collect()
                samples.append(sample(env, env_steps, started))
                next_sample += args.every
                if args.max_seconds is not None and samples[-1]["seconds"] > args.max_seconds:
                    break
    finally:
        env.close()
    results = {
        "provenance": provenance(),
        "settings": {**vars(args), "torch_threads": torch.get_num_threads()},
        "env_steps_per_s": env_steps / samples[-1]["seconds"] if samples[-1]["seconds"] else None,
        "growth": {key: growth(samples, key, args.from_step)
                   for key in ("host_rss_mb", "gpu_allocated_mb", "gpu_reserved_mb")},
        "samples": samples,
    }
    for key, value in results["growth"].items():
        if value is not None:
            print(f"{key}: {value['start_mb']:.1f} -> {value['end_mb']:.1f} MB from env step {value['from_env_step']} "
                  f"to {value['to_env_step']} ({value['growth_mb']:+.1f} MB; floor {value['floor_growth_mb']:+.1f} MB)")
    write_results(results, name, args.out)
    return results


if __name__ == "__main__":
    main()
