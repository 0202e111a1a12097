"""Starts from demonstrations (frames + simulator states from any step) and the gym-pusht vector env with group
resets: the simulator side of the RL recipe."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

pytest.importorskip("gym_pusht")

from cosmos3_gym.data.initial_states import InitialStateSource, resize_frame  # noqa: E402
from cosmos3_gym.errors import InputError  # noqa: E402
from cosmos3_gym.processor import ActionStats  # noqa: E402
from cosmos3_gym.tasks.pusht import episodes as pusht  # noqa: E402
from cosmos3_gym.tasks.pusht.replay import evaluate_in_simulator, replay_in_simulator  # noqa: E402
from cosmos3_gym.tasks.pusht.sim_vector_env import PushTSimVectorEnv  # noqa: E402
from cosmos3_gym.tasks.pusht.starts import DemoStartStates, SimInitialState  # noqa: E402

pytestmark = pytest.mark.sim  # needs gym-pusht (the sim extra)

STATS = ActionStats.from_json({"action": {"min": [0.0, 0.0], "max": [512.0, 512.0]}}, mode="minmax")


@pytest.fixture(scope="module")
def episode():
    sim = pusht.PushTSim((64, 64))
    try:
        return pusht.rollout_episode(sim, pusht.ScriptedPusher(np.random.default_rng(0)), 5, 40)
    finally:
        sim.close()


def make_env(starts, num_envs=4, **kwargs):
    return PushTSimVectorEnv(num_envs, starts=starts, action_stats=STATS, image_size=(64, 64),
                             observation_size=(32, 32), **kwargs)


def test_restore_continues_a_recorded_episode(episode):
    sim = pusht.PushTSim((64, 64), render_every_step=False)
    try:
        sim.restore(episode["sim_states"][17])
        np.testing.assert_array_equal(sim.render(), episode["frames"][17])
        for action in episode["actions"][17:]:
            sim.step(action)
        # pymunk's cached contact impulses are not part of the state: in contact the paths part by hundredths of a px.
        np.testing.assert_allclose(sim.sim_state[[0, 1, 4, 5]], episode["sim_states"][-1][[0, 1, 4, 5]], atol=0.5)
        assert sim.sim_state[6] == pytest.approx(episode["sim_states"][-1][6], abs=0.01)
        assert sim.coverage == pytest.approx(float(episode["coverage"][-1]), abs=0.01)
        with pytest.raises(InputError, match="sim_state"):
            sim.restore(np.zeros(3))
    finally:
        sim.close()


def test_demo_starts_yield_frames_and_simulator_states_from_any_step(episode, tmp_path):
    starts = DemoStartStates.from_episodes([episode], stride=8, image_size=(64, 64))
    assert isinstance(starts, InitialStateSource)
    assert starts.steps.tolist() == [0, 8, 16, 24, 32]
    item = starts[2]
    assert isinstance(item, SimInitialState) and item.step == 16 and item.task == pusht.TASK
    np.testing.assert_array_equal(item.frame, episode["frames"][16])  # rendered from the state: the same pixels
    np.testing.assert_array_equal(item.sim_state, episode["sim_states"][16])
    loaded = DemoStartStates.load(starts.save(tmp_path / "starts.npz"))
    np.testing.assert_array_equal(loaded.sim_states, starts.sim_states)
    np.testing.assert_array_equal(loaded[4].frame, starts[4].frame)
    with pytest.raises(InputError, match="initial_state_index"):
        starts[5]
    with pytest.raises(InputError, match="sim_states"):
        DemoStartStates.from_episodes([{"frames": episode["frames"]}])


def test_a_start_is_rendered_once_while_it_is_kept(episode, monkeypatch):
    """A group's slots reset from one start: it is rendered once, and each read gets its own copy."""
    from cosmos3_gym.tasks.pusht import starts as starts_module

    renders = []
    put_in_start = starts_module.put_in_start
    monkeypatch.setattr(starts_module, "put_in_start", lambda *a: (renders.append(1), put_in_start(*a))[1])
    monkeypatch.setattr(starts_module, "RENDERED_FRAMES_KEPT", 2)
    starts = DemoStartStates.from_episodes([episode], stride=8, image_size=(64, 64))
    first, again = starts.frame(2), starts[2].frame
    assert len(renders) == 1
    np.testing.assert_array_equal(first, episode["frames"][16])
    np.testing.assert_array_equal(again, first)
    first[:] = 0  # a caller's copy: what the next read gets is untouched
    np.testing.assert_array_equal(starts.frame(2), episode["frames"][16])
    starts.frame(0), starts.frame(1)  # two more starts: 2, the least recently read, is dropped
    assert len(renders) == 3
    starts.frame(1)
    assert len(renders) == 3
    np.testing.assert_array_equal(starts.frame(2), episode["frames"][16])
    assert len(renders) == 4
    import pickle

    assert not pickle.loads(pickle.dumps(starts))._rendered  # workers render their own: no frames in the pickle


