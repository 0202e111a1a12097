"""The PushT pieces: T geometry and scripted pusher, dataset files, the PushT-v0 factory on a tiny stand-in model,
and (where gym-pusht is installed) data generation and the side-by-side video against the real simulator."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import cosmos3_gym  # noqa: F401  (registers the env ids)
from cosmos3_gym.data import load_initial_states
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.media import write_video
from cosmos3_gym.processor import ActionStats
from cosmos3_gym.rewards import ClassifierRewardModel
from cosmos3_gym.tasks.pusht import env as pusht_env
from cosmos3_gym.tasks.pusht import episodes as pusht
from cosmos3_gym.tasks.pusht import policies as pusht_policies

FRAME = 64  # tiny stand-in frames: 64 x 64 stays 64 x 64 at tier 256 (4 x 4 latents)


# ---------------------------------------------------------------------------------------------------------------
# Geometry and policies (no simulator)
# ---------------------------------------------------------------------------------------------------------------


def test_tee_outline_is_the_union_of_gym_pushts_two_rectangles():
    # Shoelace area of the counter-clockwise outline: bar 120 x 30 plus stem 30 x 90, positive (counter-clockwise).
    x, y = pusht.TEE_OUTLINE.T
    assert 0.5 * np.sum(x * np.roll(y, -1) - np.roll(x, -1) * y) == pytest.approx(120 * 30 + 30 * 90)
    pose = np.array([100.0, 200.0, 0.7])
    outline = pusht.tee_outline(pose)
    rotated = pusht.rotation(0.7) @ np.array([60.0, 30.0]) + pose[:2]
    np.testing.assert_allclose(outline[2], rotated)
    np.testing.assert_allclose(pusht.tee_center(pose), pose[:2] + pusht.rotation(0.7) @ [0.0, 45.0])


def test_contact_candidates_lie_on_the_outline_with_outward_normals():
    pose = np.array([250.0, 180.0, -2.1])
    points, normals = pusht.contact_candidates(pose)
    outline = pusht.tee_outline(pose)
    np.testing.assert_allclose(pusht.distance_to_outline(points, outline), 0.0, atol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(normals, axis=1), 1.0)
    assert (pusht.distance_to_outline(points + 3.0 * normals, outline) > 2.9).all()  # outside
    assert (pusht.distance_to_outline(points - 3.0 * normals, outline) < 0.0).all()  # inside
    # The same count at any pose, so an index names the same place on the T.
    assert len(pusht.contact_candidates(np.array([0.0, 0.0, 1.234]))[0]) == len(points)


def test_signed_distance_is_negative_inside_and_exact_outside():
    pose = np.array([0.0, 0.0, 0.0])
    outline = pusht.tee_outline(pose)
    distances = pusht.distance_to_outline(np.array([[0.0, 15.0], [0.0, 100.0], [0.0, -10.0], [40.0, 60.0]]), outline)
    np.testing.assert_allclose(distances, [-15.0, -15.0, 10.0, 25.0])


def test_scripted_pusher_pushes_from_the_side_facing_away_from_the_goal():
    pusher = pusht.ScriptedPusher(np.random.default_rng(0), max_step=1e6)
    block = pusht.GOAL_POSE + np.array([-150.0, 0.0, 0.0])  # goal orientation, 150 px left of the goal
    agent = pusht.tee_center(block) + np.array([-100.0, 0.0])  # left of the T: the contact side is reachable
    target = pusher(agent, block)
    points, normals = pusht.contact_candidates(block)
    contact, normal = points[pusher._contact], normals[pusher._contact]
    assert normal[0] < -0.5  # a contact on the T's left side: pushing it moves the block right, to the goal
    # The agent walks to the contact's approach point on the outside, not through the T.
    assert pusht.distance_to_outline(target[None].astype(float), pusht.tee_outline(block))[0] > pusht.AGENT_RADIUS
    assert np.dot(target - contact, normal) > 0


def test_scripted_pusher_walks_round_the_t_instead_of_through_it():
    pusher = pusht.ScriptedPusher(np.random.default_rng(0), max_step=1e6)
    block = pusht.GOAL_POSE + np.array([-150.0, 0.0, 0.0])
    center = pusht.tee_center(block)
    agent = center + np.array([110.0, 0.0])  # on the goal side: the contact is on the far side
    target = pusher(agent, block)
    outline = pusht.tee_outline(block)
    path = agent + np.linspace(0, 1, 50)[:, None] * (target - agent)
    assert (pusht.distance_to_outline(path, outline) > pusht.AGENT_RADIUS).all()
    assert np.linalg.norm(target - center) == pytest.approx(pusher.ORBIT_RADIUS)


def test_scripted_pusher_stands_still_at_the_goal_and_limits_steps():
    agent = np.array([100.0, 100.0])
    pusher = pusht.ScriptedPusher(np.random.default_rng(0))
    np.testing.assert_allclose(pusher(agent, pusht.GOAL_POSE), agent)
    far = pusht.ScriptedPusher(np.random.default_rng(0), max_step=7.0)(agent, pusht.GOAL_POSE + [150.0, 0.0, 0.0])
    assert np.linalg.norm(far - agent) == pytest.approx(7.0, abs=1e-4)
    assert far.dtype == np.float32


def test_random_waypoints_and_replay_stay_on_the_table():
    rng = np.random.default_rng(1)
    policy = pusht.RandomWaypoints(rng)
    replay = pusht.Replay(np.array([[0.0, 0.0], [512.0, 512.0]], np.float32), rng, noise=50.0)
    agent = np.array([256.0, 256.0])
    for _ in range(50):
        for action in (policy(agent, pusht.GOAL_POSE), replay(agent, pusht.GOAL_POSE)):
            assert action.shape == (2,) and (0 <= action).all() and (action <= 512).all()
        agent = policy(agent, pusht.GOAL_POSE).astype(float)


def test_episode_policies_depend_only_on_seed_and_index():
    mix = pusht._check_policy_mix(None)
    draws = [pusht.episode_policy(3, index, mix)[:2] for index in range(200)]
    assert draws == [pusht.episode_policy(3, index, mix)[:2] for index in range(200)]
    families = [family for family, _ in draws]
    assert set(families) == set(pusht.DEFAULT_POLICY_MIX)
    assert {noise for family, noise in draws if family == "scripted"} == set(pusht.SCRIPTED_NOISE_LEVELS)
    with pytest.raises(InputError, match="policy_mix"):
        pusht._check_policy_mix({"teleport": 1.0})
    with pytest.raises(InputError, match="policy_mix"):
        pusht._check_policy_mix({"random": 0.0})


def test_dataset_statistics_files_are_what_action_stats_reads(tmp_path):
    actions = np.array([[0.0, 10.0], [512.0, 30.0], [256.0, 20.0]], np.float32)
    pusht.write_dataset_files(tmp_path, {"domain": "pusht", "action_normalization": "minmax"}, actions)
    stats = json.loads((tmp_path / "stats.json").read_text())["action"]
    assert stats["min"] == [0.0, 10.0] and stats["max"] == [512.0, 30.0]
    np.testing.assert_allclose(stats["mean"], [256.0, 20.0])
    np.testing.assert_allclose(stats["std"], actions.std(axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats["q01"], np.quantile(actions, 0.01, axis=0), rtol=1e-6)
    action_stats = ActionStats.from_json(tmp_path / "stats.json", mode="minmax")
    np.testing.assert_allclose(action_stats.normalize(actions[:2]), [[-1.0, -1.0], [1.0, 1.0]], atol=1e-6)
    assert json.loads((tmp_path / "meta.json").read_text())["domain"] == "pusht"
    with pytest.raises(InputError, match="actions"):
        pusht.action_statistics(np.zeros((0, 2)))


def test_psnr():
    a = np.zeros((2, 4, 4, 3), np.uint8)
    b = a.copy()
    assert pusht.psnr(a, b) == math.inf
    b[..., 0] = 255  # a third of the values off by the full range: MSE 1/3
    assert pusht.psnr(a, b) == pytest.approx(10 * math.log10(3))


# ---------------------------------------------------------------------------------------------------------------
# cosmos3_gym/PushT-v0 on a tiny stand-in model
# ---------------------------------------------------------------------------------------------------------------


def build_tiny_pusht_assets(root: Path, tiny_checkpoint: Path) -> Path:
    """A folder in the layout of cosmos3_gym/assets/pusht with the tiny random checkpoint and reward model."""
    shutil.copytree(tiny_checkpoint, root / "checkpoint")
    meta = {"domain": "pusht", "raw_action_dim": 2, "fps": 10.0, "chunk": 4, "resolution_tier": 256,
            "image_size": [FRAME, FRAME], "num_steps": 2, "guidance_scale": 1.0, "task": pusht.TASK,
            "success_threshold": 0.95, "max_episode_steps": 3}
    (root / "checkpoint" / "meta.json").write_text(json.dumps(meta))
    stats = {"action": {"min": [10.0, 20.0], "max": [500.0, 490.0]}}
    (root / "checkpoint" / "action_stats.json").write_text(json.dumps(stats))
    torch.manual_seed(0)
    # The reward model and the start frames live inside the checkpoint (issue 43: meta.json paths stay inside it).
    ClassifierRewardModel(input_size=16, channels=(4, 8)).save(root / pusht_env.REWARD_MODEL_DIR)
    frames = np.random.default_rng(0).integers(0, 256, size=(3, FRAME, FRAME, 3), dtype=np.uint8)
    np.savez(root / pusht_env.INITIAL_STATES_FILE, frames=frames, task=np.asarray(pusht.TASK), sim_seeds=np.arange(3))
    return root


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory, tiny_checkpoint) -> Path:
    return build_tiny_pusht_assets(tmp_path_factory.mktemp("pusht_assets"), tiny_checkpoint)


def test_make_without_the_builtin_model_says_it_is_not_installed(tmp_path, monkeypatch):
    monkeypatch.setenv(pusht_env.ASSETS_ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="built-in PushT world model is not installed.*train_pusht.py"):
        gym.make("cosmos3_gym/PushT-v0")
    assert pusht_env.builtin_checkpoint_dir() is None
    (tmp_path / "partial" / "checkpoint").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="lacks checkpoint/meta.json.*reward_model/config.json"):
        gym.make("cosmos3_gym/PushT-v0", assets_dir=tmp_path / "partial")


def test_make_builds_the_env_from_the_assets_defaults(tiny_assets):
    env = gym.make("cosmos3_gym/PushT-v0", assets_dir=tiny_assets)
    try:
        settings = env.unwrapped.settings
        assert (settings.domain, settings.raw_action_dim, settings.chunk, settings.resolution_tier) == \
            ("pusht", 2, 4, 256)
        assert (settings.num_steps, settings.guidance_scale, settings.fps, settings.max_episode_steps) == \
            (2, 1.0, 10.0, 3)
        assert settings.success_threshold == 0.95 and len(env.unwrapped.initial_states) == 3
        assert env.action_space.shape == (4, 2) and env.observation_space["image"].shape == (FRAME, FRAME, 3)
        observation, info = env.reset(seed=0)
        assert info["task"] == pusht.TASK and observation["image"].shape == (FRAME, FRAME, 3)
        observation, reward, terminated, truncated, info = env.step(env.action_space.sample())
        assert 0.0 <= reward <= 1.0 and info["score"] == reward  # the classifier's probability
        np.testing.assert_array_less(info["raw_action"], 500.0 + 1e-3)  # denormalised with action_stats.json
        assert observation["image"].dtype == np.uint8
    finally:
        env.close()


def test_env_var_arguments_and_vector_env(tiny_assets, monkeypatch):
    monkeypatch.setenv(pusht_env.ASSETS_ENV_VAR, str(tiny_assets))
    assert pusht_env.builtin_checkpoint_dir() == tiny_assets / "checkpoint"
    envs = gym.make_vec("cosmos3_gym/PushT-v0", num_envs=2, num_steps=1, task="push it")
    try:
        assert envs.num_envs == 2 and envs.unwrapped.settings.num_steps == 1
        _, infos = envs.reset(seed=0)
        assert list(infos["task"]) == ["push it", "push it"]
        _, rewards, _, _, _ = envs.step(envs.action_space.sample())
        assert rewards.shape == (2,)
    finally:
        envs.close()


def test_broken_initial_states_file_is_a_checkpoint_error(tiny_assets, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_assets, broken)
    np.savez(broken / pusht_env.INITIAL_STATES_FILE, frames=np.zeros((2, 8, 8), np.uint8))
    with pytest.raises(CheckpointError, match="initial_states.npz 'frames' must be uint8"):
        pusht_env.make_pusht_env(assets_dir=broken)


# ---------------------------------------------------------------------------------------------------------------
# With the real simulator (gym-pusht is optional: CI skips these)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.sim
def test_geometry_matches_the_simulator():
    pytest.importorskip("gym_pusht")
    sim = pusht.PushTSim((64, 64))
    try:
        sim.reset(5)
        assert sim.fps == pusht.SIM_FPS
        env = sim.env
        keypoints = np.array([env.block.local_to_world(tuple(v)) for v in pusht.TEE_OUTLINE])
        np.testing.assert_allclose(pusht.tee_outline(sim.block_pose), keypoints, atol=1e-6)
        center = env.block.local_to_world(env.block.center_of_gravity)
        np.testing.assert_allclose(pusht.tee_center(sim.block_pose), center, atol=1e-6)
        np.testing.assert_allclose(pusht.GOAL_POSE, env.goal_pose)
        assert env.success_threshold == pusht.SUCCESS_COVERAGE
    finally:
        sim.close()


@pytest.mark.sim
def test_scripted_pusher_solves_some_episodes_in_the_simulator():
    pytest.importorskip("gym_pusht")
    sim = pusht.PushTSim((32, 32))
    try:
        coverage = [
            pusht.rollout_episode(sim, pusht.ScriptedPusher(np.random.default_rng(seed)), seed, 128)["coverage"]
            for seed in range(4)
        ]
    finally:
        sim.close()
    final = np.array([c[-1] for c in coverage])
    assert final.mean() > 0.6 and (final > 0.9).any()  # random play rarely gets past 0.1
    assert all(c[-1] > c[0] for c in coverage)


@pytest.mark.sim
def test_generate_dataset_writes_the_documented_layout(tmp_path):
    pytest.importorskip("gym_pusht")
    import cv2

    # The parent has used OpenCV's thread pool before it forks the workers (a forked worker must not resize it).
    cv2.resize(np.zeros((1024, 1024, 3), np.uint8), (512, 512))
    out = pusht.generate_pusht_dataset(
        tmp_path / "data", 3, steps_per_episode=6, image_size=(32, 48), workers=2, seed=7, progress=False,
        policy_mix={"random": 1, "scripted": 1, "replay": 1},
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["domain"] == "pusht" and meta["raw_action_dim"] == 2 and meta["fps"] == 10.0
    assert meta["image_size"] == [32, 48] and meta["num_episodes"] == 3 and sum(meta["policies"].values()) == 3
    files = sorted((out / "episodes").iterdir())
    assert [f.name for f in files] == [f"episode_{i:06d}.npz" for i in range(3)]
    all_actions = []
    for path in files:
        with np.load(path) as episode:
            assert episode["frames"].shape == (7, 32, 48, 3) and episode["frames"].dtype == np.uint8
            assert episode["actions"].shape == (6, 2) and episode["actions"].dtype == np.float32
            assert episode["rewards"].shape == (6,) and episode["coverage"].shape == (7,)
            assert str(episode["task"]) == pusht.TASK and episode["success"].dtype == bool
            all_actions.append(episode["actions"])
            # Frame 0 is the simulator's start for the recorded seed; replaying the actions gives the same frames.
            sim = pusht.PushTSim((32, 48))
            frames = [sim.reset(int(episode["sim_seed"]))] + [sim.step(a) for a in episode["actions"]]
            np.testing.assert_array_equal(np.stack(frames), episode["frames"])
            sim.close()
    stats = json.loads((out / "stats.json").read_text())["action"]
    np.testing.assert_allclose(stats["max"], np.concatenate(all_actions).max(axis=0))
    # The same seed gives the same data whatever the number of workers.
    again = pusht.generate_pusht_dataset(
        tmp_path / "again", 3, steps_per_episode=6, image_size=(32, 48), workers=0, seed=7, progress=False,
        policy_mix={"random": 1, "scripted": 1, "replay": 1},
    )
    with np.load(files[2]) as first, np.load(again / "episodes" / files[2].name) as second:
        np.testing.assert_array_equal(first["actions"], second["actions"])
    with pytest.raises(InputError, match="already holds episodes"):
        pusht.generate_pusht_dataset(out, 1, steps_per_episode=2, workers=0, progress=False)


@pytest.mark.sim
def test_side_by_side_runs_the_simulator_and_the_model_from_the_same_start(tiny_assets, tmp_path):
    pytest.importorskip("gym_pusht")
    result = pusht.side_by_side(tmp_path / "demo.mp4", seed=3, num_chunks=2, assets_dir=tiny_assets)
    assert result["mode"] == "side_by_side" and result["num_frames"] == 1 + 2 * 4
    assert len(result["psnr_per_chunk"]) == 2 and Path(result["path"]).stat().st_size > 0


def test_side_by_side_without_the_simulator_shows_the_model_alone(tiny_assets, tmp_path, monkeypatch):
    monkeypatch.setattr(pusht, "has_gym_pusht", lambda: False)
    result = pusht.side_by_side(tmp_path / "demo.gif", seed=1, num_chunks=1, assets_dir=tiny_assets)
    assert result["mode"] == "world_model_only" and result["num_frames"] == 5
    assert Path(result["path"]).stat().st_size > 0


@pytest.mark.sim
def test_write_video_falls_back_to_opencv_without_imageio_ffmpeg(tmp_path, monkeypatch):
    cv2 = pytest.importorskip("cv2")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else find_spec(
        name, *a))
    frames = np.zeros((5, 32, 48, 3), np.uint8)
    frames[:, :, :24, 0] = 255  # left half red
    path = write_video(tmp_path / "clip.mp4", frames, fps=10)
    capture = cv2.VideoCapture(str(path))
    ok, first = capture.read()
    assert path.suffix == ".mp4" and ok and first.shape == (32, 48, 3)
    assert first[16, 5, 2] > 200 and first[16, 40, 2] < 50  # BGR: red on the left only
    capture.release()


def test_write_video_writes_a_gif_when_cv2_has_no_video_writer(tmp_path, monkeypatch):
    """GPU hosts carry a cv2 stand-in (resize only): without imageio-ffmpeg the video becomes a GIF, not a crash."""
    import importlib.util
    import sys
    import types

    import imageio.v3 as iio

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else find_spec(
        name, *a))
    monkeypatch.setitem(sys.modules, "cv2", types.ModuleType("cv2"))  # imports, but has no VideoWriter
    frames = np.zeros((4, 16, 24, 3), np.uint8)
    for i in range(4):  # distinct frames (a GIF writer may merge equal ones): a red band moving right
        frames[i, :, 4 * i : 4 * i + 8, 0] = 255
    path = write_video(tmp_path / "clip.mp4", frames, fps=10)
    assert path == tmp_path / "clip.gif"
    back = iio.imread(path, index=None)
    assert back.shape[:3] == (4, 16, 24)
    assert back[0, 8, 2, 0] > 200 and back[0, 8, 20, 0] < 50 and back[3, 8, 14, 0] > 200 and back[3, 8, 2, 0] < 50


def import_train_pusht():
    """benchmarks/recipes/train_pusht.py as a module (the recipes are scripts, not a package)."""
    import sys

    recipes = str(Path(__file__).resolve().parents[1] / "benchmarks" / "recipes")
    sys.path.insert(0, recipes)
    try:
        import train_pusht
    finally:
        sys.path.remove(recipes)
    return train_pusht


def test_train_pusht_trains_on_the_episodes_and_the_self_forcing_samples_side_by_side(tmp_path):
    """--wm-self-forcing-rollouts: the world model trains on one dataset whose episodes are links to the simulated
    episodes and the samples, normalised with the simulated dataset's statistics; the option needs --wm-init."""
    train_pusht = import_train_pusht()
    with pytest.raises(SystemExit):
        train_pusht.parse_args(["--out", str(tmp_path), "--wm-self-forcing-rollouts", "2"])
    work = tmp_path / "work"
    for name, episodes in (("dataset", ["episode_000000", "episode_000001"]), ("self_forcing", ["episode_sf_000000"])):
        (work / name / "episodes").mkdir(parents=True)
        for stem in episodes:
            (work / name / "episodes" / f"{stem}.npz").write_bytes(stem.encode())
        (work / name / "meta.json").write_text(json.dumps({"from": name}))
        (work / name / "stats.json").write_text(json.dumps({"stats": name}))
    args = train_pusht.parse_args(["--out", str(tmp_path)])
    assert train_pusht.training_dataset(args, work) == work / "dataset"
    merged = train_pusht.merge_episode_datasets(work / "dataset_with_self_forcing", work / "dataset",
                                                work / "self_forcing")
    assert train_pusht.training_dataset(args, work) == merged
    links = sorted((merged / "episodes").iterdir())
    assert [link.read_bytes() for link in links] == [b"episode_000000", b"episode_000001", b"episode_sf_000000"]
    assert json.loads((merged / "stats.json").read_text()) == {"stats": "dataset"}
    with pytest.raises(InputError, match="episode_000000.npz is in two"):
        train_pusht.merge_episode_datasets(tmp_path / "twice", work / "dataset", work / "dataset")


