"""Self-forcing samples with a consistent target (``cosmos3_gym.tasks.pusht.self_forcing``, issue 42 item 3).

A stand-in world model "generates" each source episode's own future with the block moved by a known offset, so the
state every sample must start from is known: frame 0 is exactly the generated frame, the state read off it is the
moved block and the real agent, the continuation is gym-pusht's from that state under the episode's next actions,
and an unreadable frame gives no sample. One test runs the built-in world model itself on the CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from cosmos3_gym.data.episodes import read_episode_dataset
from cosmos3_gym.errors import InputError
from cosmos3_gym.processor import ActionStats
from cosmos3_gym.tasks.pusht.self_forcing import (
    SELF_FORCING_EPISODE_PREFIX,
    generate_self_forcing_episodes,
    plan_rollouts,
    sample_sheet,
)

CHUNK, DEPTH, ROLLOUTS, SLOTS, SEED = 8, 2, 2, 3, 5
SHIFT = np.array([9.0, -6.0])  # where the stand-in model moves every block (table pixels)


def test_rollout_plans_fit_their_episodes_and_depend_on_the_seed_alone():
    plan = plan_rollouts([40, 20, 24, 100], rollouts_per_episode=3, depth=2, chunk=8, seed=1)
    assert plan == plan_rollouts([40, 20, 24, 100], rollouts_per_episode=3, depth=2, chunk=8, seed=1)
    assert plan != plan_rollouts([40, 20, 24, 100], rollouts_per_episode=3, depth=2, chunk=8, seed=2)
    assert [e for e, _ in plan] == [0] * 3 + [2] * 3 + [3] * 3  # episode 1 is shorter than 3 chunks
    lengths = {0: 40, 2: 24, 3: 100}
    assert all(0 <= s <= lengths[e] - 3 * 8 for e, s in plan)
    assert {s for e, s in plan if e == 2} == {0}  # exactly as long as 3 chunks: one start fits
    for name in ("rollouts_per_episode", "depth", "chunk"):
        arguments = {**dict(rollouts_per_episode=1, depth=1, chunk=8, seed=0), name: 0}
        with pytest.raises(InputError, match=name):
            plan_rollouts([40], **arguments)


# ----------------------------------------------------------------------------------------------------------------
# With gym-pusht
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.tasks.pusht.dataset import generate_pusht_dataset

    return generate_pusht_dataset(tmp_path_factory.mktemp("sf") / "source", 2, steps_per_episode=40,
                                  image_size=(256, 256), policy_mix={"scripted": 1.0}, seed=3, workers=0,
                                  progress=False)


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}


class ShiftedFutureEnv:
    """A vector env in the world model's shape whose every chunk is the simulator's own future of the start frame it
    was reset to, with the block moved by ``SHIFT``; the rollout at ``blank`` (plan row, depth) generates a blank
    table. It is reset once per batch of the plan, in the plan's order."""

    def __init__(self, source: Path, plan: list[tuple[int, int]], blank: tuple[int, int]):
        from cosmos3_gym.tasks.pusht.sim import PushTSim

        self.episodes = [load(p) for p in sorted((source / "episodes").glob("episode_*.npz"))]
        self.plan, self.blank, self.resets = plan, blank, 0
        self.num_envs = SLOTS
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (CHUNK, 2), np.float32)
        self.sim = PushTSim((256, 256), render_every_step=False)
        self.generated: dict[tuple[int, int], np.ndarray] = {}  # (plan row, depth) -> the last frame of the chunk

    def reset(self, seed=None, options=None):
        rows = self.plan[self.resets * SLOTS : (self.resets + 1) * SLOTS]
        self.rows = [(self.resets * SLOTS + i, *row) for i, row in enumerate(rows)]
        self.rows += [self.rows[0]] * (SLOTS - len(self.rows))  # the generator pads the last batch
        for (_, episode, start), frame in zip(self.rows, options["frames"]):
            assert np.array_equal(frame, self.episodes[episode]["frames"][start])  # it starts from the real frame
        self.resets, self.depth = self.resets + 1, 0
        return None, {}

    def step(self, actions):
        assert actions.shape == (SLOTS, CHUNK, 2) and np.abs(actions).max() <= 1.0
        self.depth += 1
        frames = []
        for row, episode, start in self.rows:
            chunk = []
            for t in range(start + (self.depth - 1) * CHUNK + 1, start + self.depth * CHUNK + 1):
                state = self.episodes[episode]["sim_states"][t].copy()
                state[4:6] += SHIFT
                self.sim.restore(state)
                chunk.append(self.sim.render())
            if (row, self.depth) == self.blank:
                chunk[-1] = np.full_like(chunk[-1], 255)
            self.generated[(row, self.depth)] = chunk[-1]
            frames.append(np.stack(chunk))
        return None, np.zeros(SLOTS), np.zeros(SLOTS, bool), np.zeros(SLOTS, bool), {"frames": np.stack(frames)}


