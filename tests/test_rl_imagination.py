"""RL in imagination (benchmarks/recipes/rl_imagination_pusht.py) end to end at smoke size, and the simulator env it
trains the comparison agent in (cosmos3_gym.tasks.pusht.sim_env.PushTSimEnv)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.sim  # needs gym-pusht (the sim extra)

pytest.importorskip("gym_pusht")

ROOT = Path(__file__).resolve().parent.parent


def test_sim_env_matches_the_world_model_spaces_starts_and_compare_rollouts():
    from cosmos3_gym.tasks.pusht.compare import PolicyRun, simulate_policy
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets
    from cosmos3_gym.tasks.pusht.sim_env import make_pusht_sim_env

    assets = load_pusht_assets()
    with np.load(assets.initial_states) as archive:
        start_frames, start_seeds = archive["frames"], archive["sim_seeds"]
    env = make_pusht_sim_env(max_episode_steps=2)
    try:
        assert env.action_space.shape == (8, 2) and env.observation_space["image"].shape == (256, 256, 3)
        assert env.start_seeds == [int(s) for s in start_seeds]
        # A training start of the simulator is the world model's shipped start frame, pixel for pixel.
        obs, info = env.reset(options={"sim_seed": int(start_seeds[0])})
        np.testing.assert_array_equal(obs["image"], start_frames[0])
        obs, info = env.reset(seed=1)
        assert info["sim_seed"] in env.start_seeds

        # The same normalised chunks give the same true coverage as compare.simulate_policy (how policies are
        # evaluated).
        chunks = np.random.default_rng(0).uniform(-1.2, 1.2, size=(2, 8, 2)).astype(np.float32)  # clipped alike
        env.reset(options={"sim_seed": 20_000})
        rewards, truncated = [], []
        for chunk in chunks:
            _, reward, _, trunc, info = env.step(chunk)
            rewards.append(reward)
            truncated.append(trunc)
        assert truncated == [False, True] and info["elapsed_steps"] == 2 and info["score"] == reward

        class Replay:
            calls = 0

            def act(self, frames):
                self.calls += 1
                return chunks[self.calls - 1][None]

        _, taken, coverage = simulate_policy(PolicyRun("x", "agent"), [20_000], 2, 8, env.image_size, env.action_stats,
                                       Replay(), 0)
        np.testing.assert_allclose(coverage[0, [8, 16]], rewards)
        np.testing.assert_allclose(env.raw_actions(chunks[1]), info["raw_action"])
    finally:
        env.close()


def test_smoke_run_writes_learning_curves(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks" / "recipes"))
    try:
        import rl_imagination_pusht as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "recipes"))

    bench.main(["--smoke", "--device", "cpu", "--no-progress", "--out", str(tmp_path)])
    path = tmp_path / "rl_imagination_pusht_cpu.json"
    results = json.loads(path.read_text())

    assert {"card", "commit", "command", "date"} <= set(results["provenance"])
    assert "--smoke" in results["provenance"]["command"]
    settings = results["settings"]
    points, episodes = bench.SMOKE["eval_points"], bench.SMOKE["eval_episodes"]
    assert settings["eval_points"] == points and settings["eval_episodes"] == episodes
    size = bench.SMOKE["obs_size"]
    assert results["spaces"]["observation"] == f"Dict('image': Box(0, 255, ({size}, {size}, 3), uint8))"
    assert results["spaces"]["action"] == "Box(-1.0, 1.0, (8, 2), float32)"
    assert len(results["starts"]["eval_sim_seeds"]) == episodes

    def check_summary(summary):
        for metric in ("final_coverage", "max_coverage", "success_rate"):
            entry = summary[metric]
            assert entry["n"] == episodes
            assert 0.0 <= entry["mean"] <= 1.0
            assert math.isfinite(entry["ci95_low"]) and entry["ci95_low"] <= entry["mean"] <= entry["ci95_high"]
        assert summary["max_coverage"]["mean"] >= summary["final_coverage"]["mean"] - 1e-12
        low, high = summary["success_rate_wilson95"]
        assert 0.0 <= low <= summary["success_rate"]["mean"] <= high <= 1.0

    check_summary(results["random"])
    total = settings["timesteps_actual"]
    assert total >= settings["timesteps"] and total == points * settings["steps_per_eval_point"]
    for world in ("world_model", "simulator"):
        agent = results["agents"][world]
        curve = agent["curve"]
        assert len(curve) == points + 1  # before training, then after each segment
        steps = [point["env_steps"] for point in curve]
        assert steps == [k * settings["steps_per_eval_point"] for k in range(points + 1)]
        assert agent["num_timesteps"] == total
        for point in curve:
            check_summary(point)
            assert point["eval_s"] > 0
        for point in curve[1:]:
            assert point["train_s"] > 0 and 0 < point["env_s"] <= point["train_s"]
            assert point["ppo_s"] == pytest.approx(point["train_s"] - point["env_s"])
            train_env = point["train_env"]
            assert train_env["episodes"] >= 1 and math.isfinite(train_env["mean_return"])
            assert 0.0 <= train_env["mean_final_score"] <= 1.0  # a coverage estimate / the true coverage
        assert agent["train_s"] == pytest.approx(sum(point["train_s"] for point in curve))
        assert agent["train_env_s"] + agent["train_ppo_s"] == pytest.approx(agent["train_s"])
    # Same seed, same spaces: both PPO runs start from the same policy, so their first points agree.
    assert results["same_initial_policy"] is True
    first = [results["agents"][world]["curve"][0]["final_coverage"]["mean"] for world in ("world_model", "simulator")]
    assert first[0] == pytest.approx(first[1])
    assert results["agents"]["world_model"]["num_timesteps"] == results["agents"]["simulator"]["num_timesteps"]
    timings = results["timings"]
    assert all(math.isfinite(value) and value >= 0 for value in timings.values())
    assert timings["world_model_train_s"] > 0 and timings["simulator_train_s"] > 0
    plot = results["plot"]
    assert plot.startswith("skipped") or Path(plot).is_file()

    # Both trained policies are saved next to the JSON; loaded back, each scores exactly its last curve point.
    from cosmos3_gym.agents import SB3PolicyAgent, read_sb3_policy_metadata
    from cosmos3_gym.tasks.pusht.compare import parse_policy_specs, simulate_policy
    from cosmos3_gym.tasks.pusht.sim_env import pusht_sim_env_arguments

    sim = pusht_sim_env_arguments(results["assets"])
    for world in ("world_model", "simulator"):
        policy_file = tmp_path / results["agents"][world]["policy_file"]
        assert policy_file.name == f"rl_imagination_pusht_cpu_{world}_policy.safetensors"
        assert policy_file.stat().st_size < 1_000_000
        metadata = read_sb3_policy_metadata(policy_file)
        assert metadata["world"] == world and metadata["env_steps"] == total
        run = parse_policy_specs(f"ppo:{policy_file}")[0]
        _, _, coverage = simulate_policy(run, results["starts"]["eval_sim_seeds"], settings["chunks_per_episode"],
                                         sim["chunk"], sim["image_size"], sim["action_stats"],
                                         SB3PolicyAgent.from_file(policy_file), settings["seed"])
        assert coverage[:, -1].mean() == pytest.approx(results["agents"][world]["curve"][-1]["final_coverage"]["mean"])
