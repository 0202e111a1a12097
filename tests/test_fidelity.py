"""Fidelity metrics (SSIM, Pearson, Spearman, MMRV) on hand-computed cases, and the world model vs simulator policy
comparison (cosmos3_gym.tasks.pusht.compare) end to end with a stand-in world model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cosmos3_gym.errors import InputError
from cosmos3_gym.processor import ActionStats
from cosmos3_gym.tasks.pusht.compare import (
    SSIM_C1,
    compare_policies,
    mmrv,
    parse_policy_specs,
    pearson,
    simulate_policy,
    spearman,
    ssim,
)


def test_ssim_identical_frames_is_one_and_constant_frames_match_the_formula():
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    assert ssim(frames, frames) == pytest.approx(1.0, abs=1e-6)
    # Constant gray frames a and b: zero variances, so SSIM = (2ab + C1) / (a^2 + b^2 + C1).
    a, b = 51 / 255, 153 / 255
    first, second = np.full((16, 16, 3), 51, np.uint8), np.full((16, 16, 3), 153, np.uint8)
    assert ssim(first, second) == pytest.approx((2 * a * b + SSIM_C1) / (a * a + b * b + SSIM_C1), rel=1e-5)
    # Structure matters: a frame against its inverse scores far below 1.
    assert ssim(frames, 255 - frames) < 0.1


def test_ssim_rejects_mismatched_or_small_frames():
    with pytest.raises(InputError, match="shapes differ"):
        ssim(np.zeros((16, 16, 3), np.uint8), np.zeros((17, 16, 3), np.uint8))
    with pytest.raises(InputError, match="at least 11"):
        ssim(np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8, 3), np.uint8))


def test_pearson_and_spearman_hand_computed():
    # x = [1, 2, 3], y = [2, 4, 7]: sum dx dy = 5, sum dx^2 = 2, sum dy^2 = 114 / 9.
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(5 / math.sqrt(2 * 114 / 9))
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    # Monotonic but not linear: Spearman 1, Pearson below 1.
    assert spearman([1, 2, 3], [1, 10, 100]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [1, 10, 100]) < 0.99
    # Ties share their average rank: ranks [1, 2.5, 2.5, 4] vs [1, 3, 2, 4] -> 4.5 / sqrt(4.5 * 5).
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    with pytest.raises(InputError, match="same length"):
        pearson([1, 2], [1, 2, 3])


def test_mmrv_hand_computed():
    real = [0.1, 0.5, 0.9]
    assert mmrv([0.0, 0.2, 0.3], real) == 0.0  # same order
    # Policies 0 and 1 swapped by the prediction: both get the violation |0.1 - 0.5|; policy 2 none.
    assert mmrv([0.2, 0.1, 0.3], real) == pytest.approx((0.4 + 0.4 + 0.0) / 3)
    # Fully reversed: 0 and 2 violate by 0.8 (their worst pair), 1 by 0.4.
    assert mmrv([3, 2, 1], real) == pytest.approx((0.8 + 0.4 + 0.8) / 3)


def test_parse_policy_specs():
    runs = parse_policy_specs("random, scripted:0,scripted:12.5,agent")
    assert [(r.kind, r.noise) for r in runs] == [("random", 0.0), ("scripted", 0.0), ("scripted", 12.5),
                                                 ("agent", 0.0)]
    assert [r.acts_on_frames for r in runs] == [False, False, False, True]
    for bad in ("", "scripted:-1", "scripted:x", "ppo", "random,random", "file:/missing.safetensors"):
        with pytest.raises(InputError, match="policies"):
            parse_policy_specs(bad)


class StandInVectorEnv:
    """A world model that predicts "nothing moves": every chunk repeats the slot's current frame."""

    def __init__(self, num_envs: int, chunk: int, image_size: int):
        import gymnasium

        self.num_envs = num_envs
        self.single_action_space = gymnasium.spaces.Box(-1, 1, (chunk, 2), np.float32)
        self.single_observation_space = gymnasium.spaces.Dict(
            {"image": gymnasium.spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)}
        )
        self.actions = []

    def reset(self, seed=None, options=None):
        self.frames = np.stack(options["frames"])
        return {"image": self.frames}, {}

    def step(self, actions):
        self.actions.append(np.array(actions))
        chunk = self.single_action_space.shape[0]
        frames = np.repeat(self.frames[:, None], chunk, axis=1)
        return {"image": self.frames}, np.zeros(self.num_envs), np.zeros(self.num_envs, bool), \
            np.zeros(self.num_envs, bool), {"frames": frames}


