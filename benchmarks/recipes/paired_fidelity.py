"""Two PushT world models compared on the same held-out episodes, episode by episode (issue 42's A/Bs).

The block error of one model over 32 held-out episodes has a 95 % interval of +-10 px at chunk 8: most of its spread
is which episode it is (a hard push is hard for both models). Both models of an A/B roll out the same episodes (same
``--heldout-seed``: same starts, same recorded actions; same random-action starts), so the difference per episode
cancels that spread. This takes ``pusht_fidelity_targets.py`` results of a baseline and of a variant, pairs them by
held-out seed (several seeds pool their episodes), and reports per chunk the variant's block position error minus
the baseline's (Student t over the episodes where both found the block), the same over the whole episode (each
episode's mean over chunks 1..K), and the untouched block's displacement error under random actions (each episode's
mean over its untouched chunks).

    python benchmarks/recipes/paired_fidelity.py --baseline plain_s1.json plain_s2.json \\
        --variant ctx_s1.json ctx_s2.json --name paired_ctx_vs_plain.json --out DIR

Negative differences: the variant's error is lower. Needs results written with per-episode values (this commit on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]

from common import add_output_arguments, write_results  # noqa: E402
from fidelity_pusht_chunks import finite_mean_ci95  # noqa: E402
from pusht_fidelity_targets import episode_means  # noqa: E402

# What must match between a baseline and a variant run for their episodes to be the same ones.
SAME_EPISODES = ("heldout_seed", "decoder")
POSITION, ANGLE = "block_position_error_px_rollout", "block_angle_error_deg_rollout"
UNTOUCHED = "per_episode_block_displacement_error_px"


def _matrix(values: list[list[float | None]]) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in values], dtype=np.float64)


def per_episode(result: dict[str, Any], name: str) -> dict[str, np.ndarray]:
    """One run's per-episode arrays: block position / angle error ``[N, K]`` and the untouched block's displacement
    error ``[M, K']`` (NaN: no value)."""
    try:
        values = result["heldout"]["per_episode"]
        untouched = result["any_action"]["untouched"][UNTOUCHED]
    except KeyError as error:
        raise SystemExit(f"{name}: no per-episode values ({error}); "
                         "rerun pusht_fidelity_targets.py at this commit") from None
    return {"position": _matrix(values[POSITION]), "angle": _matrix(values[ANGLE]), "untouched": _matrix(untouched)}


def pair_runs(baseline: list[dict], variant: list[dict]) -> list[tuple[dict, dict]]:
    """Baseline and variant runs matched by held-out seed, checked to be on the same episodes."""
    by_seed = {run["heldout_seed"]: run for run in baseline}
    if len(by_seed) != len(baseline):
        raise SystemExit("--baseline: two runs share a held-out seed")
    variant_seeds = [run["heldout_seed"] for run in variant]
    if sorted(variant_seeds) != sorted(by_seed):
        raise SystemExit(f"--variant: held-out seeds {sorted(variant_seeds)}, expected the baseline's "
                         f"{sorted(by_seed)}")
    pairs = []
    for run in variant:
        base = by_seed[run["heldout_seed"]]
        for key in SAME_EPISODES:
            if base.get(key) != run.get(key):
                raise SystemExit(f"held-out seed {run['heldout_seed']}: the runs differ in {key!r} "
                                 f"({base.get(key)!r} vs {run.get(key)!r})")
        for part in ("heldout", "any_action"):
            shape = [(r[part]["num_episodes"], r[part]["num_chunks"], r[part]["chunk"]) for r in (base, run)]
            if shape[0] != shape[1]:
                raise SystemExit(f"held-out seed {run['heldout_seed']}: {part} episodes x chunks x steps differ "
                                 f"({shape[0]} vs {shape[1]})")
        pairs.append((base, run))
    return pairs


def compare(pairs: list[tuple[dict, dict]]) -> dict[str, Any]:
    """Per chunk and over whole episodes: each model's mean and the paired variant-minus-baseline difference."""
    runs = [(per_episode(base, "--baseline"), per_episode(run, "--variant")) for base, run in pairs]

    def stack(key: str) -> tuple[np.ndarray, np.ndarray]:
        return (np.concatenate([base[key] for base, _ in runs]), np.concatenate([run[key] for _, run in runs]))

    def paired(base: np.ndarray, run: np.ndarray) -> dict[str, Any]:
        both = np.isfinite(base) & np.isfinite(run)  # an episode counts where both models have a value
        return {"baseline": finite_mean_ci95(base[both]), "variant": finite_mean_ci95(run[both]),
                "variant_minus_baseline": finite_mean_ci95(run[both] - base[both])}

    result: dict[str, Any] = {"num_episodes": len(stack("position")[0]), "per_chunk": {}, "whole_episode": {}}
    for key, unit in (("position", "px"), ("angle", "deg")):
        base, run = stack(key)
        result["per_chunk"][f"block_{key}_error_{unit}"] = [paired(base[:, k], run[:, k]) for k in range(base.shape[1])]
        result["whole_episode"][f"block_{key}_error_{unit}"] = paired(episode_means(base), episode_means(run))
    base, run = stack("untouched")
    result["untouched_block_displacement_error_px"] = paired(episode_means(base), episode_means(run))
    return result


def _line(label: str, entry: dict[str, Any]) -> str:
    difference = entry["variant_minus_baseline"]
    return (f"{label:<36} {entry['baseline']['mean']:7.2f} {entry['variant']['mean']:7.2f}   "
            f"{difference['mean']:+6.2f} [{difference['ci95_low']:+.2f}, {difference['ci95_high']:+.2f}]  "
            f"n={difference['n']}")


def format_summary(result: dict[str, Any], chunks: list[int]) -> str:
    lines = [f"{result['num_episodes']} paired episodes; baseline, variant, variant - baseline [95 % CI]"]
    for key in ("block_position_error_px", "block_angle_error_deg"):
        per_chunk = result["per_chunk"][key]
        for k in chunks:
            if 1 <= k <= len(per_chunk):
                lines.append(_line(f"{key} chunk {k}", per_chunk[k - 1]))
        lines.append(_line(f"{key} whole episode", result["whole_episode"][key]))
    lines.append(_line("untouched block px", result["untouched_block_displacement_error_px"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", nargs="+", required=True, help="pusht_fidelity_targets.py results (one per seed)")
    parser.add_argument("--variant", nargs="+", required=True, help="the same, of the variant, on the same seeds")
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 12, 16], help="chunks to print (1-based)")
    parser.add_argument("--name", default=None, help="write the comparison as this results JSON (topic fidelity)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    baseline, variant = ([json.loads(Path(path).read_text()) for path in paths]
                         for paths in (args.baseline, args.variant))
    result = compare(pair_runs(baseline, variant))
    result["baseline"] = [Path(path).name for path in args.baseline]
    result["variant"] = [Path(path).name for path in args.variant]
    print(format_summary(result, args.chunks))
    if args.name:
        write_results(result, args.name, args.out, args.overwrite, topic="fidelity")
    return result


if __name__ == "__main__":
    main()