def test_train_pusht_starts_a_fine_tune_from_an_installed_model_folder(tiny_assets, tmp_path):
    train_pusht = import_train_pusht()
    work = tmp_path / "work"
    (work / "assets" / "pusht").mkdir(parents=True)  # main() creates it before unpacking
    (work / "vae").mkdir()  # a stale VAE from an earlier run in the same --work is replaced
    (work / "vae" / "stale.json").write_text("{}")

    train_pusht.unpack_first_part(tiny_assets, work)

    vae_files = sorted(p.name for p in (work / "vae").iterdir())
    assert vae_files == sorted(p.name for p in (tiny_assets / "checkpoint" / "vae").iterdir())
    # the world model stage writes its own
    assert not (work / "assets" / "pusht" / "checkpoint" / "transformer").exists()
    for name in (pusht_env.INITIAL_STATES_FILE, f"{pusht_env.REWARD_MODEL_DIR}/config.json"):
        assert (work / "assets" / "pusht" / name).read_bytes() == (tiny_assets / name).read_bytes()

    # The world model stage's meta.json gives checkpoint_defaults everything the installed model's did.
    from cosmos3_gym.checkpoint import checkpoint_defaults

    assets = work / "assets" / "pusht"
    shutil.copytree(tiny_assets / "checkpoint", assets / "checkpoint", dirs_exist_ok=True)
    meta_path = assets / "checkpoint" / "meta.json"
    trained = {key: value for key, value in json.loads(meta_path.read_text()).items()
               if key not in ("score_name", "initial_states", "reward_model", "success_threshold")}
    meta_path.write_text(json.dumps({**trained, "dataset": "/tmp/on/the/training/machine"}))
    train_pusht.write_env_defaults(assets / "checkpoint", num_steps=4, guidance_scale=1.0, chunk=8)
    defaults = checkpoint_defaults(assets / "checkpoint")
    settings = (defaults["score_name"], defaults["success_threshold"], defaults["max_episode_steps"])
    assert settings == ("coverage", 0.95, 38)  # 300 gym-pusht steps in chunks of 8
    assert defaults["reward_model"] == f"classifier:{(assets / pusht_env.REWARD_MODEL_DIR).resolve()}"
    assert len(load_initial_states(defaults["initial_states"])) > 0 and "dataset" not in json.loads(
        meta_path.read_text())


