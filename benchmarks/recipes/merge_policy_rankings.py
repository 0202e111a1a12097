"""One policy ranking from several runs of ``pusht_fidelity_targets.py`` that split a policy pool between them.

A run ranks the policies it evaluated; a pool evaluated in parts (two processes on one GPU, each with its own
simulator, halves the wall time) is ranked here from the per-policy rows of every part, which all used the same
checkpoint, seeds and chunks (checked). A policy in several parts that started from disjoint seeds
(``--policy-first-start``: more starts for an earlier run's policies) is pooled over all its starts. Writes the
per-policy table, the rankings by each scorer (Pearson, Spearman, MMRV, mean absolute error;
``tasks.pusht.compare.ranking_agreement``) of final coverage (``rankings``) and of success rate
(``rankings_by_success``), over all policies and over those that act on frames (closed loop in both worlds, as users
evaluate theirs; the others are replayed open loop in the world model), and issue 42's per-policy checks: success
within 10 points where the real success rate is >= 30 %, final coverage within 0.1. ``--real`` adds the estimates
ranked against a larger real evaluation's success rates (``against_real_success``).

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
from cosmos3_gym.statistics import student_t_quantile, wilson_interval  # noqa: E402
from cosmos3_gym.tasks.pusht.compare import ranking_agreement  # noqa: E402

SAME_ACROSS_PARTS = ("heldout_seed", "decoder", "precision", "sampling")


def merge(parts: list[dict]) -> dict:
    """The merged per-policy rows and rankings of ``parts`` (results of ``pusht_fidelity_targets.py``)."""
    for key in SAME_ACROSS_PARTS:
        values = {json.dumps(part.get(key), sort_keys=True) for part in parts}
        if len(values) > 1:
            raise SystemExit(f"--inputs: the parts differ in {key!r} ({sorted(values)}); rank only comparable runs")
    runs: dict[str, list[tuple[dict, dict]]] = {}
    for part in parts:
        for spec, row in part["policies"]["policies"].items():
            runs.setdefault(spec, []).append((row, part["policies"]))
    rows = {spec: pooled_row(spec, found) for spec, found in runs.items()}
    starts = {spec: sum(run["num_starts"] for _, run in found) for spec, found in runs.items()}
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
    return {"policies": rows, "starts": {spec: starts[spec] for spec in specs}, "closed_loop_policies": closed_loop,
            "rankings": rankings, "rankings_by_success": rankings_by_success, "checks": checks,
            "real_final_coverage_span": [min(real), max(real)]}


def pooled_row(spec: str, found: list[tuple[dict, dict]]) -> dict:
    """One policy's row over the runs in ``found`` (``(row, the run's "policies" section)``), which must have started
    from disjoint gym-pusht seeds and run as many chunks: every score's rates and means weighted by the runs' starts,
    and their intervals recomputed over all starts (``_pooled_scores``)."""
    if len(found) == 1:
        return found[0][0]
    seeds = [set(run.get("sim_seeds") or []) for _, run in found]
    if any(not seed_set for seed_set in seeds) or sum(map(len, seeds)) != len(set().union(*seeds)):
        raise SystemExit(f"--inputs: policy {spec!r} is in two parts with overlapping (or unrecorded) starts")
    if len({run["num_chunks"] for _, run in found}) > 1:
        raise SystemExit(f"--inputs: policy {spec!r} is in parts of different episode lengths")
    modes = {row.get("evaluated_in_world_model") for row, _ in found}
    if len(modes) > 1:
        raise SystemExit(f"--inputs: policy {spec!r} is evaluated differently in the world model across parts {modes}")
    sizes = [run["num_starts"] for _, run in found]
    first = found[0][0]
    pooled = {**first, "simulator": _pooled_scores([row["simulator"] for row, _ in found], sizes),
              "world_model": _pooled_scores([row["world_model"] for row, _ in found], sizes)}
    if "world_model_by_score" in first:
        pooled["world_model_by_score"] = {
            name: _pooled_scores([row["world_model_by_score"][name] for row, _ in found], sizes)
            for name in first["world_model_by_score"]}
    return pooled


def _pooled_scores(scores: list[dict], sizes: list[int], confidence: float = 0.95) -> dict:
    """Final coverage and success of several disjoint sets of starts as one set: the success count and the coverage
    mean are exact; the coverage interval (Student t, as ``statistics.mean_interval``) is recomputed from each set's
    standard deviation, read back from the half-width of its interval on a side that was not clipped to [0, 1] (the
    per-start values are not in the results)."""
    total = sum(sizes)
    successes = sum(round(score["success_rate"] * size) for score, size in zip(scores, sizes))
    mean = sum(score["final_coverage"] * size for score, size in zip(scores, sizes)) / total
    pooled = {"final_coverage": mean, "success_rate": successes / total}
    if "success_rate_interval" in scores[0]:
        pooled["success_rate_interval"] = list(wilson_interval(successes, total, confidence))
    if all(score.get("final_coverage_interval") for score in scores):
        squares = 0.0
        for score, size in zip(scores, sizes):
            spread = _standard_deviation(score["final_coverage"], score["final_coverage_interval"], size, confidence)
            squares += (size - 1) * spread**2 + size * (score["final_coverage"] - mean) ** 2
        half = student_t_quantile(0.5 + confidence / 2, total - 1) * math.sqrt(squares / (total - 1) / total)
        pooled["final_coverage_interval"] = [max(mean - half, 0.0), min(mean + half, 1.0)]
    return pooled


def _standard_deviation(mean: float, interval: list[float], size: int, confidence: float) -> float:
    """The sample standard deviation behind ``mean_interval``'s ``interval`` of ``size`` values, from a bound that was
    not clipped to [0, 1]."""
    low, high = interval
    if high < 1.0:
        half = high - mean
    elif low > 0.0:
        half = mean - low
    else:
        raise SystemExit(f"--inputs: a coverage interval {interval} clipped on both sides cannot be pooled")
    return half * math.sqrt(size) / student_t_quantile(0.5 + confidence / 2, size - 1)


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
    imagined_episodes = np.array([merged["starts"][spec] for spec in specs])
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
