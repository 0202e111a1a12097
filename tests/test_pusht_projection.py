"""The PushT env's ``rigid_block`` option (``envs.pusht_projection``): the hand-over frame re-drawn by gym-pusht from
the state read off it. Needs gym-pusht (skipped without it), except the option's checks."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import cosmos3_gym  # noqa: F401  (registers the env ids)
from cosmos3_gym.errors import InputError
from cosmos3_gym.tasks.pusht import env as pusht_env
from cosmos3_gym.tasks.pusht import projection as pusht_projection
from cosmos3_gym.tasks.pusht.projection import RigidBlockProjection, check_rigid_block
from cosmos3_gym.tasks.pusht.reward import rigidity

SIZE = (256, 256)  # the built-in model's frames
def needs_gym_pusht(test):
    """The test runs gym-pusht: skipped without it, and selected by ``pytest -m sim`` (CI, after the sim extra)."""
    return pytest.mark.sim(pytest.mark.skipif(not pusht_projection.has_gym_pusht(), reason="needs gym-pusht")(test))


def _state(agent=(100.0, 400.0), block=(250.0, 220.0, 0.6)) -> np.ndarray:
    return np.array([[*agent, *block]], np.float64)


@pytest.fixture(scope="module")
def projection():  # its tests are all marked needs_gym_pusht
    projection = RigidBlockProjection()
    yield projection
    projection.close()


def _simulator_frames(count: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """gym-pusht's reset frames of seeds 0.. and their true states ``[N, 5]`` (agent x, y, block x, y, angle)."""
    from cosmos3_gym.tasks.pusht.sim import PushTSim

    sim = PushTSim(SIZE)
    frames, states = [], []
    for seed in range(count):
        frames.append(sim.reset(seed))
        state = sim.sim_state
        states.append([state[0], state[1], state[4], state[5], state[6]])
    sim.close()
    return np.stack(frames), np.array(states)


def _wrapped(angle: np.ndarray) -> np.ndarray:
    return (angle + np.pi) % (2 * np.pi) - np.pi


@needs_gym_pusht
def test_a_simulator_frame_reads_its_true_state_and_projects_onto_itself(projection):
    frames, truth = _simulator_frames()
    states, found = projection.read_state(frames)
    assert found.all()
    # fit_tee's pose is gym-pusht's block.position / block.angle (same body origin), the agent its disc's centre.
    np.testing.assert_allclose(states[:, :4], truth[:, :4], atol=1.5)
    assert np.degrees(np.abs(_wrapped(states[:, 4] - truth[:, 4]))).max() < 1.0
    projected, found = projection(frames)
    assert found.all()
    difference = np.abs(projected.astype(np.int16) - frames.astype(np.int16)).max(-1)
    assert difference.mean() < 0.5  # of 255
    assert (difference > 30).mean() < 0.01  # only a thin seam along the block's edges, where sub-pixel pose shows
    np.testing.assert_allclose(rigidity(projected), rigidity(frames), atol=0.01)


def _body_xy(pose) -> tuple[np.ndarray, np.ndarray]:
    """Each pixel centre of a ``SIZE`` frame in the body frame of a block at ``pose`` (x, y, angle)."""
    rows, columns = np.mgrid[0:SIZE[0], 0:SIZE[1]]
    x, y = (columns + 0.5) * 512 / SIZE[1] - pose[0], (rows + 0.5) * 512 / SIZE[0] - pose[1]
    return np.cos(pose[2]) * x + np.sin(pose[2]) * y, -np.sin(pose[2]) * x + np.cos(pose[2]) * y