@pytest.mark.sim
def test_uniform_and_policy_file_episodes(tmp_path):
    """``uniform`` draws a fresh target every step over the table; a ``file:`` policy acts on the rendered frames
    one chunk at a time, its normalised actions mapped through the given action statistics, reproducibly."""
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig, save_policy_file

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    policy_path = save_policy_file(PixelGaussianPolicy(PolicyConfig(image_size=32, chunk=4, channels=[4, 4, 4, 4],
                                                                    hidden=16)), tmp_path / "bc.safetensors")
    stats = {"action": {"min": [100.0, 200.0], "max": [140.0, 260.0]}}
    mix = {"uniform": 1, f"file:{policy_path}": 1}
    with pytest.raises(InputError, match="action_stats"):
        pusht.generate_pusht_dataset(tmp_path / "none", 2, steps_per_episode=4, policy_mix=mix, workers=0,
                                     progress=False)
    kwargs = dict(steps_per_episode=8, image_size=(32, 32), policy_mix=mix, action_stats=stats, seed=1,
                  progress=False)
    out = pusht.generate_pusht_dataset(tmp_path / "data", 6, workers=0, **kwargs)
    names = json.loads((out / "meta.json").read_text())["policies"]
    assert set(names) == {"uniform", "file(bc)"}, names
    for path in sorted((out / "episodes").iterdir()):
        with np.load(path) as episode:
            actions, name = episode["actions"], str(episode["policy"])
        if name == "uniform":  # jumps across the table, not a path of small steps
            assert np.abs(np.diff(actions, axis=0)).max() > 60 and (actions >= 0).all() and (actions <= 512).all()
        else:  # inside the statistics' box: the policy's [-1, 1] mapped by min-max
            assert (actions[:, 0] >= 100 - 1e-3).all() and (actions[:, 0] <= 140 + 1e-3).all()
            assert (actions[:, 1] >= 200 - 1e-3).all() and (actions[:, 1] <= 260 + 1e-3).all()
            assert len(np.unique(actions[:, 0])) > 1
    again = pusht.generate_pusht_dataset(tmp_path / "again", 6, workers=2, **kwargs)  # spawned workers: same data
    for path in sorted((out / "episodes").iterdir()):
        with np.load(path) as first, np.load(again / "episodes" / path.name) as second:
            np.testing.assert_array_equal(first["actions"], second["actions"])


