"""PushT-v0 over whole episodes: env steps/s with every reset and autoreset in, against baseline trees in the same run.

    python benchmarks/pusht_env_episodes.py --envs 64,256 --baseline /tmp/base --out $OUT      # one GPU, ~4 min
    python benchmarks/pusht_env_episodes.py --device cpu --envs 2 --episodes 1 --max-episode-steps 2   # CPU smoke

Each variant (this tree, then each ``--baseline`` tree, e.g. ``git worktree add /tmp/base <commit>``) runs in a
process of its own that imports ``cosmos3_gym`` from that tree, in turn, ``--rounds`` times, so that load changes
hit all alike. Per env count: ``gym.make_vec("cosmos3_gym/PushT-v0")``'s entry point with the model's own settings
(reward model, success threshold, 38-chunk episodes, NEXT_STEP autoreset), ``--warmup-episodes`` untimed (compiles,
graph captures), then ``reset(seed)`` and uniform random actions (seeded, drawn before the clock starts) until
``--episodes`` episodes per slot have ended. Reported: ``env_steps_per_s`` (num_envs x vector steps per second,
Gymnasium's count, the restart steps included), ``stepped_per_s`` (slot steps that ran the model: the stricter
count), seconds, GPU memory; ``speedup`` against each baseline (medians over rounds). ``--cprofile`` also writes a
pstats listing of this tree's timed episodes per env count (the profile's overhead is not in the rates).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_episodes(num_envs: int, args) -> dict:
    """This process's measurement at one env count (``cosmos3_gym`` from the tree on ``sys.path[0]``)."""
    import numpy as np
    import torch

    from cosmos3_gym.tasks.pusht.env import make_pusht_vector_env

    settings = {} if args.max_episode_steps is None else {"max_episode_steps": args.max_episode_steps}
    env = make_pusht_vector_env(num_envs, device=args.device, **settings)
    rng = np.random.default_rng(args.seed)

    def episodes(count: int, seed: int) -> tuple[int, int, int]:
        env.reset(seed=seed)
        ended = stepped = vector_steps = 0
        while ended < count * num_envs:
            _, _, terminated, truncated, info = env.step(actions[vector_steps % len(actions)])
            ended += int((terminated | truncated).sum())
            stepped += int((~info["waiting"]).sum())
            vector_steps += 1
        return vector_steps, stepped, ended

    try:
        horizon = env.settings.max_episode_steps or 38
        shape = (horizon + 1, *env.action_space.shape)
        actions = rng.uniform(-1, 1, shape).astype(np.float32)
        if args.warmup_episodes:
            episodes(args.warmup_episodes, args.seed + 1)
        profiler = None
        if args.cprofile_to:
            import cProfile

            profiler = cProfile.Profile()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        vector_steps, stepped, ended = episodes(args.episodes, args.seed)
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - started
        entry = {
            "num_envs": num_envs,
            "episodes_ended": ended,
            "vector_steps": vector_steps,
            "env_steps": vector_steps * num_envs,
            "stepped": stepped,
            "seconds": seconds,
            "env_steps_per_s": vector_steps * num_envs / seconds,
            "stepped_per_s": stepped / seconds,
        }
        if torch.cuda.is_available():
            entry["gpu_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        if profiler is not None:
            import io
            import pstats

            listing = io.StringIO()
            stats = pstats.Stats(profiler, stream=listing)
            stats.sort_stats("tottime").print_stats(60)
            stats.sort_stats("cumulative").print_stats(60)
            Path(f"{args.cprofile_to}_{num_envs}envs.txt").write_text(listing.getvalue())
        return entry
    finally:
        env.close()


def worker(args) -> None:
    sys.path.insert(0, args.root)  # cosmos3_gym from the variant's tree
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    entries = {str(n): run_episodes(n, args) for n in args.env_counts}
    Path(args.json).write_text(json.dumps(entries))


def variant_commit(root: Path) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--envs", default="64,256", help="comma-separated env counts")
    parser.add_argument("--episodes", type=int, default=3, help="timed episodes per slot")
    parser.add_argument("--warmup-episodes", type=int, default=1)
    parser.add_argument("--max-episode-steps", type=int, default=None, help="default: the model's (38 chunks)")
    parser.add_argument("--baseline", action="append", default=[], help="a tree to compare with (repeatable)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--cprofile", action="store_true", help="also profile this tree's timed episodes")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--name", default="pusht_env_episodes.json")
    parser.add_argument("--overwrite", action="store_true")
    # the worker process
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--cprofile-to", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.env_counts = [int(n) for n in args.envs.split(",")]
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        worker(args)
        return {}

    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from common import check_results_target, provenance, write_results  # noqa: E402

    check_results_target(args.name, args.out, args.overwrite)
    variants = {"current": HERE.parent, **{f"baseline_{i}": Path(root).resolve() for i, root in
                                           enumerate(args.baseline)}}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    forwarded = ["--device", args.device, "--envs", args.envs, "--episodes", str(args.episodes),
                 "--warmup-episodes", str(args.warmup_episodes), "--seed", str(args.seed)]
    if args.max_episode_steps is not None:
        forwarded += ["--max-episode-steps", str(args.max_episode_steps)]
    if args.threads:
        forwarded += ["--threads", str(args.threads)]
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, root in variants.items():
                out_json = Path(scratch) / f"{name}_{round_index}.json"
                command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--root", str(root),
                           "--json", str(out_json), *forwarded]
                if args.cprofile and name == "current" and round_index == 0:
                    command += ["--cprofile-to", str(Path(args.out or ".") / "pusht_env_episodes_cprofile")]
                print(f"round {round_index} {name}: {root}", flush=True)
                subprocess.run(command, check=True)
                runs[name].append(json.loads(out_json.read_text()))
    results: dict = {
        "provenance": provenance(),
        "settings": {"device": args.device, "episodes": args.episodes, "warmup_episodes": args.warmup_episodes,
                     "rounds": args.rounds, "seed": args.seed, "max_episode_steps": args.max_episode_steps},
        "variants": {name: {"root": str(root), "commit": variant_commit(root), "runs": runs[name]}
                     for name, root in variants.items()},
    }
    for n in map(str, args.env_counts):
        summary = {}
        for name in variants:
            rates = [run[n]["stepped_per_s"] for run in runs[name]]
            summary[name] = {"stepped_per_s": statistics.median(rates),
                             "env_steps_per_s": statistics.median(run[n]["env_steps_per_s"] for run in runs[name])}
        for name in variants:
            if name != "current":
                summary[f"speedup_over_{name}"] = summary["current"]["stepped_per_s"] / summary[name]["stepped_per_s"]
        results[f"envs_{n}"] = summary
        print(f"{n:>4} envs: " + ", ".join(f"{name} {value['stepped_per_s']:.0f}/s" for name, value in summary.items()
                                           if isinstance(value, dict)), flush=True)
    write_results(results, args.name, args.out, args.overwrite)
    return results


if __name__ == "__main__":
    main()
