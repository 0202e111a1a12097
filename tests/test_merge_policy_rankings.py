"""benchmarks/recipes/merge_policy_rankings.py: one ranking from runs that split a policy pool."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def part(rows: dict[str, tuple[float, float]], heldout_seed: int = 7) -> dict:
    """A pusht_fidelity_targets.py result with per-policy (real, imagined) final coverage."""
    def score(coverage: float) -> dict:
        return {"final_coverage": coverage, "success_rate": float(coverage > 0.9)}

    return {"heldout_seed": heldout_seed, "decoder": "light", "precision": "bf16", "sampling": {},
            "policies": {"num_chunks": 4, "num_starts": 48,
                         "policies": {spec: {"simulator": score(real), "world_model": score(wm),
                                             "world_model_by_score": {"geometric": score(wm)}}
                                      for spec, (real, wm) in rows.items()}}}


@pytest.fixture
def merge_module():
    sys.path.insert(0, str(ROOT / "benchmarks" / "recipes"))
    try:
        import merge_policy_rankings
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "recipes"))
    return merge_policy_rankings


def test_parts_are_ranked_together_and_closed_loop_apart(merge_module, tmp_path):
    # Ordered in the world model as in reality within each part, but the open-loop replays (scripted:N) are
    # under-credited: only the merged ranking over all policies sees the violation.
    a = part({"scripted:5": (0.95, 0.40), "scripted-frames:5": (0.90, 0.85)})
    b = part({"scripted-frames:50": (0.30, 0.35), "random": (0.05, 0.05)})
    merged = merge_module.merge([a, b])
    assert sorted(merged["policies"]) == ["random", "scripted-frames:5", "scripted-frames:50", "scripted:5"]
    assert merged["closed_loop_policies"] == ["scripted-frames:5", "scripted-frames:50"]
    assert merged["rankings"]["all"]["reward_model"]["mmrv"] > 0.0  # scripted:5 ranked below scripted-frames:5
    assert merged["rankings"]["closed_loop"]["reward_model"]["spearman"] == pytest.approx(1.0)
    # By success (coverage > 0.9 here): scripted:5 succeeds in reality only, so the world model gets it wrong.
    by_success = merged["rankings_by_success"]["all"]["reward_model"]
    assert by_success["mean_absolute_error"] == pytest.approx(0.25) and by_success["mmrv"] > 0.0
    assert merged["checks"]["scripted:5"] == {"coverage_within_0.1": False, "success_within_10_points": False}
    assert merged["checks"]["random"]["success_within_10_points"] is None  # real success below 30 %

    paths = []
    for name, content in (("a.json", a), ("b.json", b)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(content))
    assert merge_module.main(["--inputs", *map(str, paths), "--name", "merged.json", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "merged.json").read_text())
    assert written["inputs"] == ["a.json", "b.json"] and "provenance" in written


def test_parts_of_different_runs_are_refused(merge_module):
    with pytest.raises(SystemExit, match="heldout_seed"):
        merge_module.merge([part({"random": (0.1, 0.1)}), part({"scripted:5": (0.9, 0.5)}, heldout_seed=8)])
    with pytest.raises(SystemExit, match="in two parts"):
        merge_module.merge([part({"random": (0.1, 0.1)}), part({"random": (0.1, 0.2)})])


def test_more_starts_of_a_policy_are_pooled(merge_module):
    # A policy run twice from disjoint seeds (--policy-first-start) counts as one run over all its starts: the pooled
    # rates, means and intervals are those of the starts together, computed from the per-start values.
    import numpy as np

    from cosmos3_gym.tasks.pusht.compare import _scores

    rng = np.random.default_rng(3)
    coverage = {world: rng.uniform(0.0, 1.0, size=(64, 5)) for world in ("simulator", "world_model")}

    def run(first: int, count: int, spec: str = "scripted-frames:5") -> dict:
        rows = {world: _scores(values[first:first + count], 0.95) for world, values in coverage.items()}
        rows["world_model_by_score"] = {"geometric": rows["world_model"]}
        return {"heldout_seed": 7, "decoder": "light", "precision": "bf16", "sampling": {},
                "policies": {"num_chunks": 5, "num_starts": count, "sim_seeds": list(range(first, first + count)),
                             "policies": {spec: {**rows, "evaluated_in_world_model": "closed loop"}}}}

    merged = merge_module.merge([run(0, 32), run(32, 20), run(52, 12, spec="random")])
    assert merged["starts"] == {"scripted-frames:5": 52, "random": 12}
    pooled = merged["policies"]["scripted-frames:5"]
    for world in ("simulator", "world_model"):
        expected = _scores(coverage[world][:52], 0.95)
        for key in ("final_coverage", "success_rate"):
            assert pooled[world][key] == pytest.approx(expected[key])
        for key in ("final_coverage_interval", "success_rate_interval"):
            assert pooled[world][key] == pytest.approx(list(expected[key]))
    assert pooled["world_model_by_score"]["geometric"] == pooled["world_model"]
    with pytest.raises(SystemExit, match="overlapping"):
        merge_module.merge([run(0, 32), run(16, 32)])
    with pytest.raises(SystemExit, match="episode lengths"):
        longer = run(32, 20)
        longer["policies"]["num_chunks"] = 38
        merge_module.merge([run(0, 32), longer])


def test_estimates_ranked_against_a_larger_real_evaluation(merge_module, tmp_path):
    # The parts' few starts say a and b tie in reality; 300 starts of eval-real order them b > a, as the model does.
    a = part({"scripted-frames:5": (0.5, 0.55), "scripted-frames:50": (0.5, 0.95)})
    merged = merge_module.merge([a])
    real = {"num_chunks": 4, "policies": {"scripted-frames:5": {"success_rate": 0.1, "episodes": 300},
                                          "scripted-frames:50": {"success_rate": 0.3, "episodes": 300}}}
    against = merge_module.against_real_success(merged, [a], real)
    assert against["real_episodes"] == [300]
    assert against["by_imagined_coverage"]["reward_model"]["spearman"] == pytest.approx(1.0)
    assert against["by_imagined_success"]["geometric"]["mean_absolute_error"] == pytest.approx((0.1 + 0.7) / 2)
    # Success within 10 points is checked against the larger evaluation's rates, where those are >= 30 %.
    assert against["success_within_10_points"]["geometric"] == {"scripted-frames:5": None,
                                                                "scripted-frames:50": False}
    real_close = {**real, "policies": {**real["policies"],
                                       "scripted-frames:50": {"success_rate": 0.95, "episodes": 300}}}
    close = merge_module.against_real_success(merged, [a], real_close)
    assert close["success_within_10_points"]["reward_model"]["scripted-frames:50"] is True
    # Two policies: every draw that has a correlation has it at +-1.
    assert set(against["by_imagined_success_interval_95"]["geometric"]) == {"pearson", "spearman"}
    with pytest.raises(SystemExit, match="chunks"):
        merge_module.against_real_success(merged, [a], {**real, "num_chunks": 38})
    with pytest.raises(SystemExit, match="no real evaluation"):
        merge_module.against_real_success(merged, [a], {**real, "policies": {}})
    paths = [tmp_path / "a.json", tmp_path / "real.json"]
    paths[0].write_text(json.dumps(a))
    paths[1].write_text(json.dumps(real))
    assert merge_module.main(["--inputs", str(paths[0]), "--real", str(paths[1]), "--name", "m.json",
                              "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["against_real_success"]["file"] == "real.json"
    # Two real evaluations (checkpoints evaluated in two sessions) count as one; overlapping or unequal ones do not.
    halves = [{"num_chunks": 4, "policies": {spec: entry}} for spec, entry in real["policies"].items()]
    real_paths = [tmp_path / "real_1.json", tmp_path / "real_2.json"]
    for path, half in zip(real_paths, halves):
        path.write_text(json.dumps(half))
    assert merge_module.main(["--inputs", str(paths[0]), "--real", *map(str, real_paths), "--name", "m2.json",
                              "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "m2.json").read_text())["against_real_success"]["by_imagined_coverage"][
        "reward_model"]["spearman"] == pytest.approx(1.0)
    with pytest.raises(SystemExit, match="two files"):
        merge_module.combined_real([halves[0], halves[0]])
    with pytest.raises(SystemExit, match="differ in length"):
        merge_module.combined_real([halves[0], {**halves[1], "num_chunks": 38}])



def test_success_ranking_interval_follows_the_episode_noise(merge_module):
    import numpy as np

    rates = np.array([0.1, 0.3, 0.5, 0.7, 0.9])
    many, few = np.full(5, 2000), np.full(5, 8)
    tight = merge_module.success_ranking_interval(rates, many, rates, many)
    assert tight["spearman"][0] == pytest.approx(1.0) and tight["pearson"][0] > 0.99
    # Eight episodes a policy on the imagined side: neighbours swap often, the interval widens downwards.
    loose = merge_module.success_ranking_interval(rates, few, rates, many)
    assert loose["spearman"][0] < 0.8 and loose["spearman"][1] == pytest.approx(1.0)
    # Policies of one skill: no ranking to find, the interval straddles zero.
    tied = merge_module.success_ranking_interval(np.full(5, 0.3), np.full(5, 32), np.full(5, 0.3), np.full(5, 300))
    assert tied["spearman"][0] < 0.0 < tied["spearman"][1]