@pytest.mark.sim
def test_scripted_random_goal_episodes_push_the_t_towards_their_own_goal(tmp_path):
    """``scripted_random_goal`` is the scripted pusher aiming at a goal pose drawn per episode (recorded in the
    episode): its pushes take the block towards that goal, not towards the green target."""
    pytest.importorskip("gym_pusht")
    mix = {"scripted_random_goal": 1}
    assert {pusht.episode_policy(0, index, mix)[1] for index in range(40)} == set(pusht.SCRIPTED_NOISE_LEVELS)
    out = pusht.generate_pusht_dataset(tmp_path / "data", 4, steps_per_episode=128, image_size=(32, 32),
                                       policy_mix=mix, seed=2, workers=0, progress=False)
    start_error, end_error, goals = [], [], []
    for path in sorted((out / "episodes").iterdir()):
        with np.load(path) as episode:
            assert str(episode["policy"]).startswith("scripted_random_goal(noise=")
            goal, blocks = episode["goal_pose"], episode["sim_states"][:, 4:6]
        low, high = pusht.RANDOM_GOAL_LOW, pusht.RANDOM_GOAL_HIGH
        assert goal.shape == (3,) and (low <= goal[:2]).all() and (goal[:2] <= high).all()
        start_error.append(np.linalg.norm(blocks[0] - goal[:2]))
        end_error.append(np.linalg.norm(blocks[-1] - goal[:2]))
        goals.append(goal)
    assert np.mean(end_error) < 0.6 * np.mean(start_error), (start_error, end_error)
    assert len({tuple(goal) for goal in goals}) == 4 and not any(np.allclose(g, pusht.GOAL_POSE) for g in goals)