@needs_gym_pusht
def test_a_bent_block_becomes_a_rigid_tee(projection):
    # The bar of a T at angle 0.6 and the stem of a T at angle 0.75 (turned about the body origin, the middle of the
    # bar's outer edge): a bent T, drawn on the table without a block; each part with gym-pusht's outline (2 px).
    bar_pose, stem_pose = (250.0, 220.0, 0.6), (250.0, 220.0, 0.75)
    bent = projection.render(_state(block=(-400.0, -400.0, 0.0)), SIZE)[0]
    x, y = _body_xy(stem_pose)
    stem = (np.abs(x) <= 17) & (y >= 30) & (y <= 122)
    bent[stem] = projection.render(_state(block=stem_pose), SIZE)[0][stem]
    x, y = _body_xy(bar_pose)
    bar = (np.abs(x) <= 62) & (y >= -2) & (y <= 32)
    bent[bar] = projection.render(_state(block=bar_pose), SIZE)[0][bar]
    simulator_rigidity = rigidity(projection.render(_state(block=bar_pose), SIZE))[0]
    assert rigidity(bent[None])[0] < simulator_rigidity - 0.05
    projected, found = projection(bent[None])
    assert found.all()
    assert rigidity(projected)[0] == pytest.approx(simulator_rigidity, abs=0.01)
    # Re-drawn from the state read off the bent frame (rigidity 0.80, as the model's by chunk 3): the agent where it
    # was, the block about where the parts are.
    states, _ = projection.read_state(projected)
    np.testing.assert_allclose(states[0, :2], [100.0, 400.0], atol=1.5)
    np.testing.assert_allclose(states[0, 2:4], bar_pose[:2], atol=8.0)
    assert 0.5 < _wrapped(states[0, 4]) < 0.85
    # A threshold above its rigidity keeps it as generated.
    kept, found = RigidBlockProjection(min_rigidity=0.9)(bent[None])
    assert not found.any()
    np.testing.assert_array_equal(kept, bent[None])


@needs_gym_pusht
def test_frames_without_a_block_or_an_agent_pass_unchanged(projection):
    off_table = (-400.0, -400.0)
    without_block = projection.render(_state(block=(*off_table, 0.0)), SIZE)
    without_agent = projection.render(_state(agent=off_table), SIZE)
    blank = np.full((1, *SIZE, 3), 255, np.uint8)
    frames = np.concatenate([without_block, without_agent, blank])
    projected, found = projection(frames)
    assert not found.any()
    np.testing.assert_array_equal(projected, frames)


def test_rigid_block_takes_only_a_bool_and_names_gym_pusht_when_missing(monkeypatch):
    for bad in ("yes", 1, None, 0.0):
        with pytest.raises(InputError, match="rigid_block"):
            check_rigid_block(bad)
    for bad in (1.5, -0.1, "0.8", True):
        with pytest.raises(InputError, match="min_rigidity"):
            RigidBlockProjection(min_rigidity=bad)
    assert check_rigid_block(False) is False
    monkeypatch.setattr(pusht_projection, "has_gym_pusht", lambda: False)
    assert check_rigid_block(False) is False  # off: no simulator needed
    with pytest.raises(ImportError, match="rigid_block=True.*gym-pusht"):
        check_rigid_block(True)


def test_the_built_in_model_this_file_needs_is_installed():
    """The built-in model ships with the package: its absence fails (issue 43: it used to skip the test below)."""
    assert pusht_env.load_pusht_assets().checkpoint == pusht_env.builtin_checkpoint_dir()


@needs_gym_pusht
def test_pusht_env_rigid_block_projects_only_the_hand_over_frame(projection):
    pusht_env.load_pusht_assets()  # a model that fails to load fails here, with its CheckpointError
    with pytest.raises(InputError, match="rigid_block"):
        gym.make("cosmos3_gym/PushT-v0", rigid_block="on")
    steps = {}
    for rigid_block in (False, True):
        env = gym.make("cosmos3_gym/PushT-v0", rigid_block=rigid_block, return_frames=True)
        env.reset(seed=3)
        env.action_space.seed(3)
        steps[rigid_block] = [env.step(env.action_space.sample()) for _ in range(2)]
        current = env.unwrapped._core.frame(0)
        env.close()
    (plain_observation, *_, plain_info), _ = steps[False]
    (observation, *_, info), (second_observation, *_, second_info) = steps[True]
    assert "handover_projected" not in plain_info
    assert info["handover_projected"] and second_info["handover_projected"]
    # Same seed, same start: the chunk's frames as generated, the last one re-drawn from the state read off it; the
    # observation is that frame, and the next chunk started from it.
    np.testing.assert_array_equal(info["frames"][:-1], plain_info["frames"][:-1])
    np.testing.assert_array_equal(info["frames"][-1], projection(plain_info["frames"][-1:])[0][0])
    np.testing.assert_array_equal(observation["image"], info["frames"][-1])
    np.testing.assert_array_equal(second_observation["image"], current)
    assert rigidity(second_info["frames"][-1:])[0] > 0.94