@pytest.fixture(scope="module")
def samples(source, tmp_path_factory):
    plan = plan_rollouts([40, 40], ROLLOUTS, DEPTH, CHUNK, SEED)
    env = ShiftedFutureEnv(source, plan, blank=(1, 2))
    out = tmp_path_factory.mktemp("sf") / "samples"
    report = generate_self_forcing_episodes(out, source, env, stats=ActionStats.from_json(source / "stats.json"),
                                            rollouts_per_episode=ROLLOUTS, depth=DEPTH, seed=SEED, workers=0,
                                            progress=False)
    return out, report, plan, env


@pytest.mark.sim
def test_each_sample_starts_from_the_generated_frame_and_continues_from_the_state_read_off_it(samples, source):
    from cosmos3_gym.tasks.pusht.sim import PushTSim

    out, report, plan, env = samples
    sources = [load(p) for p in sorted((source / "episodes").glob("episode_*.npz"))]
    paths = sorted((out / "episodes").glob(f"{SELF_FORCING_EPISODE_PREFIX}*.npz"))
    assert report["samples"] == len(paths) == len(plan) * DEPTH - 1 and report["frames_not_readable"] == 1
    assert report["samples_by_depth"] == [len(plan), len(plan) - 1]
    # the simulator's own frames, moved: rigid Ts, bar the blank table (no block: rigidity 0)
    assert report["fit_rigidity_by_depth"]["1"]["at_least_0.9"] == 1.0
    assert report["fit_rigidity_by_depth"]["2"]["frames"] == len(plan)
    assert report["fit_rigidity_by_depth"]["2"]["at_least_0.9"] == (len(plan) - 1) / len(plan)
    made = [(row, depth) for row in range(len(plan)) for depth in range(1, DEPTH + 1) if (row, depth) != (1, 2)]
    sim = PushTSim((256, 256))
    for path, (row, depth) in zip(paths, made):
        sample, (_, start) = load(path), plan[row]
        t, real = start + depth * CHUNK, sources[plan[row][0]]
        assert np.array_equal(sample["frames"][0], env.generated[(row, depth)])
        state = sample["sim_states"][0]
        # the moved block and the real agent, as read off the frame (rigid-T fit, agent disc)
        assert np.hypot(*(state[4:6] - real["sim_states"][t][4:6] - SHIFT)) < 2.0
        assert abs(math.remainder(state[6] - real["sim_states"][t][6], 2 * math.pi)) < math.radians(1.0)
        assert np.hypot(*(state[0:2] - real["sim_states"][t][0:2])) < 3.5
        assert np.array_equal(state[2:4], real["sim_states"][t][2:4]) and not state[7:].any()  # velocities
        np.testing.assert_array_equal(sample["actions"], real["actions"][t : t + CHUNK])
        # the continuation is the simulator's from that state, frame for frame
        sim.restore(state)
        for k, action in enumerate(sample["actions"], start=1):
            assert np.array_equal(sim.step(action), sample["frames"][k])
            np.testing.assert_array_equal(sim.sim_state, sample["sim_states"][k])
        assert not bool(sample["success"]) and str(sample["policy"]).startswith(f"self_forcing(depth={depth},")
        assert 0.9 <= float(sample["fit_rigidity"]) <= 1.0
    sim.close()


