"""cosmos3_gym.rewards.calibration, benchmarks/reward_model_calibration.py and train_pusht.py's success_threshold stage:
the reward-model score that counts as a success, fitted on frames whose true success is known."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosmos3_gym.errors import InputError
from cosmos3_gym.rewards import fit_success_threshold, success_threshold_table
from cosmos3_gym.rewards.calibration import calibrate_success_threshold, score_episode_files
from cosmos3_gym.tasks.pusht.sim import has_gym_pusht

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import reward_model_calibration
finally:
    sys.path.pop(0)


def _train_pusht():
    recipes = str(Path(__file__).resolve().parents[1] / "benchmarks" / "recipes")
    sys.path.insert(0, recipes)
    try:
        import train_pusht
    finally:
        sys.path.remove(recipes)
    return train_pusht


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


@pytest.mark.sim
@pytest.mark.skipif(not has_gym_pusht(), reason="needs gym-pusht")
def test_script_fits_a_threshold_the_built_in_reward_model_reaches_and_writes_it(tmp_path):
    from cosmos3_gym.tasks.pusht.env import default_assets_dir

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
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets, pusht_env_defaults

    # benchmarks/results/fidelity/reward_model_calibration_cpu.json fitted it; 0.95 would never end an episode.
    assert pusht_env_defaults(load_pusht_assets())["success_threshold"] == 0.92


def test_another_reward_model_gets_gym_pushts_line_not_the_checkpoints_threshold():
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets, pusht_env_arguments, pusht_env_defaults

    own = pusht_env_defaults(load_pusht_assets())["reward_model"]
    assert pusht_env_arguments()["success_threshold"] == 0.92
    assert pusht_env_arguments(reward_model=own)["success_threshold"] == 0.92
    assert pusht_env_arguments(reward_model="pusht_geometric")["success_threshold"] == 0.95
    assert pusht_env_arguments(reward_model="pusht_geometric", success_threshold=0.9)["success_threshold"] == 0.9


def test_calibrate_fits_on_one_set_checks_on_the_other_and_falls_back_without_successes():
    fit = calibrate_success_threshold([0.5, 0.93, 0.94, 0.6], [False, True, True, False],
                                      [0.93, 0.7, 0.91], [True, False, True], fallback=0.95)
    assert fit["success_threshold"] == 0.93 and fit["fitted"] and fit["reason"] is None
    assert fit["fit"] == {"frames": 4, "success_frames": 2, "threshold": 0.93, "predicted": 2, "precision": 1.0,
                          "recall": 1.0, "f1": 1.0}
    assert fit["check"]["frames"] == 3 and fit["check"]["predicted"] == 1 and fit["check"]["recall"] == 0.5
    # no success to fit on (or too few): the fallback, and why; the check set is still measured at it
    none = calibrate_success_threshold([0.5, 0.96], [False, False], [0.97], [False], fallback=0.95)
    assert none["success_threshold"] == 0.95 and not none["fitted"] and "0 success frames" in none["reason"]
    assert none["check"] == {"frames": 1, "success_frames": 0, "threshold": 0.95, "predicted": 1, "precision": 0.0,
                             "recall": 0.0, "f1": 0.0}
    few = calibrate_success_threshold([0.5, 0.93], [False, True], fallback=0.95, min_success_frames=2)
    assert few["success_threshold"] == 0.95 and "1 success frame among the 2 fit frames" in few["reason"]
    assert few["check"] is None
    assert "no frames" in calibrate_success_threshold([], [], fallback=0.95)["reason"]
    with pytest.raises(InputError, match="successes"):  # without a fallback, nothing to fit is an error
        calibrate_success_threshold([0.5], [False])


class _PixelRewardModel(torch.nn.Module):
    """Scores a frame by its top-left red value: the tests write the score they want into the frame."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def score_frames(self, images):
        return images[:, 0, 0, 0]


def _write_episode(path: Path, scores, coverage):
    frames = np.zeros((len(scores), 4, 4, 3), np.uint8)
    frames[:, 0, 0, 0] = np.round(np.asarray(scores) * 255)
    np.savez(path, frames=frames, coverage=np.asarray(coverage, np.float32))


def test_score_episode_files_scores_every_labelled_frame(tmp_path):
    _write_episode(tmp_path / "a.npz", [0.2, 0.4, 0.6], [0.1, 0.5])  # a frame beyond the labels is left out
    _write_episode(tmp_path / "b.npz", [1.0], [0.96])
    coverage, scores = score_episode_files([tmp_path / "a.npz", tmp_path / "b.npz"], _PixelRewardModel(),
                                           batch_size=1)
    np.testing.assert_allclose(coverage, [0.1, 0.5, 0.96], atol=1e-6)
    np.testing.assert_allclose(scores, [51 / 255, 102 / 255, 1.0])
    assert score_episode_files([], _PixelRewardModel())[0].size == 0