def _gym_pusht_pixel_env(size):
    """gym-pusht's own env with "pixels" observations: what ``PushTSim`` drew its frames with before it read the
    drawing itself."""
    return pusht.require_gym_pusht()(obs_type="pixels", render_mode="rgb_array", observation_width=size[1],
                                     observation_height=size[0])


@pytest.mark.sim
def test_sim_frames_are_gym_pushts_pixel_observations():
    pytest.importorskip("gym_pusht")
    for size in ((32, 48), (96, 96)):
        env, sim, lazy = _gym_pusht_pixel_env(size), pusht.PushTSim(size), pusht.PushTSim(size, render_every_step=False)
        try:
            for seed, policy in ((0, pusht.RandomWaypoints(np.random.default_rng(0))),
                                 (1, pusht_policies.UniformTargets(np.random.default_rng(1)))):
                expected = env.reset(seed=seed)[0]
                np.testing.assert_array_equal(sim.reset(seed), expected)
                assert lazy.reset(seed) is None
                np.testing.assert_array_equal(lazy.render(), expected)
                for _ in range(12):
                    action = policy(sim.agent_xy, sim.block_pose)
                    expected = env.step(np.asarray(action, np.float64))[0]
                    frame = sim.step(action)
                    lazy.step(action)
                    np.testing.assert_array_equal(frame, expected)
                    np.testing.assert_array_equal(sim.render(), expected)  # the cached frame, a copy
                    np.testing.assert_array_equal(lazy.render(), expected)
                    frame[:] = 0  # the caller's copy: the simulator's frame stays
                    np.testing.assert_array_equal(sim.render(), expected)
                np.testing.assert_array_equal(sim.restore(sim.sim_state), sim.env._render())  # gym-pusht's draw
        finally:
            env.close(), sim.close(), lazy.close()