@pytest.mark.sim
def test_the_samples_are_a_dataset_training_reads(samples, source):
    out = samples[0]
    info = read_episode_dataset(out)
    assert len(info.episodes) == samples[1]["samples"] and info.fps == 10.0
    assert (out / "stats.json").read_text() == (source / "stats.json").read_text()  # normalised like the source
    assert json.loads((out / "meta.json").read_text())["self_forcing"]["depth"] == DEPTH
    episode = info.episodes.load(0)
    assert episode.actions.shape == (CHUNK, 2) and episode.frames.shape == (CHUNK + 1, 256, 256, 3)
    assert episode.success is False
    sheet = sample_sheet(out, count=3)
    assert sheet.shape == (3 * 256, 4 * 256, 3) and sheet.dtype == np.uint8


@pytest.mark.sim
def test_bad_sources_and_settings_name_the_field(samples, source, tmp_path):
    out, _, plan, _ = samples
    stats = ActionStats.from_json(source / "stats.json")
    env = ShiftedFutureEnv(source, plan, blank=(-1, -1))
    with pytest.raises(InputError, match="out_dir"):
        generate_self_forcing_episodes(out, source, env, stats=stats, workers=0, progress=False)
    with pytest.raises(InputError, match="depth"):
        generate_self_forcing_episodes(tmp_path / "a", source, env, stats=stats, depth=5, workers=0, progress=False)
    report = generate_self_forcing_episodes(tmp_path / "any", source, ShiftedFutureEnv(source, plan, blank=(0, 1)),
                                            stats=stats, rollouts_per_episode=ROLLOUTS, depth=DEPTH, seed=SEED,
                                            min_rigidity=0.0, workers=0, progress=False)
    assert report["frames_not_readable"] == 1  # a frame with no block gives no sample at any min_rigidity
    with pytest.raises(InputError, match="min_rigidity"):
        generate_self_forcing_episodes(tmp_path / "b", source, env, stats=stats, min_rigidity=2, progress=False)
    bare = tmp_path / "bare"
    (bare / "episodes").mkdir(parents=True)
    np.savez(bare / "episodes" / "episode_000000.npz", actions=np.zeros((40, 2), np.float32))
    with pytest.raises(InputError, match="sim_states"):
        generate_self_forcing_episodes(tmp_path / "c", bare, env, stats=stats, progress=False)


@pytest.mark.sim
def test_the_built_in_model_generates_the_sample_as_its_env_does(source, tmp_path):
    """The real world model: a sample's frame 0 is the frame a fresh env gives for the same start, actions and seed."""
    from cosmos3_gym.tasks.pusht.compare import replay_actions
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets, make_pusht_vector_env, pusht_env_defaults

    def env():
        return make_pusht_vector_env(1, return_frames=True, reward_model=None, success_threshold=None,
                                     max_episode_steps=None, num_threads=2)

    stats = ActionStats.from_json(pusht_env_defaults(load_pusht_assets())["action_stats"])
    vector_env = env()
    try:
        report = generate_self_forcing_episodes(tmp_path / "real", source, vector_env, stats=stats,
                                                rollouts_per_episode=1, depth=1, seed=SEED, workers=0,
                                                progress=False)
    finally:
        vector_env.close()
    (episode, start), _ = plan_rollouts([40, 40], 1, 1, CHUNK, SEED)
    assert report["samples"] == 2
    first = load(sorted((tmp_path / "real" / "episodes").glob("*.npz"))[0])
    real = load(sorted((source / "episodes").glob("episode_*.npz"))[episode])
    actions = np.clip(stats.normalize(real["actions"][start : start + CHUNK]), -1.0, 1.0)[None, None]
    fresh = env()
    try:
        again = replay_actions(fresh, real["frames"][start][None], actions, seed=SEED)
    finally:
        fresh.close()
    assert np.array_equal(first["frames"][0], again[0, 0, -1])