def test_group_resets_share_starts_and_survive_autoreset(episode):
    starts = DemoStartStates.from_episodes([episode], stride=4, image_size=(64, 64))
    with pytest.raises(InputError, match="multiple of group_size"):
        make_env(starts, num_envs=6, group_size=4)
    env = make_env(starts, num_envs=6, group_size=3, max_episode_steps=2)
    try:
        observations, info = env.reset(seed=3)
        assert info["group"].tolist() == [0, 0, 0, 1, 1, 1]
        index = info["initial_state_index"]
        assert len(set(index[:3])) == 1 and len(set(index[3:])) == 1
        np.testing.assert_array_equal(observations["image"][0], observations["image"][2])
        expected = resize_frame(starts.frame(int(index[0])), (32, 32))
        np.testing.assert_array_equal(observations["image"][0], expected)

        still = np.zeros((6, 8, 2), np.float32)  # all slots truncate together after two chunks
        env.step(still)
        _, _, terminated, truncated, info = env.step(still)
        assert (truncated | terminated).all()
        _, rewards, terminated, truncated, info = env.step(still)  # NEXT_STEP: the groups restart
        assert not (terminated | truncated).any() and (info["elapsed_steps"] == 0).all()
        new = info["initial_state_index"]
        assert len(set(new[:3])) == 1 and len(set(new[3:])) == 1
    finally:
        env.close()


def test_a_finished_slot_waits_for_its_group(episode):
    starts = DemoStartStates.from_episodes([episode], stride=8, image_size=(64, 64))
    env = make_env(starts, num_envs=4, group_size=2, max_episode_steps=3)
    try:
        env.reset(seed=0, options={"initial_state_index": [1, 1, 2, 2]})
        env._elapsed[0] = 2  # slot 0 is one chunk before its limit: it finishes first
        _, _, _, truncated, info = env.step(np.zeros((4, 8, 2), np.float32))
        assert truncated.tolist() == [True, False, False, False]
        observations, rewards, terminated, truncated, info = env.step(np.zeros((4, 8, 2), np.float32))
        assert info["waiting"].tolist() == [True, False, False, False]
        assert rewards[0] == 0 and not terminated[0] and not truncated[0]
        assert info["elapsed_steps"][0] == 3 and info["elapsed_steps"][1] == 2
        with pytest.raises(InputError, match="whole groups"):
            env.reset(options={"reset_mask": np.array([True, False, False, False])})
        with pytest.raises(InputError, match="equal indices within each group"):
            env.reset(options={"initial_state_index": [0, 1, 2, 2]})
    finally:
        env.close()