class StandInAgent:
    def __init__(self, chunk: int):
        self.chunk, self.calls = chunk, 0

    def act(self, frames):
        self.calls += 1
        return np.full((len(frames), self.chunk, 2), 0.25, np.float32)


@pytest.mark.sim
def test_compare_policies_end_to_end_with_a_stand_in_world_model():
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.tasks.pusht import episodes as pusht

    chunk, num_chunks, seeds = 4, 2, [3, 4]
    stats = ActionStats.from_json({"min": [0.0, 0.0], "max": [512.0, 512.0]}, mode="minmax")
    env = StandInVectorEnv(3 * len(seeds), chunk, 32)
    agent = StandInAgent(chunk)
    result = compare_policies(
        "random,scripted:0,agent", seeds, vector_env=env, score_frames=lambda f: f.mean(axis=(1, 2, 3)) / 255.0,
        stats=stats, num_chunks=num_chunks, make_agent=lambda: agent,
    )
    assert list(result["policies"]) == ["random", "scripted:0", "agent"]
    assert len(env.actions) == num_chunks and env.actions[0].shape == (6, chunk, 2)
    # The agent acts on the simulator's frames and, closed loop, on the world model's: once per chunk in each.
    assert agent.calls == 2 * num_chunks
    np.testing.assert_allclose(env.actions[0][4:], 0.25)
    # Open loop: the world model replays the scripted pusher's simulator actions, so its first chunk is the
    # pusher's first targets from the same start, normalised; the real coverage is the simulator's own.
    final_coverage = []
    for index, sim_seed in enumerate(seeds):
        sim = pusht.PushTSim((32, 32))
        try:
            sim.reset(sim_seed)
            pusher = pusht.ScriptedPusher(np.random.default_rng([0, sim_seed]))
            targets = []
            for _ in range(num_chunks * chunk):
                targets.append(pusher(sim.agent_xy, sim.block_pose))
                sim.step(targets[-1])
            final_coverage.append(sim.coverage)
        finally:
            sim.close()
        replayed = np.concatenate([actions[len(seeds) + index] for actions in env.actions])
        np.testing.assert_allclose(replayed, np.clip(stats.normalize(np.stack(targets)), -1, 1), atol=1e-6)
    scripted = result["policies"]["scripted:0"]["simulator"]
    assert scripted["final_coverage"] == pytest.approx(np.mean(final_coverage))
    # A world model where nothing moves predicts the same score for every policy at every step.
    model_scores = {spec: entry["world_model"]["final_coverage"] for spec, entry in result["policies"].items()}
    assert len(set(np.round(list(model_scores.values()), 9))) == 1
    assert set(result["agreement"]) >= {"pearson", "spearman", "mmrv", "mean_absolute_error"}
    json.dumps(result)  # serialisable as it is


@pytest.mark.sim
def test_compare_policies_runs_a_saved_ppo_policy_closed_loop_in_both_worlds(tiny_ppo_model, tmp_path):
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.agents import SB3PolicyAgent, save_sb3_policy

    path = save_sb3_policy(tiny_ppo_model, tmp_path / "ppo.safetensors")
    spec, seeds, num_chunks = f"ppo:{path}", [3, 4], 2
    stats = ActionStats.from_json({"min": [0.0, 0.0], "max": [512.0, 512.0]}, mode="minmax")
    env = StandInVectorEnv(2 * len(seeds), 8, 32)  # the policy's chunks are [8, 2]
    result = compare_policies(f"random,{spec}", seeds, vector_env=env,
                              score_frames=lambda f: f.mean(axis=(1, 2, 3)) / 255.0, stats=stats, num_chunks=num_chunks)
    assert list(result["policies"]) == ["random", spec]
    entry = result["policies"][spec]
    assert entry["evaluated_in_world_model"] == "closed loop"
    for world in ("simulator", "world_model"):
        assert 0.0 <= entry[world]["final_coverage"] <= 1.0
    # Closed loop on the world model's frames, which the stand-in never changes: every chunk is the policy's
    # deterministic action on the start frames (the simulator's 32 x 32 frames, resized to the policy's 48 x 48).
    agent = SB3PolicyAgent(tiny_ppo_model)
    expected = agent.act(env.frames[len(seeds):])
    for actions in env.actions:
        np.testing.assert_array_equal(actions[len(seeds):], expected)
    # Closed loop in the simulator too: the same policy on the simulator's frames scores the same true coverage.
    _, taken, coverage = simulate_policy(parse_policy_specs(spec)[0], seeds, num_chunks, 8, (32, 32), stats, agent, 0)
    np.testing.assert_array_equal(taken[:, 0], expected)
    assert entry["simulator"]["final_coverage"] == pytest.approx(coverage[:, -1].mean())

    short_chunks = StandInVectorEnv(2 * len(seeds), 4, 32)
    with pytest.raises(InputError, match=r"acts in chunks of shape \[8, 2\]"):
        compare_policies(f"random,{spec}", seeds, vector_env=short_chunks, score_frames=None, stats=stats,
                         num_chunks=1)


