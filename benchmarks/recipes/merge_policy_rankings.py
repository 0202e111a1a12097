"""One policy ranking from several runs of ``pusht_fidelity_targets.py`` that split a policy pool between them.

A run ranks the policies it evaluated; a pool evaluated in parts (two processes on one GPU, each with its own
simulator, halves the wall time) is ranked here from the per-policy rows of every part, which all used the same
checkpoint, seeds and chunks (checked). Writes the per-policy table, the rankings by each scorer (Pearson, Spearman,
MMRV, mean absolute error; ``tasks.pusht.compare.ranking_agreement``) of final coverage (``rankings``) and of success
rate (``rankings_by_success``), over all policies and over those that act on
frames (closed loop in both worlds, as users evaluate theirs; the others are replayed open loop in the world model),
and issue 42's per-policy checks: success within 10 points where the real success rate is >= 30 %, final coverage
within 0.1. ``--real`` adds the estimates ranked against a larger real evaluation's success rates
(``against_real_success``).

    python benchmarks/recipes/merge_policy_rankings.py --inputs A.json B.json --name evalpool_16.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent)]

from common import add_output_arguments, write_results  # noqa: E402

from cosmos3_gym.policy_specs import parse_policy_spec  # noqa: E402
from cosmos3_gym.tasks.pusht.compare import ranking_agreement  # noqa: E402

SAME_ACROSS_PARTS = ("heldout_seed", "decoder", "precision", "sampling")


def merge(parts: list[dict]) -> dict:
    """The merged per-policy rows and rankings of ``parts`` (results of ``pusht_fidelity_targets.py``)."""
    for key in SAME_ACROSS_PARTS:
        values = {json.dumps(part.get(key), sort_keys=True) for part in parts}
        if len(values) > 1:
            raise SystemExit(f"--inputs: the parts differ in {key!r} ({sorted(values)}); rank only comparable runs")
    rows: dict[str, dict] = {}
    for part in parts:
        for spec, row in part["policies"]["policies"].items():
            if spec in rows:
                raise SystemExit(f"--inputs: policy {spec!r} is in two parts")
            rows[spec] = row
    specs = sorted(rows)
    closed_loop = [spec for spec in specs if parse_policy_spec(spec).acts_on_frames]
    rankings = {"all": _rankings(rows, specs), "closed_loop": _rankings(rows, closed_loop)}
    # Success is what users of an evaluator compare checkpoints by (issue 42: checkpoints of one run).
    rankings_by_success = {"all": _rankings(rows, specs, "success_rate"),
                           "closed_loop": _rankings(rows, closed_loop, "success_rate")}
    checks = {}
    for spec in specs:
        sim, wm = rows[spec]["simulator"], rows[spec]["world_model"]
        checks[spec] = {
            "coverage_within_0.1": bool(abs(wm["final_coverage"] - sim["final_coverage"]) <= 0.1),
            "success_within_10_points": success_within_10_points(wm["success_rate"], sim["success_rate"]),
        }
    real = [rows[spec]["simulator"]["final_coverage"] for spec in specs]
    return {"policies": rows, "closed_loop_policies": closed_loop, "rankings": rankings,
            "rankings_by_success": rankings_by_success, "checks": checks,
            "real_final_coverage_span": [min(real), max(real)]}


def success_within_10_points(imagined: float, real: float) -> bool | None:
    """Issue 42's success check: the imagined rate within 10 points of the real one, for a policy whose real success
    rate is >= 30 % (None below that)."""
    return bool(abs(imagined - real) <= 0.1) if real >= 0.3 else None


def combined_real(evaluations: list[dict]) -> dict:
    """Several eval-real results as one: their policies together (each evaluated once, all at one horizon)."""
    chunks = {evaluation.get("num_chunks") for evaluation in evaluations}
    if len(chunks) > 1:
        raise SystemExit(f"--real: the files' episodes differ in length ({sorted(chunks)} chunks)")
    policies: dict = {}
    for evaluation in evaluations:
        twice = sorted(set(policies) & set(evaluation.get("policies", {})))
        if twice:
            raise SystemExit(f"--real: {twice} evaluated in two files")
        policies.update(evaluation.get("policies", {}))
    return {"num_chunks": chunks.pop(), "policies": policies}


def against_real_success(merged: dict, parts: list[dict], real: dict) -> dict:
    """The world model's estimates ranked against the success rates of a separate, larger real evaluation of the
    same policies at the same horizon (``cosmos3-gym eval-real --real-only --out``): a few dozen starts leave the
    real side of the ranking noisy. Only success is compared: eval-real's final coverage stops at success."""
    chunks = {part["policies"]["num_chunks"] for part in parts}
    if chunks != {real.get("num_chunks")}:
        raise SystemExit(f"--real: its episodes are {real.get('num_chunks')} chunks, the parts' {sorted(chunks)}")
    specs = sorted(merged["policies"])
    missing = [spec for spec in specs if spec not in real.get("policies", {})]
    if missing:
        raise SystemExit(f"--real: no real evaluation of {missing}")
    success = np.array([real["policies"][spec]["success_rate"] for spec in specs])
    real_episodes = np.array([real["policies"][spec]["episodes"] for spec in specs])
    starts = {spec: part["policies"]["num_starts"] for part in parts for spec in part["policies"]["policies"]}
    imagined_episodes = np.array([starts[spec] for spec in specs])
    estimates = _estimates(merged["policies"], specs)
    return {
        "real_episodes": sorted(set(real_episodes.tolist())),
        "real_success_rate": dict(zip(specs, success.tolist())),
        "by_imagined_success": {name: ranking_agreement(np.array([e["success_rate"] for e in rows_]), success)
                                for name, rows_ in estimates.items()},
        "by_imagined_success_interval_95": {
            name: success_ranking_interval(np.array([e["success_rate"] for e in rows_]), imagined_episodes, success,
                                           real_episodes)
            for name, rows_ in estimates.items()},
        "by_imagined_coverage": {name: ranking_agreement(np.array([e["final_coverage"] for e in rows_]), success)
                                 for name, rows_ in estimates.items()},
        # The per-policy success check against the larger evaluation (the parts' own check uses their few starts).
        "success_within_10_points": {name: {spec: success_within_10_points(e["success_rate"], rate)
                                            for spec, e, rate in zip(specs, rows_, success.tolist())}
                                     for name, rows_ in estimates.items()},
    }