def test_same_step_autoreset_reports_final_observations(episode):
    starts = DemoStartStates.from_episodes([episode], stride=8, image_size=(64, 64))
    env = make_env(starts, num_envs=2, group_size=2, max_episode_steps=1, autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        env.reset(seed=1)
        _, _, _, truncated, info = env.step(np.zeros((2, 8, 2), np.float32))
        assert truncated.all() and info["_final_obs"].all()
        assert info["final_obs"][0]["image"].shape == (32, 32, 3)
        assert (info["elapsed_steps"] == 0).all()  # already restarted
    finally:
        env.close()


def test_worker_processes_give_the_same_rollouts(episode):
    starts = DemoStartStates.from_episodes([episode], stride=8, image_size=(64, 64))
    actions = np.random.default_rng(0).uniform(-1, 1, (3, 4, 8, 2)).astype(np.float32)
    results = []
    for workers in (0, 2):
        env = make_env(starts, num_envs=4, group_size=2, max_episode_steps=3, workers=workers)
        try:
            observations, _ = env.reset(seed=0)
            frames = [observations["image"]]
            for chunk in actions:
                frames.append(env.step(chunk)[0]["image"])
            results.append(np.stack(frames))
        finally:
            env.close()
    np.testing.assert_array_equal(results[0], results[1])


def test_replay_and_evaluation_in_the_simulator(episode):
    starts = DemoStartStates.from_episodes([episode], stride=8, image_size=(64, 64))
    env = make_env(starts, num_envs=2, max_episode_steps=5)
    try:
        # The scripted pusher's own actions (normalised), replayed from step 0: the recorded coverage comes back.
        recorded = episode["actions"][:40].reshape(5, 8, 2) / 512.0 * 2 - 1
        chunks = np.stack([recorded, recorded])
        replayed = replay_in_simulator(env, np.array([0, 0]), chunks, np.array([5, 2]))
        coverage = float(episode["coverage"][40])
        assert replayed["final_coverage"][0] == pytest.approx(coverage, abs=2e-3)
        assert replayed["final_coverage"][1] == pytest.approx(float(episode["coverage"][16]), abs=2e-3)

        class Still:
            def act(self, observations, deterministic=True):
                return np.zeros((len(observations["image"]), 8, 2), np.float32)

        result = evaluate_in_simulator(Still(), env, np.array([0, 4]), num_chunks=2)
        assert result["chunks"].tolist() == [2, 2] and result["success"].dtype == bool
    finally:
        env.close()


def test_demonstrations_execute_noisy_actions_and_label_the_clean_ones():
    from cosmos3_gym.tasks.pusht.demos import generate_demonstrations
    from cosmos3_gym.tasks.pusht.policies import ScriptedPusher

    common = dict(action_stats=STATS, seed=3, max_steps=12, chunk=4, image_size=(64, 64), observation_size=(32, 32),
                  noise_levels=(0.0,), workers=1, progress=False)
    clean = generate_demonstrations(1, execution_noise=(0.0,), **common)
    noisy = generate_demonstrations(1, execution_noise=(20.0,), **common)
    episode = noisy["episodes"][0]
    assert episode["execution_noise"] == 20.0 and episode["steps"] == 12
    assert noisy["observations"].shape == (12, 32, 32, 3) and noisy["action_chunks"].shape == (12, 4, 2)
    # Same start, different executed actions: the paths part.
    np.testing.assert_array_equal(clean["episodes"][0]["sim_states"][0], episode["sim_states"][0])
    assert np.abs(clean["episodes"][0]["sim_states"][-1] - episode["sim_states"][-1]).max() > 1.0
    # Labels: what the noise-free scripted pusher asks for in the states the noisy execution reached.
    pusher = ScriptedPusher(np.random.default_rng(0))
    wanted = [pusher(state[0:2], state[4:7]) for state in episode["sim_states"][:-1]]
    labels = np.clip(STATS.normalize(np.asarray(wanted, np.float32)), -1.0, 1.0)
    np.testing.assert_allclose(noisy["action_chunks"][:, 0], labels, atol=1e-5)
    np.testing.assert_allclose(noisy["action_chunks"][:-1, 1], labels[1:], atol=1e-5)
    with pytest.raises(InputError, match="execution_noise"):
        generate_demonstrations(1, execution_noise=(-1.0,), **common)


def test_reset_starts_are_gym_pushts_own_resets(tmp_path):
    """Seed 400013's agent starts touching the block: gym-pusht's reset steps the physics once, so its frame draws the
    contact and its first step is warm-started. A start from ``from_seeds`` must be that reset exactly (frame and
    physics), not a restore of the state (which differs by pixels at once and by tenths of a pixel after one step),
    so that evaluations from these starts and ``cosmos3-gym eval-real`` see the same episodes."""
    seeds = [400013, 400001]
    starts = DemoStartStates.from_seeds(seeds, image_size=(64, 64))
    assert starts.seeds.tolist() == seeds
    loaded = DemoStartStates.load(starts.save(tmp_path / "resets.npz"))
    assert loaded.seeds.tolist() == seeds and loaded.subset([1]).seeds.tolist() == [400001]
    assert DemoStartStates(starts.sim_states).seeds.tolist() == [-1, -1]  # not resets unless told
    targets = np.random.default_rng(0).uniform(50, 450, size=(40, 2))
    reference = pusht.PushTSim((64, 64))
    restored = pusht.PushTSim((64, 64), render_every_step=False)
    env = make_env(loaded, num_envs=2, chunk=8, max_episode_steps=5)
    try:
        frame = reference.reset(seeds[0])
        np.testing.assert_array_equal(loaded.frame(0), frame)
        restored.restore(reference.sim_state)
        assert not np.array_equal(restored.render(), frame)  # what a restore alone would have shown
        observations, _ = env.reset(options={"initial_state_index": np.array([0, 1])})
        np.testing.assert_array_equal(observations["image"][0], resize_frame(frame, (32, 32)))
        coverage = []
        for target in targets:
            reference.step(target)
            coverage.append(reference.coverage)
        actions = STATS.normalize(targets).reshape(5, 8, 2).astype(np.float32)
        replayed = []
        for chunk in actions:
            _, _, terminated, truncated, info = env.step(np.stack([chunk, chunk]))
            replayed.append(float(info["coverage"][0]))
            if terminated[0] or truncated[0]:
                break
        np.testing.assert_array_equal(replayed, np.asarray(coverage)[7::8][:len(replayed)])
    finally:
        env.close()
        reference.close()
        restored.close()
    # A seed whose reset gives another state (another gym-pusht version) falls back to the state.
    sim = pusht.PushTSim((64, 64), render_every_step=False)
    try:
        other = starts.sim_states[1]
        from cosmos3_gym.tasks.pusht.starts import put_in_start

        put_in_start(sim, other, seeds[0])
        np.testing.assert_array_equal(sim.sim_state, other)
    finally:
        sim.close()