@pytest.mark.sim
def test_compare_policies_scores_the_world_model_with_extra_scorers_too():
    pytest.importorskip("gym_pusht")
    seeds = [3, 4]
    stats = ActionStats.from_json({"min": [0.0, 0.0], "max": [512.0, 512.0]}, mode="minmax")
    calls = []

    def by_policy(frames):  # the slots are policy-major: the first policy's get 0.25, the second's 0.75
        calls.append(len(frames))
        return np.repeat([0.25, 0.75], len(frames) // 2)

    result = compare_policies("random,scripted:0", seeds, vector_env=StandInVectorEnv(4, 4, 32),
                              score_frames=lambda f: np.zeros(len(f)), stats=stats, num_chunks=2,
                              extra_scores={"by_policy": by_policy})
    assert calls == [4, 16, 16]  # the start frames, then every frame of each chunk (4 slots x 4 frames)
    random, scripted = result["policies"]["random"], result["policies"]["scripted:0"]
    assert random["world_model"]["final_coverage"] == 0.0  # the first scorer's report is unchanged
    assert random["world_model_by_score"]["by_policy"]["final_coverage"] == 0.25
    assert scripted["world_model_by_score"]["by_policy"]["final_coverage"] == 0.75
    real = [random["simulator"]["final_coverage"], scripted["simulator"]["final_coverage"]]
    assert result["agreement_by_score"]["by_policy"]["mean_absolute_error"] == pytest.approx(
        (abs(0.25 - real[0]) + abs(0.75 - real[1])) / 2)
    json.dumps(result)


class FlashVectorEnv(StandInVectorEnv):
    """Every chunk's first frame is white, the rest black; with ``frames_in_info=False`` it returns the last frame
    only, as the observation."""

    def __init__(self, *args, frames_in_info: bool):
        super().__init__(*args)
        self.frames_in_info = frames_in_info

    def step(self, actions):
        self.actions.append(np.array(actions))
        chunk = self.single_action_space.shape[0]
        clip = np.zeros((self.num_envs, chunk, *self.frames.shape[1:]), np.uint8)
        clip[:, 0] = 255
        self.frames = clip[:, -1]
        info = {"frames": clip} if self.frames_in_info else {}
        return {"image": self.frames.copy()}, np.zeros(self.num_envs), np.zeros(self.num_envs, bool), \
            np.zeros(self.num_envs, bool), info


@pytest.mark.sim
def test_compare_policies_scores_success_on_every_frame_and_coverage_on_the_last():
    pytest.importorskip("gym_pusht")
    stats = ActionStats.from_json({"min": [0.0, 0.0], "max": [512.0, 512.0]}, mode="minmax")

    def white(frames):  # "coverage" 1 on a white frame, 0 elsewhere (no gym-pusht start is white)
        return (frames == 255).all(axis=(1, 2, 3)).astype(float)

    results = {}
    for frames_in_info in (True, False):
        env = FlashVectorEnv(4, 4, 32, frames_in_info=frames_in_info)
        results[frames_in_info] = compare_policies("random,scripted:0", [3, 4], vector_env=env, score_frames=white,
                                                   stats=stats, num_chunks=2, success_threshold=0.95,
                                                   extra_scores={"white": white})
    for entry in results[True]["policies"].values():
        # Success mid-chunk counts, as gym-pusht's success at any step; the coverage is the last frame's.
        assert entry["world_model"]["success_rate"] == 1.0 and entry["world_model"]["final_coverage"] == 0.0
        assert entry["world_model_by_score"]["white"]["success_rate"] == 1.0
    for entry in results[False]["policies"].values():  # only the last frames seen: the flash is missed
        assert entry["world_model"]["success_rate"] == 0.0


def test_compare_policies_checks_the_slot_count():
    stats = ActionStats.from_json({"min": [0.0, 0.0], "max": [512.0, 512.0]}, mode="minmax")
    with pytest.raises(InputError, match="slots"):
        compare_policies("random,scripted:0", [1, 2], vector_env=StandInVectorEnv(3, 4, 32), score_frames=None,
                         stats=stats, num_chunks=1)


def test_cli_eval_real_rejects_a_bad_policy_spec(capsys):
    from cosmos3_gym.cli import main

    assert main(["eval-real", "--policies", "ppo"]) == 2
    assert "policies" in capsys.readouterr().err
    assert main(["eval-real", "--policies", "random,ppo:/missing.safetensors"]) == 2
    assert "'ppo:/missing.safetensors'" in capsys.readouterr().err


@pytest.mark.sim
def test_cli_eval_real_runs_the_builtin_model(tmp_path, capsys, tiny_ppo_model):
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.agents import save_sb3_policy
    from cosmos3_gym.cli import main
    from cosmos3_gym.tasks.pusht.env import builtin_checkpoint_dir

    assert builtin_checkpoint_dir() is not None  # it ships inside the package
    ppo = f"ppo:{save_sb3_policy(tiny_ppo_model, tmp_path / 'ppo.safetensors')}"
    out = tmp_path / "comparison.json"
    assert main(["eval-real", "--policies", f"random,scripted:0,{ppo}", "--starts", "1", "--chunks", "1",
                 "--device", "cpu", "--out", str(out)]) == 0
    assert "spearman" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"random", "scripted:0", ppo}
    assert result["policies"][ppo]["evaluated_in_world_model"] == "closed loop"


