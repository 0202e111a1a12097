"""cosmos3_gym.rewards.calibration and benchmarks/reward_model_calibration.py: the reward-model score that counts as a
success, fitted on frames whose true success is known."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from cosmos3_gym.errors import InputError
from cosmos3_gym.rewards import fit_success_threshold, success_threshold_table
from cosmos3_gym.sim.pusht_sim import has_gym_pusht

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import reward_model_calibration
finally:
    sys.path.pop(0)


def test_table_counts_precision_recall_and_f1_per_threshold():
    scores = np.array([0.50, 0.90, 0.92, 0.93, 0.94])
    successes = np.array([False, False, True, True, False])
    rows = success_threshold_table(scores, successes, [0.91, 0.935, 0.99])
    assert [row["predicted"] for row in rows] == [3, 1, 0]
    assert rows[0]["precision"] == pytest.approx(2 / 3) and rows[0]["recall"] == 1.0
    assert rows[0]["f1"] == pytest.approx(0.8)
    assert rows[1]["precision"] == 0.0 and rows[1]["recall"] == 0.0 and rows[1]["f1"] == 0.0  # 0.94 is a failure
    assert rows[2] == {"threshold": 0.99, "predicted": 0, "precision": 0.0, "recall": 0.0, "f1": 0.0}


def test_fit_picks_the_best_f1_and_of_equals_the_higher_threshold():
    # A regressor that shrinks the top: successes score 0.92-0.94, never 0.95.
    rng = np.random.default_rng(0)
    successes = np.r_[np.ones(50, bool), np.zeros(200, bool)]
    scores = np.where(successes, rng.uniform(0.92, 0.94, 250), rng.uniform(0.0, 0.915, 250))
    best = fit_success_threshold(scores, successes)
    assert 0.915 < best["threshold"] <= 0.92 and best["f1"] == 1.0
    assert success_threshold_table(scores, successes, [0.95])[0]["recall"] == 0.0
    # Every threshold in (0.915, 0.92] separates perfectly; the higher is kept.
    assert fit_success_threshold(scores, successes, [0.916, 0.918, 0.92])["threshold"] == 0.92


@pytest.mark.parametrize("scores, successes, field", [
    (np.zeros((2, 2)), np.zeros((2, 2), bool), "scores"),
    ([0.1, 0.2], [True], "successes"),
    ([0.1, np.nan], [True, False], "scores"),
    ([0.1, 0.2], [0.5, 1], "successes"),
    ([0.1, 0.2], [False, False], "successes"),
])
def test_bad_input_names_the_field(scores, successes, field):
    with pytest.raises(InputError, match=field):
        fit_success_threshold(scores, successes)


@pytest.mark.skipif(not has_gym_pusht(), reason="needs gym-pusht")
def test_script_fits_a_threshold_the_built_in_reward_model_reaches_and_writes_it(tmp_path):
    from cosmos3_gym.envs.pusht import default_assets_dir

    assets = tmp_path / "pusht"
    shutil.copytree(default_assets_dir(), assets)
    meta_path = assets / "checkpoint" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["success_threshold"] = 0.95
    meta_path.write_text(json.dumps(meta))
    results = reward_model_calibration.main([
        "--assets", str(assets), "--episodes", "8", "--workers", "0", "--out", str(tmp_path / "out"), "--write"])
    fitted = results["fitted_on_fit_set"]["threshold"]
    check = results["sets"]["check"]
    assert results["checkpoint_success_threshold"] == 0.95
    assert check["success_frames"] > 0
    # The built-in reward model never scores a real success 0.95; the fitted threshold finds them.
    assert check["at"]["0.95"]["recall"] == 0.0
    assert fitted < 0.95 and check["at"][f"{fitted:g}"]["recall"] > 0
    assert json.loads(meta_path.read_text())["success_threshold"] == fitted
    assert (tmp_path / "out" / "reward_model_calibration_cpu.json").is_file()


def test_built_in_checkpoint_uses_the_calibrated_threshold():
    from cosmos3_gym.envs.pusht import load_pusht_assets, pusht_env_defaults

    # benchmarks/results/reward_model_calibration_cpu.json fitted it; 0.95 would never end an episode.
    assert pusht_env_defaults(load_pusht_assets())["success_threshold"] == 0.92


def test_another_reward_model_gets_gym_pushts_line_not_the_checkpoints_threshold():
    from cosmos3_gym.envs.pusht import pusht_env_arguments, pusht_env_defaults, load_pusht_assets

    own = pusht_env_defaults(load_pusht_assets())["reward_model"]
    assert pusht_env_arguments()["success_threshold"] == 0.92
    assert pusht_env_arguments(reward_model=own)["success_threshold"] == 0.92
    assert pusht_env_arguments(reward_model="pusht_geometric")["success_threshold"] == 0.95
    assert pusht_env_arguments(reward_model="pusht_geometric", success_threshold=0.9)["success_threshold"] == 0.9