def _reference_episode(seed, index, mix, steps, size, stats):
    """Episode ``index`` as ``generate_pusht_dataset`` simulated it before it was made faster: gym-pusht's pixel env
    stepped and rendered at every step (and re-rendered for a frame policy), the replay's reference episode rendered
    too. The same random draws in the same order."""
    from cosmos3_gym.rl.policy import load_policy_file
    from cosmos3_gym.tasks.pusht import dataset as pusht_dataset

    family, noise, rng = pusht_dataset.episode_policy(seed, index, mix)
    env = _gym_pusht_pixel_env(size)
    sim_seed = int(rng.integers(2**31))

    def rollout(policy):
        frame, info = env.reset(seed=sim_seed)
        frames, actions, coverage = [frame], [], [env._get_coverage()]
        for _ in range(steps):
            actions.append(policy(np.asarray(info["pos_agent"], float), np.asarray(info["block_pose"], float)))
            frame, _, _, _, info = env.step(np.asarray(actions[-1], np.float64))
            frames.append(frame)
            coverage.append(info["coverage"])
        return np.stack(frames), np.asarray(actions, np.float32), np.asarray(coverage, np.float32)

    if family == "random":
        policy = pusht.RandomWaypoints(rng)
    elif family == "uniform":
        policy = pusht_policies.UniformTargets(rng)
    elif family.startswith("file:"):
        generator = torch.Generator().manual_seed(int(rng.integers(2**63)))
        policy = pusht_policies.ChunkedFramePolicy(load_policy_file(family[len("file:"):]), env._render,
                                                   ActionStats.from_json(stats).denormalize, generator)
    elif family == "scripted":
        policy = pusht.ScriptedPusher(rng, noise=noise)
    else:
        policy = pusht.Replay(rollout(pusht.ScriptedPusher(rng))[1], rng, noise)
    try:
        return family, rollout(policy)
    finally:
        env.close()


