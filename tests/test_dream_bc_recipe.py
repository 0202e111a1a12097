"""benchmarks/recipes/dream_bc_pusht.py --smoke (issue 45 item 4): every stage on the CPU at tiny sizes: scripted
demonstrations, dreams of the teacher in the PushT world model written as a LeRobot dataset and read back, BC with
and without the dreams at the same number of steps, and the gym-pusht evaluation with the paired difference."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.sim  # needs gym-pusht (the sim extra)

pytest.importorskip("gym_pusht")

RECIPE = Path(__file__).resolve().parent.parent / "benchmarks" / "recipes" / "dream_bc_pusht.py"


def test_smoke_run_writes_results_policies_and_a_dream_dataset(tmp_path, monkeypatch):
    from cosmos3_gym.data.lerobot import LeRobotDataset
    from cosmos3_gym.rl.policy import load_policy_file

    monkeypatch.setenv("COSMOS3_GYM_COMMIT", "test")
    spec = importlib.util.spec_from_file_location("dream_bc_pusht_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out, work = tmp_path / "out", tmp_path / "work"
    common = ["--smoke", "--work", str(work), "--no-progress", "--out", str(out)]
    recipe.main([*common, "--stages", "demos,dream,bc"])
    results = recipe.main([*common, "--stages", "eval"])  # a second call continues from --work

    saved = json.loads((out / "dream_bc_pusht_smoke.json").read_text())
    assert saved["provenance"]["commit"] == "test" and [c["stages"] for c in saved["calls"]] == [
        "demos,dream,bc", "eval"]
    dreams = saved["dreams"]
    assert dreams["episodes"] == 2 and dreams["episodes_kept"] == 2 and dreams["keep"] == "all"
    assert dreams["teacher"].endswith("rl_pusht_grpo_simulator_policy_starts_h4_cw10_400it.safetensors")
    assert len(LeRobotDataset(work / "dreams")) == 2  # the dreams, as a LeRobot dataset
    bc = saved["bc"]
    assert bc["real"]["steps"] == bc["real_plus_dreams"]["steps"] == 4  # the same number of gradient steps
    assert bc["real_plus_dreams"]["samples"] == bc["real"]["samples"] + dreams["bc_samples"]
    evaluation = saved["eval"]
    for name in ("real", "real_plus_dreams", "teacher"):
        # the manifest's reporting seeds
        assert evaluation[name]["episodes"] == 3 and evaluation[name]["eval_seeds"] == [5_100_000, 5_100_002]
    paired = evaluation["paired_difference"]
    assert set(paired) >= {"success_rate_difference", "success_rate_difference_t95", "final_coverage_difference"}
    for name in ("real", "real_plus_dreams"):
        assert load_policy_file(out / "policies" / f"dream_bc_pusht_{name}.safetensors").action_shape == (8, 2)
    assert json.loads(json.dumps(results["eval"])) == evaluation
