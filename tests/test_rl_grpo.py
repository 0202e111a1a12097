"""GRPO: group-relative advantages, learning on a toy vector env, exact resume, and a few iterations in both worlds
(gym-pusht, and the tiny random world model) with the guard replaying imagined chunks in the simulator."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from cosmos3_gym.errors import InputError
from cosmos3_gym.rl.grpo import GRPOConfig, GRPOTrainer, group_advantages
from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig

SMALL = dict(channels=(4, 4, 4, 4), hidden=16, image_size=32)


def test_group_advantages_are_normalised_within_groups():
    returns = np.array([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    advantages = group_advantages(returns, 4)
    expected = (np.array([1.0, 0, 0, 0]) - 0.25) / np.std([1.0, 0, 0, 0])
    np.testing.assert_allclose(advantages[:4], expected)
    np.testing.assert_array_equal(advantages[4:], 0.0)  # equal returns: nothing to learn from


def test_batch_and_unnormalised_advantages_keep_the_groups_relative_weight():
    # Group 1 tells success from failure, group 2 differs by a tiny coverage amount: per-group std normalisation
    # makes both +-1; the batch and unnormalised variants keep group 2's advantages 1000x smaller.
    returns = np.array([1.0, 0.0, 0.0, 0.0, 0.001, 0.0, 0.0, 0.0])
    grouped = group_advantages(returns, 4, "group")
    np.testing.assert_allclose(grouped[:4], grouped[4:] * 1.0)
    centred = np.array([0.75, -0.25, -0.25, -0.25, 0.00075, -0.00025, -0.00025, -0.00025])
    np.testing.assert_allclose(group_advantages(returns, 4, "none"), centred)
    batch = group_advantages(returns, 4, "batch")
    np.testing.assert_allclose(batch, centred / centred.std())
    np.testing.assert_allclose(batch[4:] / batch[:4], 0.001)
    np.testing.assert_array_equal(group_advantages(np.full(8, 0.3), 4, "batch"), 0.0)
    with pytest.raises(InputError, match="advantage_normalization"):
        group_advantages(returns, 4, "mean")


class ReachRight:
    """A toy vector env with the PushT envs' interface: success when the first action's x exceeds 0.3."""

    def __init__(self, num_envs: int):
        self.num_envs = num_envs
        self.initial_states = [0, 1, 2]
        self.reset_options = []

    def reset(self, *, seed=None, options=None):
        self.reset_options.append(options)
        return {"image": np.zeros((self.num_envs, 32, 32, 3), np.uint8)}, {}

    def step(self, actions):
        success = actions[:, 0, 0] > 0.3
        observation = {"image": np.zeros((self.num_envs, 32, 32, 3), np.uint8)}
        return (observation, success.astype(float), success, np.ones(self.num_envs, bool),
                {"coverage": actions[:, 0, 0].clip(0, 1)})

    def close(self):
        pass


def toy_trainer(**overrides):
    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(chunk=2, **SMALL))
    config = GRPOConfig(**{**dict(iterations=3, group_size=4, horizon=1, learning_rate=3e-3, update_epochs=2,
                                  minibatch_size=16, kl_coef=0.0), **overrides})
    return GRPOTrainer(policy, ReachRight(16), config)


def test_grpo_raises_the_success_rate_of_a_toy_task():
    trainer = toy_trainer(iterations=30, learning_rate=1e-2)
    history = trainer.train(progress=False)
    first, last = history[0]["success_rate"], np.mean([r["success_rate"] for r in history[-3:]])
    assert last > first + 0.3, [r["success_rate"] for r in history]
    # Every group's slots were started from one shared start index.
    indices = np.asarray(trainer.env.reset_options[0]["initial_state_index"]).reshape(4, 4)
    assert (indices == indices[:, :1]).all()
    with pytest.raises(InputError, match="multiple of group_size"):
        GRPOTrainer(trainer.policy, ReachRight(6), GRPOConfig(group_size=4))


def test_a_narrow_gaussian_that_moves_far_keeps_finite_weights():
    # log std -4 over 4 dims and a large step: the second epoch's log-ratios reach hundreds, whose exp() overflowed
    # float32 and turned every weight NaN.
    trainer = toy_trainer(learning_rate=0.3, kl_coef=0.1, update_epochs=4)
    with torch.no_grad():
        trainer.policy.log_std.fill_(-4.0)
        trainer.reference.log_std.fill_(-4.0)
    history = trainer.train(progress=False)
    assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())
    assert all(np.isfinite(r["kl_to_reference"]) and np.isfinite(r["policy_loss"]) for r in history)
    # A non-finite loss (here: a corrupted advantage) is a clear error, not NaN weights.
    rollout = trainer.collect()
    rollout.advantages[0] = float("inf")
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    with pytest.raises(FloatingPointError, match="loss is not finite"):
        trainer.update(rollout)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_the_guard_replays_in_the_background_with_the_numbers_of_an_inline_guard(tmp_path):
    import threading

    def slow_guard(indices, chunks, lengths):  # the "real simulator": success iff the first action's x > 0.5
        threads.add(threading.current_thread().name)
        time.sleep(0.05)  # still running when the next iteration starts
        return {"success": chunks[:, 0, 0, 0] > 0.5, "final_coverage": chunks[:, 0, 0, 0].clip(0, 1)}

    histories = {}
    for background in (False, True):
        threads = set()
        trainer = toy_trainer(iterations=4, guard_every=2, guard_in_background=background)
        trainer.guard = slow_guard
        histories[background] = trainer.train(progress=False, checkpoint_path=tmp_path / f"{background}.safetensors")
        assert all(name.startswith("grpo-guard") for name in threads) == background
        # The checkpoint's history has the last iteration's replay too.
        saved = GRPOTrainer.load(tmp_path / f"{background}.safetensors", ReachRight(16)).history
        assert [bool(r.get("guard")) for r in saved] == [True, False, True, False]
    timing = {"guard_s", "rollout_s", "env_s", "update_s"}
    for inline, background in zip(histories[False], histories[True], strict=True):
        assert {k: v for k, v in inline.items() if k not in timing} == {
            k: v for k, v in background.items() if k not in timing}
    assert histories[True][2]["replayed_success_rate"] == histories[False][2]["replayed_success_rate"]

    def failing_guard(indices, chunks, lengths):
        raise RuntimeError("simulator worker died")

    trainer = toy_trainer(iterations=3, guard_every=1)
    trainer.guard = failing_guard
    with pytest.raises(RuntimeError, match="simulator worker died"):
        trainer.train(progress=False)
    assert trainer._guard_thread is None  # the thread is gone with the loop


def test_grpo_resumes_exactly(tmp_path):
    straight = toy_trainer(kl_coef=0.1)
    straight.train(iterations=3, progress=False)

    first = toy_trainer(kl_coef=0.1)
    reference = first.reference
    first.train(iterations=2, progress=False, checkpoint_path=tmp_path / "grpo.safetensors")
    resumed = GRPOTrainer.load(tmp_path / "grpo.safetensors", ReachRight(16), reference=reference)
    assert resumed.iteration == 2 and len(resumed.history) == 2
    resumed.train(iterations=3, progress=False)
    for name, value in straight.policy.state_dict().items():
        assert torch.equal(value, resumed.policy.state_dict()[name]), name
    assert [r["mean_return"] for r in resumed.history] == [r["mean_return"] for r in straight.history]
    with pytest.raises(InputError, match="reference"):
        GRPOTrainer.load(tmp_path / "grpo.safetensors", ReachRight(16))


class SlowReachRight(ReachRight):
    def step(self, actions):
        time.sleep(0.1)
        return super().step(actions)


def test_a_time_budget_stops_between_iterations_and_the_run_continues(tmp_path):
    trainer = toy_trainer(iterations=10)
    trainer.env = SlowReachRight(16)
    with pytest.raises(InputError, match="max_seconds"):
        trainer.train(max_seconds=0, progress=False)
    started = time.perf_counter()
    trainer.train(max_seconds=0.25, progress=False, checkpoint_path=tmp_path / "grpo.safetensors")
    done = trainer.iteration
    assert 1 <= done < 10 and time.perf_counter() - started < 2.0  # stopped early, not after all 10 (>= 1 s)
    assert GRPOTrainer.load(tmp_path / "grpo.safetensors", ReachRight(16)).iteration == done  # checkpointed
    trainer.train(progress=False)  # no budget: continues to the total
    assert trainer.iteration == 10 and len(trainer.history) == 10


def _pusht_starts(image_size):
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.tasks.pusht.starts import DemoStartStates

    return DemoStartStates.from_seeds([1, 2, 3], image_size=image_size)


def _stats():
    from cosmos3_gym.processor import ActionStats

    return ActionStats.from_json({"action": {"min": [0.0, 0.0], "max": [512.0, 512.0]}}, mode="minmax")


@pytest.mark.sim
def test_grpo_runs_in_the_gym_pusht_vector_env():
    from cosmos3_gym.tasks.pusht.sim_vector_env import PushTSimVectorEnv

    starts = _pusht_starts((64, 64))
    env = PushTSimVectorEnv(4, starts=starts, action_stats=_stats(), group_size=2, image_size=(64, 64),
                            observation_size=(32, 32), max_episode_steps=2)
    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(**SMALL))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    try:
        trainer = GRPOTrainer(policy, env, GRPOConfig(iterations=2, group_size=2, horizon=2, minibatch_size=4,
                                                      update_epochs=1, coverage_weight=1.0))
        history = trainer.train(progress=False)
    finally:
        env.close()
    assert len(history) == 2 and history[-1]["env_steps_total"] == 16
    assert 0.0 <= history[0]["mean_final_score"] <= 1.0
    # With the coverage term every group whose slots moved the block differently is informative and updates
    # (seeded: the first iteration's slots moved the block apart in one of the two groups).
    assert history[0]["informative_groups"] > 0, [r["informative_groups"] for r in history]
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())


@pytest.mark.sim
def test_grpo_in_the_tiny_world_model_with_the_replay_guard(tiny_checkpoint):
    from cosmos3_gym.envs.vector_env import WorldModelVectorEnv
    from cosmos3_gym.tasks.pusht.replay import replay_in_simulator
    from cosmos3_gym.tasks.pusht.sim_vector_env import PushTSimVectorEnv

    starts = _pusht_starts((64, 64))
    world = WorldModelVectorEnv(4, checkpoint=tiny_checkpoint, domain="pusht", raw_action_dim=2, chunk=4,
                                num_steps=1, guidance_scale=1.0, resolution_tier=256, fps=10.0, initial_states=starts,
                                reward_model="pusht_geometric", success_threshold=0.95, max_episode_steps=2,
                                observation_size=(32, 32))
    simulator = PushTSimVectorEnv(4, starts=starts, action_stats=_stats(), chunk=4, image_size=(64, 64),
                                  observation_size=(32, 32), max_episode_steps=2)
    replays = []

    def guard(indices, chunks, lengths):
        replays.append((indices.copy(), lengths.copy()))
        return replay_in_simulator(simulator, indices, chunks, lengths)

    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(chunk=4, **SMALL))
    try:
        trainer = GRPOTrainer(policy, world, GRPOConfig(iterations=1, group_size=2, horizon=2, minibatch_size=4,
                                                        update_epochs=1), guard=guard)
        record = trainer.train(progress=False)[0]
    finally:
        world.close()
        simulator.close()
    # Random frames hold no T: the geometric reward pays nothing, so no imagined success, and the guard replayed the
    # same starts for the imagined lengths.
    assert record["imagined_success_rate"] == 0.0 and record["mean_final_score"] == 0.0
    indices, lengths = replays[0]
    assert (indices.reshape(2, 2) == indices.reshape(2, 2)[:, :1]).all() and (lengths == 2).all()
    assert 0.0 <= record["replayed_final_coverage"] <= 1.0