def test_real_episode_scores_end_at_the_first_success():
    from cosmos3_gym.tasks.pusht.compare import real_episode_scores

    coverage = np.array([[0.0, 0.5, 0.96, 0.2],   # succeeds at step 2; gym-pusht ends the episode there
                         [0.0, 0.1, 0.3, 0.4]])   # never: its last coverage counts
    success, final = real_episode_scores(coverage)
    assert success.tolist() == [True, False] and final.tolist() == [0.96, 0.4]


@pytest.mark.sim
def test_cli_eval_real_real_only_in_gym_pusht_alone(tmp_path, capsys, tiny_ppo_model):
    """Issue 17: eval-real --real-only evaluates in gym-pusht alone (success rate with a Wilson CI, final coverage
    with a CI in [0, 1]), takes file:PATH policies and reproduces its numbers for the same seeds."""
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.agents import save_sb3_policy
    from cosmos3_gym.cli import main
    from cosmos3_gym.statistics import wilson_interval

    policy = f"file:{save_sb3_policy(tiny_ppo_model, tmp_path / 'ppo.safetensors')}"
    runs = []
    for name in ("a.json", "b.json"):
        assert main(["eval-real", "--real-only", "--policies", f"scripted:0,random,{policy}", "--starts", "3",
                     "--chunks", "2", "--device", "cpu", "--out", str(tmp_path / name)]) == 0
        runs.append(json.loads((tmp_path / name).read_text()))
    assert runs[0] == runs[1]  # seeded: the same numbers again
    printed = capsys.readouterr().out
    assert policy in printed and "success rate [95% CI]" in printed
    result = runs[0]
    assert result["mode"] == "real_only" and set(result["policies"]) == {"scripted:0", "random", policy}
    for entry in result["policies"].values():
        assert entry["episodes"] == 3
        assert entry["success_rate_interval"] == list(wilson_interval(entry["successes"], 3))
        low, high = entry["final_coverage_interval"]
        assert 0.0 <= low <= entry["final_coverage"] <= high <= 1.0
    # The scripted pusher makes progress in 16 steps; random actions do not beat it.
    assert result["policies"]["scripted:0"]["final_coverage"] >= result["policies"]["random"]["final_coverage"]
