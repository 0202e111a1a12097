"""DAgger: the simulator's privileged expert labels (the scripted pusher planned in a private copy of the physics)
and the rounds of labelled rollouts and fine-tuning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gym_pusht")

from cosmos3_gym.errors import InputError  # noqa: E402
from cosmos3_gym.processor import ActionStats  # noqa: E402
from cosmos3_gym.rl.bc import BCConfig  # noqa: E402
from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig  # noqa: E402
from cosmos3_gym.tasks.pusht.dagger import DAggerConfig, collect_labelled_rollouts, train_dagger  # noqa: E402
from cosmos3_gym.tasks.pusht.policies import ScriptedPusher, plan_chunk_in_physics  # noqa: E402
from cosmos3_gym.tasks.pusht.replay import policy_rollout_starts  # noqa: E402
from cosmos3_gym.tasks.pusht.sim import PushTSim  # noqa: E402
from cosmos3_gym.tasks.pusht.sim_vector_env import PushTSimVectorEnv  # noqa: E402
from cosmos3_gym.tasks.pusht.starts import DemoStartStates  # noqa: E402

pytestmark = pytest.mark.sim  # needs gym-pusht (the sim extra)

STATS = ActionStats.from_json({"action": {"min": [0.0, 0.0], "max": [512.0, 512.0]}}, mode="minmax")
SMALL = dict(channels=(8, 8, 8, 8), hidden=16, image_size=32)


def make_env(num_envs, first_seed=300, **kwargs):
    starts = DemoStartStates.from_seeds(range(first_seed, first_seed + num_envs), image_size=(64, 64))
    return PushTSimVectorEnv(num_envs, starts=starts, action_stats=STATS, image_size=(64, 64),
                             observation_size=(32, 32), max_episode_steps=40, **kwargs)


def test_a_planned_chunk_is_what_the_pusher_does_closed_loop():
    sim, planner = PushTSim((16, 16), render_every_step=False), PushTSim((16, 16), render_every_step=False)
    try:
        sim.reset(7)
        for _ in range(20):  # somewhere mid-task, in contact with some velocity
            sim.step(ScriptedPusher(np.random.default_rng(0))(sim.agent_xy, sim.block_pose))
        state = sim.sim_state
        planned = plan_chunk_in_physics(planner, ScriptedPusher(np.random.default_rng(0)), state, 8)
        sim.restore(state)
        pusher, closed_loop = ScriptedPusher(np.random.default_rng(0)), []
        for _ in range(8):
            closed_loop.append(pusher(sim.agent_xy, sim.block_pose))
            sim.step(closed_loop[-1])
        np.testing.assert_allclose(planned, np.asarray(closed_loop), atol=1e-4)
        assert not np.allclose(planned[0], planned[-1])  # it moved
    finally:
        sim.close()
        planner.close()


def test_expert_chunks_label_every_slot_and_solve_the_task():
    env = make_env(4, workers=2)
    try:
        with pytest.raises(InputError, match="reset"):
            env.expert_action_chunks()
        env.reset(options={"initial_state_index": np.arange(4)})
        labels = env.expert_action_chunks()
        assert labels.shape == (4, 8, 2) and labels.dtype == np.float32 and np.abs(labels).max() <= 1.0
        np.testing.assert_array_equal(labels, env.expert_action_chunks())  # planning leaves the slots untouched
        success = np.zeros(4, bool)
        for _ in range(40):
            _, _, terminated, truncated, _ = env.step(env.expert_action_chunks())
            success |= terminated
            if (terminated | truncated).all():
                break
        assert success.mean() >= 0.75  # the scripted pusher's rate, executed a chunk at a time
    finally:
        env.close()


def test_labelled_rollouts_record_the_experts_chunk_at_every_visited_state():
    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(**SMALL))
    env = make_env(3)
    try:
        expert = collect_labelled_rollouts(policy, env, np.arange(3), 40, 1.0, np.random.default_rng(0))
        untrained = collect_labelled_rollouts(policy, env, np.arange(3), 3, 0.0, np.random.default_rng(0))
        with pytest.raises(InputError, match="group_size 1"):
            collect_labelled_rollouts(policy, env, np.arange(2), 3, 0.0, np.random.default_rng(0))
    finally:
        env.close()
    assert expert["success"].mean() >= 2 / 3 and expert["final_coverage"].max() > 0.95
    assert len(expert["observations"]) == len(expert["labels"]) and expert["observations"].shape[1:] == (32, 32, 3)
    # An untrained policy never succeeds in 3 chunks: every slot is recorded at every chunk.
    assert not untrained["success"].any() and len(untrained["labels"]) == 9


def test_dagger_rounds_aggregate_labels_and_fine_tune_the_policy():
    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(**SMALL))
    before = [p.detach().clone() for p in policy.parameters()]
    config = DAggerConfig(rounds=2, chunks=2, expert_probability=0.5,
                          bc=BCConfig(steps=3, batch_size=4, learning_rate=1e-3))
    env = make_env(2)
    try:
        history = train_dagger(policy, env, lambda r: np.array([2 * r, 2 * r + 1]) % 2, config, progress=False)
    finally:
        env.close()
    assert [r["round"] for r in history] == [0, 1]
    assert [r["expert_probability"] for r in history] == [0.5, 0.25]
    assert history[1]["samples"] == history[0]["new_samples"] + history[1]["new_samples"] <= 8
    assert all(r["bc_steps"] == 3 and np.isfinite(r["final_loss"]) for r in history)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    with pytest.raises(InputError, match="rounds"):
        DAggerConfig(rounds=0)
    with pytest.raises(InputError, match="expert_probability"):
        DAggerConfig(expert_probability=1.5)


class _Expert:
    def __init__(self, env):
        self.env = env
        self.chunks = []

    def act(self, observations, deterministic=True):
        self.chunks.append(self.env.expert_action_chunks())
        return self.chunks[-1]


def test_policy_rollout_starts_are_the_states_before_every_chunk_the_policy_took(tmp_path):
    env = make_env(3, workers=2)
    try:
        with pytest.raises(InputError, match="reset"):
            env.sim_states()
        expert = _Expert(env)
        starts = policy_rollout_starts(expert, env, [2, 0, 1], 40, image_size=(64, 64))
        replay = env.starts
        # Each episode's first state is its reset; then one state per chunk it took, none after success.
        for start in [2, 0, 1]:
            mine = np.flatnonzero(starts.episodes == start)
            np.testing.assert_allclose(starts.sim_states[mine[0]], replay.sim_states[start])
            np.testing.assert_array_equal(starts.steps[mine], np.arange(len(mine)) * 8)
        assert len(starts) < 3 * 40  # the expert succeeds early
        assert "3 policy rollouts" in starts.description
        loaded = DemoStartStates.load(starts.save(tmp_path / "starts.npz"))
        assert loaded.description == starts.description and np.array_equal(loaded.sim_states, starts.sim_states)
        # Restarting from a recorded state and executing the chunk taken there reaches the next recorded state.
        first = np.flatnonzero(starts.episodes == 0)
        env2 = PushTSimVectorEnv(1, starts=starts, action_stats=STATS, image_size=(64, 64),
                                 observation_size=(32, 32))
        try:
            env2.reset(options={"initial_state_index": int(first[3])})
            env2.step(expert.chunks[3][1:2])
            np.testing.assert_allclose(env2.sim_states()[0], starts.sim_states[first[4]], atol=1e-6)
        finally:
            env2.close()
    finally:
        env.close()
