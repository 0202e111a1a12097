"""Imagined datasets (issue 45 item 3): ``dream`` rolls a policy in the world model and writes a LeRobot v3.0 dataset
(frames as video, actions, next.reward / next.done / next.success, the task) that this package's reader loads, and
``lerobot-dataset``'s ``LeRobotDataset`` where that package can be installed.

Episodes end deterministically (as in test_evaluation.py): a reward model scores 1 for the task "finish" and 0
otherwise; with ``success_threshold=0.5`` a "finish" slot succeeds and ends after every chunk, "go" slots run to
``max_episode_steps``.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_evaluation import image, make_vec_env

from cosmos3_gym.cli import main
from cosmos3_gym.data.lerobot import LeRobotDataset
from cosmos3_gym.errors import InputError
from cosmos3_gym.rl.dream import dream


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


# lerobot-dataset 0.4.4 (the standalone LeRobotDataset, import name ledataset; the only release) pins
# huggingface-hub < 0.36; this package needs huggingface_hub >= 1.33 (transformers 5), so pip cannot install both.
LEROBOT_DATASET_REASON = (
    "lerobot-dataset 0.4.4 (PyPI, import name ledataset) cannot be installed next to this package: it pins "
    "huggingface-hub<0.36, this package needs huggingface_hub>=1.33"
)


class Stats:
    """Action statistics (minmax): raw = (x + 1) / 2 * 10 + 100."""

    mode = "minmax"
    offset, scale = np.array([100.0, 100.0]), np.array([10.0, 10.0])

    def denormalize(self, actions):
        return (actions + 1.0) / 2.0 * self.scale + self.offset


def ramp_actions(observations):
    count = observations["image"].shape[0]
    return np.broadcast_to(np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2), (count, 4, 2)).copy()


@pytest.fixture(scope="module")
def dreamed(engine, tmp_path_factory):
    # raw units, as a checkpoint's action_stats.json gives them
    env = make_vec_env(engine, action_stats={"action": {"min": [100.0, 100.0], "max": [110.0, 110.0]}})
    path = tmp_path_factory.mktemp("dream") / "dataset"
    result = dream(env, ramp_actions, 5, f"lerobot:{path}", seed=2, crf=0, progress=False)
    env.close()
    return result


def test_dream_writes_a_lerobot_dataset_our_reader_loads(dreamed):
    report, path = dreamed.report, dreamed.path
    assert dreamed.episodes_written == 5 and len(report.episodes) == 5
    dataset = LeRobotDataset(path)
    info = json.loads((path / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["features"]["observation.image"]["dtype"] == "video"
    assert {"action", "next.reward", "next.done", "next.success"} <= set(info["features"])
    table = pq.read_table(sorted((path / "data").rglob("*.parquet"))[0]).to_pydict()
    columns = {key: np.asarray(value) for key, value in table.items()}
    for i, result in enumerate(report.episodes):
        rows = {key: value[columns["episode_index"] == i] for key, value in columns.items()}
        episode = dataset.load(i)
        steps = result.length
        assert len(dataset.read_rows(i)["actions"]) == len(rows["index"]) == steps * 4 + 1  # frames: start + 4 per step
        assert episode.frames.shape == (steps * 4 + 1, 96, 128, 3) and episode.task == result.task
        assert episode.success is result.success and (result.task == "finish") is result.success
        # raw actions: the ramp through the statistics, one per frame transition
        expected = Stats().denormalize(np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2))
        assert np.allclose(episode.actions, np.tile(expected, (steps, 1)), atol=1e-4)
        rewards = rows["next.reward"]
        assert rewards.sum() == pytest.approx(result.episode_return)  # each step's reward once, on its last row
        assert np.flatnonzero(rewards).tolist() == ([3] if result.task == "finish" else [])
        assert rows["next.done"].tolist() == [False] * (len(rewards) - 1) + [True]
    first = dataset.read_frames(0, 0, 1)[0].astype(int)
    assert np.abs(first - image(0)).mean() < 2.0  # crf 0: the start frame, up to the colour conversion
    stats = json.loads((path / "meta" / "stats.json").read_text())["action"]
    assert stats["min"] == [100.0, 100.0] and stats["max"] == [110.0, 110.0]  # the env's normalisation


def test_the_dataset_reads_with_lerobot_dataset(dreamed):
    """The other half of the check: the standalone LeRobotDataset loads what dream wrote."""
    pytest.importorskip("ledataset", reason=LEROBOT_DATASET_REASON)
    from ledataset.datasets.lerobot_dataset import LeRobotDataset as TheirDataset

    theirs = TheirDataset("local/dream", root=dreamed.path)
    assert theirs.num_episodes == 5 and theirs.num_frames == sum(e.length * 4 + 1 for e in dreamed.report.episodes)
    item = theirs[0]
    assert tuple(item["observation.image"].shape) == (3, 96, 128)
    assert item["task"] == dreamed.report.episodes[0].task
    assert "next.reward" in item and "next.success" in item


def test_keep_successes_and_inverse_dynamics_labels(engine, tmp_path):
    env = make_vec_env(engine)
    result = dream(
        env, ramp_actions, 6, tmp_path / "successes", keep="successes", label_actions="inverse-dynamics", progress=False
    )
    env.close()
    assert result.episodes_written == 2 == sum(bool(e.success) for e in result.report.episodes)
    dataset = LeRobotDataset(tmp_path / "successes")
    assert len(dataset) == 2 and all(dataset.load(i).task == "finish" for i in range(2))
    labels = dataset.load(0).actions  # inferred from the frames by the (random) inverse-dynamics model
    assert labels.shape == (4, 2) and not np.allclose(labels, ramp_actions({"image": np.zeros((1,))})[0])
    with pytest.raises(InputError, match="none of the 1 episodes is kept"):
        env = make_vec_env(engine, num_envs=1, task="go")
        try:
            dream(env, ramp_actions, 1, tmp_path / "none", keep="successes", progress=False)
        finally:
            env.close()
    with pytest.raises(InputError, match="label_actions"):
        dream(None, ramp_actions, 1, tmp_path / "x", label_actions="guess")


def test_dream_command_on_the_builtin_model(tmp_path, capsys):
    out = tmp_path / "dream"
    assert (
        main(
            [
                "dream",
                "--policy",
                "random",
                "--episodes",
                "3",
                "--num-envs",
                "2",
                "--max-episode-steps",
                "2",
                "--num-steps",
                "1",
                "--device",
                "cpu",
                "--seed",
                "1",
                "--out",
                f"lerobot:{out}",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"wrote 3 (all, actions from policy) to {out}" in printed and "success rate" in printed
    dataset = LeRobotDataset(out)
    assert len(dataset) == 3 and dataset.lengths == [17, 17, 17] and dataset.fps == 10.0
    episode = dataset.load(2)
    assert episode.frames.shape == (17, 256, 256, 3) and episode.task.startswith("push the T")
    assert episode.success is False
    stats = json.loads((out / "meta" / "stats.json").read_text())["action"]
    assert np.all(np.asarray(stats["min"]) <= episode.actions.min(0) + 1e-3)
    assert np.all(episode.actions.max(0) <= np.asarray(stats["max"]) + 1e-3)
    # A folder that holds something is refused before any model loads.
    started = time.perf_counter()
    assert main(["dream", "--policy", "random", "--out", f"lerobot:{out}"]) == 2
    assert "already holds a LeRobot dataset" in capsys.readouterr().err
    assert main(["dream", "--policy", "nope", "--out", str(tmp_path / "new")]) == 2
    assert "policy: 'nope' is not one of" in capsys.readouterr().err
    assert time.perf_counter() - started < 20
