"""How much of gym-pusht's success a score read at chunk ends can see: policies in gym-pusht alone, success counted
at any step (gym-pusht's definition, where the episode ends) against success visible on the frame at the end of
some chunk (what an evaluator scoring only each chunk's last frame counts). The episodes run past success so that
both are read from the same per-step coverage (``compare.simulate_policy``). Issue 42: the world model's success
had been scored at chunk ends only, against the real success at any step.

    python benchmarks/recipes/success_visibility_pusht.py --policies file:A.safetensors,file:B.safetensors \\
        --starts 64 --chunks 38 --name success_visibility.json --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent)]

from common import add_output_arguments, write_results  # noqa: E402
from tqdm import tqdm  # noqa: E402

from cosmos3_gym.policy_specs import load_frame_agent, parse_policy_specs  # noqa: E402
from cosmos3_gym.processor import ActionStats  # noqa: E402
from cosmos3_gym.statistics import wilson_interval  # noqa: E402
from cosmos3_gym.tasks.pusht import episodes as pusht  # noqa: E402
from cosmos3_gym.tasks.pusht.compare import simulate_policy  # noqa: E402
from cosmos3_gym.tasks.pusht.env import load_pusht_assets, pusht_env_defaults  # noqa: E402


def visibility(coverage: np.ndarray, chunk: int) -> dict:
    """Per-step coverage ``[starts, chunks * chunk + 1]`` -> success rates at any step and at chunk ends."""
    any_step = (coverage > pusht.SUCCESS_COVERAGE).any(axis=1)
    at_chunk_ends = (coverage[:, ::chunk] > pusht.SUCCESS_COVERAGE).any(axis=1)
    n = len(coverage)
    return {
        "episodes": n,
        "success_rate_any_step": float(any_step.mean()),
        "success_rate_any_step_interval": list(wilson_interval(int(any_step.sum()), n, 0.95)),
        "success_rate_at_chunk_ends": float(at_chunk_ends.mean()),
        "success_rate_at_chunk_ends_interval": list(wilson_interval(int(at_chunk_ends.sum()), n, 0.95)),
        "visible_share": float(at_chunk_ends.sum() / max(1, any_step.sum())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", required=True, help="comma-separated policy specs (compare.py's)")
    parser.add_argument("--starts", type=int, default=64)
    parser.add_argument("--first-sim-seed", type=int, default=5_000_000, help="gym-pusht seed of the first start "
                        "(default: the evaluation pool's reporting seeds)")
    parser.add_argument("--chunks", type=int, default=38)
    parser.add_argument("--name", default="success_visibility_pusht.json")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    assets = load_pusht_assets(None)
    defaults = pusht_env_defaults(assets)
    stats = ActionStats.from_json(defaults["action_stats"], mode=assets.meta.get("action_normalization", "minmax"))
    chunk, image_size = int(assets.meta["chunk"]), tuple(assets.meta["image_size"])
    seeds = range(args.first_sim_seed, args.first_sim_seed + args.starts)
    policies = {}
    for run in tqdm(parse_policy_specs(args.policies), desc="policies"):
        agent = load_frame_agent(run, action_stats=stats, chunk=chunk) if run.acts_on_frames else None
        _, _, coverage = simulate_policy(run, seeds, args.chunks, chunk, image_size, stats, agent, seed=0)
        policies[run.spec] = visibility(coverage, chunk)
        tqdm.write(f"{run.spec}: {policies[run.spec]}")
    results = {"policies": policies, "num_chunks": args.chunks, "chunk": chunk, "first_sim_seed": args.first_sim_seed,
               "success": f"coverage > {pusht.SUCCESS_COVERAGE} at any step, or on the frame ending some chunk"}
    write_results(results, args.name, args.out, args.overwrite, topic="fidelity")
    return 0


if __name__ == "__main__":
    sys.exit(main())