@pytest.mark.sim
@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_episodes_are_what_the_plain_gym_pusht_loop_gives(tmp_path, workers):
    """Every family of the policy mix, in this process and in worker processes (a fork server then, with a policy
    file): the same frames, actions and coverage, bit for bit, as gym-pusht's own pixel env stepped in a plain loop."""
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig, save_policy_file

    torch.manual_seed(0)
    policy_path = save_policy_file(PixelGaussianPolicy(PolicyConfig(image_size=32, chunk=4, channels=[4, 4, 4, 4],
                                                                    hidden=16)), tmp_path / "bc.safetensors")
    stats = {"action": {"min": [100.0, 200.0], "max": [400.0, 360.0]}}
    mix = {"scripted": 1, "random": 1, "replay": 1, "uniform": 1, f"file:{policy_path}": 1}
    size, steps, episodes = (32, 48), 10, 10
    out = pusht.generate_pusht_dataset(tmp_path / "data", episodes, steps_per_episode=steps, image_size=size,
                                       policy_mix=mix, action_stats=stats, seed=3, workers=workers, progress=False)
    families = set()
    for index in range(episodes):
        family, (frames, actions, coverage) = _reference_episode(3, index, {k: v / 5 for k, v in mix.items()},
                                                                 steps, size, stats)
        families.add(family)
        with np.load(out / "episodes" / f"episode_{index:06d}.npz") as episode:
            np.testing.assert_array_equal(episode["frames"], frames)
            np.testing.assert_array_equal(episode["actions"], actions)
            np.testing.assert_array_equal(episode["coverage"], coverage)
    assert families == set(mix), families  # the seed draws every family