def success_ranking_interval(imagined: np.ndarray, imagined_episodes: np.ndarray, real: np.ndarray,
                             real_episodes: np.ndarray, draws: int = 2000, seed: int = 0) -> dict[str, list[float]]:
    """95 % percentile intervals of Pearson and Spearman between imagined and real success rates, each rate redrawn
    as a binomial count over its own episodes (a parametric bootstrap of both sides' episode noise: the per-episode
    outcomes are not in the results). Draws where one side is constant have no correlation and are left out."""
    rng = np.random.default_rng(seed)
    imagined_draws = rng.binomial(imagined_episodes, imagined, size=(draws, len(imagined))) / imagined_episodes
    real_draws = rng.binomial(real_episodes, real, size=(draws, len(real))) / real_episodes
    rankings = [ranking_agreement(guess, truth) for guess, truth in zip(imagined_draws, real_draws)
                if np.ptp(guess) > 0 and np.ptp(truth) > 0]
    return {key: np.percentile([r[key] for r in rankings], [2.5, 97.5]).tolist() if rankings else [math.nan] * 2
            for key in ("pearson", "spearman")}


def _rankings(rows: dict[str, dict], specs: list[str], measure: str = "final_coverage") -> dict[str, dict[str, float]]:
    """Each scorer's ranking agreement on ``measure`` over ``specs``: the reward model and every extra scorer of the
    run."""
    real = np.array([rows[spec]["simulator"][measure] for spec in specs])
    return {name: ranking_agreement(np.array([e[measure] for e in estimates]), real)
            for name, estimates in _estimates(rows, specs).items()}


def _estimates(rows: dict[str, dict], specs: list[str]) -> dict[str, list[dict]]:
    """Each scorer's world-model rows over ``specs``: the reward model's and every extra scorer's of the run."""
    estimates = {"reward_model": [rows[spec]["world_model"] for spec in specs]}
    for name in rows[specs[0]].get("world_model_by_score", {}):
        estimates[name] = [rows[spec]["world_model_by_score"][name] for spec in specs]
    return estimates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", nargs="+", required=True, help="results JSONs of pusht_fidelity_targets.py")
    parser.add_argument("--name", required=True, help="the merged results' file name")
    parser.add_argument("--real", nargs="+", default=None, help="eval-real --real-only JSONs of the same policies and "
                        "horizon with more starts (several: their policies together): the estimates are also ranked "
                        "against their success rates")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    parts = [json.loads(Path(path).read_text()) for path in args.inputs]
    merged = merge(parts)
    merged["inputs"] = [Path(path).name for path in args.inputs]
    if args.real:
        real = combined_real([json.loads(Path(path).read_text()) for path in args.real])
        merged["against_real_success"] = {"file": ", ".join(Path(path).name for path in args.real),
                                          **against_real_success(merged, parts, real)}
        for key in ("by_imagined_success", "by_imagined_coverage"):
            for name, ranking in merged["against_real_success"][key].items():
                print(f"vs --real success, {key} {name}: " + " ".join(f"{k} {v:.3f}" for k, v in ranking.items()))
        for name, checks in merged["against_real_success"]["success_within_10_points"].items():
            held = [ok for ok in checks.values() if ok is not None]
            print(f"vs --real success, {name}: success within 10 points for {sum(held)} of the {len(held)} policies "
                  "at >= 30 % real success")
        for name, interval in merged["against_real_success"]["by_imagined_success_interval_95"].items():
            print(f"vs --real success, by_imagined_success {name}, 95 % interval: "
                  + " ".join(f"{k} [{low:.3f}, {high:.3f}]" for k, (low, high) in interval.items()))
    merged["settings"] = {key: parts[0].get(key) for key in SAME_ACROSS_PARTS}
    merged["parts_provenance"] = [part.get("provenance") for part in parts]
    for measure in ("rankings", "rankings_by_success"):
        for subset, by_scorer in merged[measure].items():
            for name, ranking in by_scorer.items():
                print(f"{measure} {subset} {name}: " + " ".join(f"{k} {v:.3f}" for k, v in ranking.items()))
    write_results(merged, args.name, args.out, args.overwrite, topic="fidelity")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