def _pusht_work(tmp_path: Path, success: bool = True) -> tuple[Path, Path]:
    """8 training episodes and 2 held-out ones, 12 frames each, the last 4 of each successes (coverage > 0.95) where
    ``success``. Real successes score 0.93 (a regressor shrinks the top), failures 0.6 -- except in the episodes the
    reward model trained on (read or replayed), where successes score 0.99 and failures 0.94: calibrating on those would
    not give precision and recall 1."""
    work = tmp_path / "work"
    coverage = [0.3, 0.5, 0.7, 0.8, 0.85, 0.9, 0.92, 0.93] + ([0.96, 0.97, 0.98, 0.99] if success else [0.94] * 4)
    for name, count in (("dataset", 8), ("heldout", 2)):
        (work / name / "episodes").mkdir(parents=True)
        for index in range(count):
            seen = name == "dataset" and index % 2 == 0  # --rm-episodes 4 reads every other one; 0 is replayed
            high, low = (0.99, 0.94) if seen else (0.93, 0.6)
            _write_episode(work / name / "episodes" / f"episode_{index:06d}.npz",
                           [high if c > 0.95 else low for c in coverage], coverage)
    assets = work / "assets" / "pusht"
    (assets / "checkpoint").mkdir(parents=True)
    (assets / "checkpoint" / "meta.json").write_text(json.dumps({"task": "push", "success_threshold": 0.95}))
    return work, assets


def _stage_args(**overrides):
    return SimpleNamespace(**{"rm_episodes": 4, "rm_rollout_episodes": 1, "rm_calibration_episodes": 128,
                              "device": "cpu", **overrides})


def test_train_pusht_calibrates_the_threshold_on_episodes_its_reward_model_never_saw(tmp_path, monkeypatch):
    train_pusht = _train_pusht()
    work, assets = _pusht_work(tmp_path)
    loaded = []
    monkeypatch.setattr(train_pusht, "ClassifierRewardModel", SimpleNamespace(
        load=lambda path, device: loaded.append(Path(path)) or _PixelRewardModel()))
    args = _stage_args()
    assert [p.name for p in train_pusht.reward_model_episodes(args, work)] == [
        f"episode_{i:06d}.npz" for i in (0, 2, 4, 6)]
    report = train_pusht.success_threshold_stage(args, work, assets)

    assert loaded == [assets / "checkpoint" / "reward_model"]
    meta = json.loads((assets / "checkpoint" / "meta.json").read_text())
    # 0.95 would never mark a success of this reward model; the calibrated threshold marks exactly them
    assert meta == {"task": "push", "success_threshold": 0.925} and report["success_threshold"] == 0.925
    assert report["fitted"] and report["reason"] is None and report["previous_success_threshold"] == 0.95
    # fit: training episodes 1 and 5 and held-out 0; check: 3 and 7 and held-out 1 (none the reward model saw)
    assert report["episodes"] == {"fit": 3, "check": 3, "training_unseen_by_reward_model": 4, "heldout": 2}
    for name in ("fit", "check"):
        assert report[name] == {"frames": 36, "success_frames": 12, "threshold": 0.925, "predicted": 12,
                                "precision": 1.0, "recall": 1.0, "f1": 1.0}
    json.dumps(report)  # goes into the results JSON

    # --rm-calibration-episodes caps the training episodes (spread over the dataset); the held-out ones stay
    episodes = train_pusht.calibration_episodes(_stage_args(rm_calibration_episodes=2), work)
    assert [p.parent.parent.name + "/" + p.name[-6:-4] for p in episodes["fit"] + episodes["check"]] == [
        "dataset/01", "heldout/00", "dataset/05", "heldout/01"]


def test_train_pusht_keeps_gym_pushts_threshold_without_successes_and_says_why(tmp_path, monkeypatch):
    train_pusht = _train_pusht()
    work, assets = _pusht_work(tmp_path, success=False)
    monkeypatch.setattr(train_pusht, "ClassifierRewardModel",
                        SimpleNamespace(load=lambda path, device: _PixelRewardModel()))
    report = train_pusht.success_threshold_stage(_stage_args(), work, assets)
    assert json.loads((assets / "checkpoint" / "meta.json").read_text())["success_threshold"] == 0.95
    assert not report["fitted"] and report["success_threshold"] == 0.95
    assert report["reason"].startswith("0 success frames among the 36 fit frames")


def test_train_pusht_reward_model_part_calibrates_the_assets_it_retrains(tmp_path, monkeypatch):
    train_pusht = _train_pusht()
    ran = []
    for name in ("simulate", "reward_model_stage", "success_threshold_stage"):
        monkeypatch.setattr(train_pusht, name,
                            lambda *args, _name=name, **kwargs: ran.append((_name, args[2:3])) or {})
    monkeypatch.setattr(train_pusht, "write_results", lambda *args, **kwargs: None)
    train_pusht.main(["--part", "reward-model", "--assets", str(tmp_path / "model"), "--out", str(tmp_path / "out"),
                      "--work", str(tmp_path / "work")])
    assert ran == [("simulate", ()), ("reward_model_stage", (tmp_path / "model",)),
                   ("success_threshold_stage", (tmp_path / "model",))]