def test_a_fine_tune_keeps_the_light_decoder_of_the_checkpoint_it_starts_from(tiny_assets, tmp_path):
    # Round 10's first call wrote a checkpoint without the built-in model's light decoder: the env lost its fast
    # decode, and the next call's rollout training would have handed over through the VAE instead of as the env does.
    from cosmos3_gym.checkpoint import checkpoint_decoder
    from cosmos3_gym.engine import LIGHT_DECODER_DIR

    train_pusht = import_train_pusht()
    init = tmp_path / "init"
    shutil.copytree(tiny_assets / "checkpoint", init)
    (init / LIGHT_DECODER_DIR).mkdir()
    (init / LIGHT_DECODER_DIR / "config.json").write_text('{"marker": 1}')
    (init / LIGHT_DECODER_DIR / "model.safetensors").write_bytes(b"weights")
    meta = json.loads((init / "meta.json").read_text())
    (init / "meta.json").write_text(json.dumps({**meta, "decoder": "light"}))
    trained = tmp_path / "trained"
    shutil.copytree(tiny_assets / "checkpoint", trained)  # what training writes: no light decoder, no "decoder"
    assert checkpoint_decoder(trained) == "vae"

    train_pusht.keep_light_decoder(init, trained)
    assert checkpoint_decoder(trained) == "light"
    for name in ("config.json", "model.safetensors"):
        assert (trained / LIGHT_DECODER_DIR / name).read_bytes() == (init / LIGHT_DECODER_DIR / name).read_bytes()
    assert {**json.loads((trained / "meta.json").read_text()), "decoder": None} == {**meta, "decoder": None}

    plain = tmp_path / "plain"
    shutil.copytree(tiny_assets / "checkpoint", plain)
    train_pusht.keep_light_decoder(tiny_assets / "checkpoint", plain)  # an init without one: nothing to keep
    assert checkpoint_decoder(plain) == "vae" and not (plain / LIGHT_DECODER_DIR).exists()


def test_train_pusht_second_part_simulates_at_the_size_of_the_first_parts_start_frames(tiny_assets, tmp_path):
    # --smoke simulates 64x64 episodes; fine-tuning an installed 256x256 model with it once crashed when the reward
    # model stacked the real frames with the world model's rollouts (64 against 256).
    import argparse

    train_pusht = import_train_pusht()
    with np.load(tiny_assets / pusht_env.INITIAL_STATES_FILE) as archive:
        size = archive["frames"].shape[1]
    args = argparse.Namespace(image_size=size + 8, smoke=True)
    train_pusht.match_first_part_image_size(args, tiny_assets)
    assert args.image_size == size  # --smoke takes the first part's size
    train_pusht.match_first_part_image_size(args, tiny_assets)  # a match: nothing to do
    args = argparse.Namespace(image_size=size + 8, smoke=False)
    expected = f"--image-size: expected the size of --first-part's start frames \\({size}x{size}\\)"
    with pytest.raises(InputError, match=expected):
        train_pusht.match_first_part_image_size(args, tiny_assets)
    assert args.image_size == size + 8


@pytest.mark.parametrize("flags, expected", [
    ((), ["simulate", "world_model", "reward_model", "success_threshold", "package", "evaluate"]),
    (("--no-rollout-reward-model", "--no-evaluate"), ["simulate", "world_model", "success_threshold", "package"]),
])
def test_train_pusht_second_part_can_skip_the_reward_model_and_the_evaluation(tmp_path, monkeypatch, flags, expected):
    """A fine-tune that a later call continues (``--no-rollout-reward-model --no-evaluate``) runs only simulation,
    training, calibrating the success threshold to the reward model it keeps, and packaging; by default the reward
    model is retrained on the rollouts (then calibrated) and the model evaluated."""
    train_pusht = import_train_pusht()
    ran = []

    def stage(name):
        return lambda *args, **kwargs: ran.append(name) or {}

    for name in ("simulate", "world_model_stage", "reward_model_stage", "success_threshold_stage", "package",
                 "evaluate_stage"):
        monkeypatch.setattr(train_pusht, name, stage(name.removesuffix("_stage")))
    monkeypatch.setattr(train_pusht, "unpack_first_part", lambda *args: None)
    monkeypatch.setattr(train_pusht, "match_first_part_image_size", lambda *args: None)
    monkeypatch.setattr(train_pusht, "write_results", lambda *args, **kwargs: None)
    train_pusht.main(["--part", "second", "--first-part", str(tmp_path), "--out", str(tmp_path / "out"),
                      "--work", str(tmp_path / "work"), "--deadline-s", "1e6", *flags])
    assert ran == expected
