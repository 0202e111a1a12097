"""``WorldModelVectorEnv``: one batched model call per step, per-slot autoreset in all three modes, seeding, make_vec.

Episodes end deterministically: a reward model scores 1 for the task "finish" and 0 otherwise, with
``success_threshold=0.5``, so a slot with that task terminates after every chunk; ``max_episode_steps`` truncates
the others.
"""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.envs import ENV_ID, WorldModelEnv, WorldModelVectorEnv, register_envs
from cosmos3_gym.errors import InputError

FAST = dict(domain="pusht", chunk=4, num_steps=2, resolution_tier=256)
TASKS = ["finish", "go", "go"]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


@pytest.fixture
def batches(engine, monkeypatch):
    """The number of requests in each ``engine.step`` call."""
    sizes = []
    original = engine.step

    def step(requests, **kwargs):
        sizes.append(len(requests))
        return original(requests, **kwargs)

    monkeypatch.setattr(engine, "step", step)
    return sizes


def image(seed: int, size=(96, 128)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def finish_task(frames, tasks):
    return [1.0 if task == "finish" else 0.0 for task in tasks]


def make_vec_env(shared_engine, num_envs=3, **kwargs) -> WorldModelVectorEnv:
    defaults = dict(engine=shared_engine, initial_states=image(0), task=TASKS, reward_model=finish_task,
                    success_threshold=0.5, max_episode_steps=3)
    return WorldModelVectorEnv(num_envs, **{**FAST, **defaults, **kwargs})


def random_actions(env, seed):
    return np.random.default_rng(seed).uniform(-1, 1, env.action_space.shape).astype(np.float32)


def masked(info, key):
    """The slots for which ``info`` has ``key``."""
    return info[f"_{key}"].tolist() if key in info else [False] * len(info["_task"])


def test_make_vec_builds_the_batched_env(engine):
    register_envs()
    env = gym.make_vec(ENV_ID, num_envs=2, engine=engine, initial_states=image(0), max_episode_steps=5,
                       autoreset_mode=AutoresetMode.SAME_STEP, **FAST)
    assert isinstance(env, WorldModelVectorEnv)
    assert env.num_envs == 2 and env.autoreset_mode == AutoresetMode.SAME_STEP
    assert env.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP and env.metadata["render_fps"] == 15.0 / 4
    assert env.settings.max_episode_steps == 5  # make_vec hands max_episode_steps to the vector env itself
    assert env.single_observation_space["image"].shape == (96, 128, 3)
    assert env.observation_space["image"].shape == (2, 96, 128, 3)
    assert env.single_action_space.shape == (4, 2) and env.action_space.shape == (2, 4, 2)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    default = gym.make_vec(ENV_ID, num_envs=1, vectorization_mode="vector_entry_point", engine=engine,
                           initial_states=image(0), **FAST)
    assert isinstance(default, WorldModelVectorEnv)
    assert default.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP  # gymnasium's default


def test_make_vec_takes_gymnasiums_vector_kwargs_and_sb3_wraps_the_result(engine):
    """Issue 41: gymnasium's own spelling, vector_kwargs={"autoreset_mode": ...}, which Gymnasium refuses for any
    env with a vector_entry_point, builds the batched env (the same as the keyword), and SB3VecEnv takes it."""
    from cosmos3_gym.envs import SB3VecEnv

    register_envs()
    common = dict(engine=engine, initial_states=image(0), max_episode_steps=2, **FAST)
    env = gym.make_vec(ENV_ID, num_envs=2, vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}, **common)
    assert isinstance(env, WorldModelVectorEnv) and env.autoreset_mode == AutoresetMode.SAME_STEP
    assert env.spec.kwargs["autoreset_mode"] == AutoresetMode.SAME_STEP  # gym.make_vec(env.spec) builds it again
    sb3 = SB3VecEnv(env)
    observations = sb3.reset()
    assert observations["image"].shape == (2, 96, 128, 3)
    for seed in range(2):
        sb3.step_async(random_actions(env, seed))
        observations, rewards, dones, infos = sb3.step_wait()
    assert dones.all() and all(info["TimeLimit.truncated"] for info in infos)  # max_episode_steps=2
    assert all(info["terminal_observation"]["image"].shape == (96, 128, 3) for info in infos)
    sb3.close()

    with pytest.raises(gym.error.Error, match=r"\['autoreset_mode'\]: given both"):
        gym.make_vec(ENV_ID, num_envs=2, vector_kwargs={"autoreset_mode": "SameStep"},
                     autoreset_mode=AutoresetMode.SAME_STEP, **common)
    # Other ids are Gymnasium's business: CartPole's vector env still refuses vector_kwargs as Gymnasium does.
    with pytest.raises(gym.error.Error, match="Custom vector environment can be passed arguments only through kwargs"):
        gym.make_vec("CartPole-v1", num_envs=2, vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})
    sync = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})
    assert isinstance(sync, gym.vector.SyncVectorEnv) and sync.autoreset_mode == AutoresetMode.SAME_STEP
    sync.close()


def test_all_slots_advance_in_one_engine_call(engine, batches):
    env = make_vec_env(engine, reward_model=None, success_threshold=None, return_frames=True,
                       render_mode="rgb_array")
    obs, info = env.reset(seed=0)
    assert info["task"].tolist() == TASKS and obs["image"].shape == (3, 96, 128, 3)
    obs, rewards, terminated, truncated, info = env.step(random_actions(env, 0))
    assert batches == [3]
    assert rewards.tolist() == [0.0] * 3 and not terminated.any() and not truncated.any()
    assert info["frames"].shape == (3, 4, 96, 128, 3)
    assert all(np.array_equal(frame, obs["image"][i]) for i, frame in enumerate(env.render()))
    assert len(set(info["noise_seed"].tolist())) == 3  # each slot draws its own noise


def test_next_step_autoreset_resets_only_finished_slots(engine, batches):
    env = make_vec_env(engine)
    start, _ = env.reset(seed=0)
    obs, rewards, terminated, truncated, info = env.step(random_actions(env, 1))
    assert terminated.tolist() == [True, False, False] and rewards.tolist() == [1.0, 0.0, 0.0]

    # Step 2: slot 0 is reset (its action ignored) while slots 1 and 2 advance: 2 requests in one call.
    previous = obs
    obs, rewards, terminated, truncated, info = env.step(random_actions(env, 2))
    assert batches == [3, 2]
    assert rewards[0] == 0.0 and not terminated[0] and not truncated[0]
    assert np.array_equal(obs["image"][0], start["image"][0])
    assert masked(info, "initial_state_index") == [True, False, False]
    assert masked(info, "elapsed_steps") == [False, True, True] and info["elapsed_steps"][1:].tolist() == [2, 2]
    assert not np.array_equal(obs["image"][1], previous["image"][1])

    # Step 3: slot 0 finishes its second episode, slots 1 and 2 reach max_episode_steps.
    obs, rewards, terminated, truncated, info = env.step(random_actions(env, 3))
    assert terminated.tolist() == [True, False, False] and truncated.tolist() == [False, True, True]
    assert info["elapsed_steps"].tolist() == [1, 3, 3]

    # Step 4: every slot resets and nothing runs through the model.
    obs, rewards, terminated, truncated, info = env.step(random_actions(env, 4))
    assert batches == [3, 2, 3] and not (terminated | truncated).any()
    assert masked(info, "initial_state_index") == [True, True, True]


def test_same_step_autoreset_returns_final_observations(engine, batches):
    env = make_vec_env(engine, autoreset_mode=AutoresetMode.SAME_STEP)
    start, _ = env.reset(seed=0)
    obs, rewards, terminated, truncated, info = env.step(random_actions(env, 1))
    assert terminated.tolist() == [True, False, False]
    assert info["_final_obs"].tolist() == [True, False, False]
    assert info["final_obs"][0]["image"].shape == (96, 128, 3)
    assert not np.array_equal(info["final_obs"][0]["image"], start["image"][0])  # the generated frame
    assert np.array_equal(obs["image"][0], start["image"][0])  # ...and slot 0 already starts over
    assert info["final_info"]["score"][0] == 1.0 and info["final_info"]["_score"].tolist() == [True, False, False]
    assert masked(info, "initial_state_index") == [True, False, False]  # the reset info of slot 0
    assert masked(info, "score") == [False, True, True]

    obs, rewards, terminated, truncated, info = env.step(random_actions(env, 2))
    assert batches == [3, 3]  # no slot waits a step to be reset
    assert info["final_info"]["elapsed_steps"][0] == 1 and info["elapsed_steps"][1:].tolist() == [2, 2]


def test_disabled_autoreset_needs_a_reset_mask(engine, batches):
    env = make_vec_env(engine, autoreset_mode=AutoresetMode.DISABLED)
    assert env.metadata["autoreset_mode"] == AutoresetMode.DISABLED
    start, _ = env.reset(seed=0)
    obs, _, terminated, _, _ = env.step(random_actions(env, 1))
    assert terminated.tolist() == [True, False, False]
    with pytest.raises(InputError, match=r"reset_mask: slots \[0\]"):
        env.step(random_actions(env, 2))
    assert batches == [3]

    reset_obs, info = env.reset(options={"reset_mask": np.array([True, False, False])})
    assert np.array_equal(reset_obs["image"][0], start["image"][0])
    assert np.array_equal(reset_obs["image"][1:], obs["image"][1:])  # untouched slots keep their frames
    assert masked(info, "task") == [True, False, False]
    _, _, _, _, info = env.step(random_actions(env, 2))
    assert info["elapsed_steps"].tolist() == [1, 2, 2]


def test_per_slot_seeds_match_single_envs(engine):
    """Slot i of a vector env reset with seed s follows the stream of a single env reset with seed s + i."""
    env = make_vec_env(engine, reward_model=None, success_threshold=None, task=None)
    chunks = [random_actions(env, k) for k in range(2)]

    def vector_rollout(seed):
        frames = [env.reset(seed=seed)[0]["image"]]
        return frames + [env.step(chunk)[0]["image"] for chunk in chunks]

    first, again = vector_rollout(5), vector_rollout(5)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(vector_rollout(6)[1], first[1])

    single = WorldModelEnv(engine=engine, initial_states=image(0), **FAST)
    for slot in range(3):
        single.reset(seed=5 + slot)
        for step, chunk in enumerate(chunks, start=1):
            obs, *_ = single.step(chunk[slot])
            # Batched and solo passes differ only by float summation order; after uint8 rounding that is at most
            # one level on a few pixels.
            assert np.abs(obs["image"].astype(int) - first[step][slot].astype(int)).max() <= 1

    env.reset(seed=[11, None, 13])  # a list seeds each slot; None keeps that slot's stream


def test_per_slot_tasks_and_reset_options(engine):
    env = make_vec_env(engine, task=None, num_envs=2, reward_model=None, success_threshold=None,
                       image_size=(96, 128), initial_states=None)
    _, info = env.reset(seed=0, options={"frames": [image(1), image(2)], "task": ["a", "b"]})
    assert info["task"].tolist() == ["a", "b"] and env.tasks == ["a", "b"]
    obs, info = env.reset(options={"frames": [image(3), image(4)], "task": "same"})
    assert info["task"].tolist() == ["same", "same"] and np.array_equal(obs["image"][1], image(4))
    with pytest.raises(InputError, match=r"options\['frames'\]"):
        env.reset(options={"frames": image(3)})
    with pytest.raises(InputError, match=r"options\['task'\]"):
        env.reset(options={"frames": [image(3), image(4)], "task": ["a", "b", "c"]})


@pytest.mark.parametrize(
    "mask, message",
    [
        (np.array([True, False]), r"shape \(3,\)"),
        (np.array([1, 0, 0]), "bool"),
        (np.zeros(3, dtype=bool), "at least one"),
    ],
)
def test_bad_reset_masks(engine, mask, message):
    env = make_vec_env(engine)
    env.reset(seed=0)
    with pytest.raises(InputError, match=f"reset_mask: .*{message}"):
        env.reset(options={"reset_mask": mask})


def test_bad_vector_arguments(engine, batches):
    register_envs()
    for num_envs in (0, -1, 1.5):
        with pytest.raises(InputError, match="num_envs"):
            make_vec_env(engine, num_envs=num_envs)
    with pytest.raises(InputError, match="num_envs"):
        gym.make_vec(ENV_ID, num_envs=0, engine=engine, initial_states=image(0), **FAST)
    with pytest.raises(InputError, match="task"):
        make_vec_env(engine, task=["a", "b"])
    with pytest.raises(InputError, match="autoreset_mode"):
        make_vec_env(engine, autoreset_mode="sometimes")
    env = make_vec_env(engine, autoreset_mode="SameStep")  # the enum's value works too
    assert env.autoreset_mode == AutoresetMode.SAME_STEP
    with pytest.raises(InputError, match="reset"):
        env.step(random_actions(env, 0))
    env.reset(seed=0)
    with pytest.raises(InputError, match="actions: expected shape"):
        env.step(np.zeros((2, 4, 2), np.float32))
    bad = random_actions(env, 0)
    bad[2, 1, 0] = np.nan
    with pytest.raises(InputError, match="actions: contains NaN"):
        env.step(bad)
    with pytest.raises(InputError, match="seed"):
        env.reset(seed=[1, 2])
    assert batches == []


def test_close_is_idempotent(engine, tiny_checkpoint):
    env = make_vec_env(engine)
    env.close()
    env.close()
    assert not engine.closed  # shared engines stay open
    owned = WorldModelVectorEnv(2, tiny_checkpoint, initial_states=image(0), **FAST)
    owned.close()
    owned.close()
    assert owned.engine.closed


# ------------------------------------------------------------------ group resets (issue 17)


class ScriptedScores:
    """A reward model that returns the next scripted list of scores at each call (one score per stepping slot),
    zeros once the script is over."""

    def __init__(self, *scores):
        self.scores = list(scores)

    def __call__(self, frames, tasks):
        scores = self.scores.pop(0) if self.scores else [0.0] * len(tasks)
        assert len(scores) == len(tasks)
        return scores


def make_group_env(engine, scores=(), **kwargs):
    return WorldModelVectorEnv(
        4, group_size=2, **FAST, engine=engine, initial_states=[image(i) for i in range(6)], task="go",
        reward_model=ScriptedScores(*scores), success_threshold=0.5, **kwargs,
    )


def test_groups_share_their_start_and_differ_by_noise(engine):
    env = make_group_env(engine)
    observations, info = env.reset(seed=3)
    assert info["group"].tolist() == [0, 0, 1, 1] and not info["waiting"].any()
    index = info["initial_state_index"]
    assert index[0] == index[1] and index[2] == index[3]
    assert np.array_equal(observations["image"][0], observations["image"][1])
    assert np.array_equal(observations["image"][2], observations["image"][3])
    same_action = np.repeat(random_actions(env, 0)[:1], 4, axis=0)
    observations, *_, info = env.step(same_action)
    assert info["group"].tolist() == [0, 0, 1, 1]
    assert info["noise_seed"][0] != info["noise_seed"][1]
    # same start, same action, other noise
    assert not np.array_equal(observations["image"][0], observations["image"][1])

    # Per-group reset options; per-slot lists must agree within a group.
    _, info = env.reset(options={"initial_state_index": [4, 1]})
    assert info["initial_state_index"].tolist() == [4, 4, 1, 1]
    _, info = env.reset(options={"initial_state_index": [5, 5, 2, 2]})
    assert info["initial_state_index"].tolist() == [5, 5, 2, 2]
    with pytest.raises(InputError, match=r"options\['initial_state_index'\]: the slots of a group share their start"):
        env.reset(options={"initial_state_index": [5, 4, 2, 2]})
    with pytest.raises(InputError, match="reset_mask: .* must select whole groups"):
        env.reset(options={"reset_mask": np.array([True, False, False, False])})


def test_group_size_must_divide_num_envs(engine):
    with pytest.raises(InputError, match=r"group_size: num_envs \(3\) must be a multiple of group_size \(2\)"):
        WorldModelVectorEnv(3, group_size=2, engine=engine, initial_states=image(0), **FAST)
    with pytest.raises(InputError, match="group_size: expected an integer >= 1"):
        WorldModelVectorEnv(2, group_size=0, engine=engine, initial_states=image(0), **FAST)
    register_envs()
    env = gym.make_vec(ENV_ID, num_envs=4, group_size=2, engine=engine, initial_states=image(0), **FAST)
    assert env.group_size == 2 and env.num_groups == 2
    with pytest.raises(InputError, match="group_size"):
        gym.make_vec(ENV_ID, num_envs=4, group_size=3, engine=engine, initial_states=image(0), **FAST)


# Slot 0 succeeds at step 1, slot 1 at step 3: group 0 is done after step 3; group 1 never ends.
SCRIPT = ([1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0])


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_groups_survive_autoreset(engine, batches, mode):
    env = make_group_env(engine, scores=SCRIPT, autoreset_mode=mode)
    env.reset(seed=0)
    actions = random_actions(env, 1)
    observations, rewards, terminated, truncated, info = env.step(actions)
    assert terminated.tolist() == [True, False, False, False] and rewards[0] == 1.0
    last_of_slot_0 = observations["image"][0]
    if mode == AutoresetMode.SAME_STEP:
        assert masked(info, "final_obs") == [True, False, False, False]
        assert np.array_equal(info["final_obs"][0]["image"], last_of_slot_0)  # not restarted: its group is running

    # Slot 0 waits for slot 1: its action is ignored (3 requests), it returns its last frame, reward 0, no flags.
    observations, rewards, terminated, truncated, info = env.step(actions)
    assert batches[-1] == 3
    assert info["waiting"].tolist() == [True, False, False, False]
    assert np.array_equal(observations["image"][0], last_of_slot_0)
    assert (rewards[0], terminated[0], truncated[0]) == (0.0, False, False)

    observations, rewards, terminated, truncated, info = env.step(actions)  # slot 1 ends: group 0 is done
    assert terminated.tolist() == [False, True, False, False]
    assert info["waiting"].tolist() == [True, False, False, False]
    if mode == AutoresetMode.SAME_STEP:  # restarted within this step from one shared start
        assert masked(info, "final_obs") == [False, True, False, False]
        assert info["initial_state_index"][0] == info["initial_state_index"][1]
        assert masked(info, "initial_state_index")[:2] == [True, True]
        assert np.array_equal(observations["image"][0], observations["image"][1])
        observations, *_, info = env.step(actions)
        assert batches[-1] == 4 and not info["waiting"].any()  # everyone steps again
    elif mode == AutoresetMode.NEXT_STEP:  # restarted at the next step, together
        observations, rewards, terminated, truncated, info = env.step(actions)
        assert batches[-1] == 2 and info["waiting"].tolist() == [True, True, False, False]
        assert info["initial_state_index"][0] == info["initial_state_index"][1]
        assert masked(info, "initial_state_index") == [True, True, False, False]
        assert np.array_equal(observations["image"][0], observations["image"][1])
        assert not (terminated | truncated).any() and (rewards[:2] == 0).all()
        env.step(actions)
        assert batches[-1] == 4
    else:  # DISABLED: the finished group must be reset, as a whole
        with pytest.raises(InputError, match=r"reset_mask: slots \[0, 1\] finished"):
            env.step(actions)
        with pytest.raises(InputError, match="whole groups"):
            env.reset(options={"reset_mask": np.array([True, False, False, False])})
        observations, info = env.reset(options={"reset_mask": np.array([True, True, False, False])})
        assert np.array_equal(observations["image"][0], observations["image"][1])
        env.step(actions)
        assert batches[-1] == 4


def mean_brightness(frames, tasks):
    return frames.float().mean(dim=(1, 2, 3, 4))


def test_imagination_samples_score_the_chunk_by_several_samples(engine, batches):
    """K imagined samples per chunk in one engine call: the slot goes on from the first (the frames of K = 1), its
    score is the mean or minimum of the K samples' scores; with K = 1 nothing changes."""
    actions = [random_actions(make_vec_env(engine), k) for k in range(2)]
    settings = dict(reward_model=mean_brightness, success_threshold=None, task=None)

    def rollout(**kwargs):
        env = make_vec_env(engine, **settings, **kwargs)
        env.reset(seed=3)
        return [env.step(chunk) for chunk in actions]

    plain = rollout()
    batches.clear()
    mean = rollout(imagination_samples=3)
    assert batches == [9, 9]  # 3 slots x 3 samples, one call per step
    pessimistic = rollout(imagination_samples=3, imagination_reduce="min")
    for step in range(2):
        obs, reward, _, _, info = mean[step]
        samples = info["score_samples"]
        assert samples.shape == (3, 3) and np.ptp(samples, axis=1).max() > 0  # the samples differ by their noise
        np.testing.assert_allclose(info["score"], samples.mean(axis=1))
        np.testing.assert_allclose(reward, samples.mean(axis=1))
        assert np.array_equal(obs["image"], pessimistic[step][0]["image"])
        np.testing.assert_allclose(pessimistic[step][4]["score"], pessimistic[step][4]["score_samples"].min(axis=1))
    # The first sample is the K = 1 rollout: same seeds, same frames and scores.
    # (A batch of 9 and one of 3 may differ by float summation order: at most one uint8 level.)
    np.testing.assert_allclose(mean[0][4]["score_samples"][:, 0], plain[0][4]["score"], rtol=1e-4)
    assert np.abs(mean[0][0]["image"].astype(int) - plain[0][0]["image"].astype(int)).max() <= 1
    assert "score_samples" not in plain[0][4]
    with pytest.raises(InputError, match="imagination_samples"):
        make_vec_env(engine, imagination_samples=0)
    with pytest.raises(InputError, match="imagination_reduce"):
        make_vec_env(engine, imagination_reduce="max")


def test_sb3_over_the_pusht_vector_env_as_a_newcomer_writes_it():
    """Issue 41: the newcomer's line, gym.make_vec("cosmos3_gym/PushT-v0", ..., vector_kwargs={"autoreset_mode":
    SAME_STEP}), builds what SB3VecEnv needs (the docs' snippet; one step of the built-in model, num_steps=1)."""
    from cosmos3_gym.envs import SB3VecEnv

    same_step = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}  # SB3 resets finished envs within the step
    vec_env = SB3VecEnv(gym.make_vec("cosmos3_gym/PushT-v0", num_envs=2, vector_kwargs=same_step, device="cpu",
                                     num_steps=1))
    try:
        observations = vec_env.reset()
        assert observations["image"].shape == (2, 256, 256, 3)
        vec_env.step_async(np.zeros((2, *vec_env.action_space.shape), np.float32))
        observations, rewards, dones, infos = vec_env.step_wait()
        assert rewards.shape == (2,) and len(infos) == 2 and "coverage" in infos[0]
    finally:
        vec_env.close()


def test_resize_frames_gives_the_bytes_of_resize_frame_in_any_batch():
    """The vector env's observations are resized over a thread pool: the same bytes as one frame at a time, in order,
    for batches below and above the threading threshold."""
    from cosmos3_gym.data.initial_states import resize_frame, resize_frames

    frames = np.random.default_rng(0).integers(0, 256, (67, 40, 56, 3), dtype=np.uint8)
    for batch in (frames[:3], frames):
        resized = resize_frames(batch, (24, 20))
        assert resized.shape == (len(batch), 24, 20, 3) and resized.dtype == np.uint8
        np.testing.assert_array_equal(resized, np.stack([resize_frame(frame, (24, 20)) for frame in batch]))
    same = resize_frames(frames, (40, 56))
    np.testing.assert_array_equal(same, frames)
    assert not np.shares_memory(same, frames)  # a new array, as observations always are


def _resize_in_child(frames):
    from cosmos3_gym.data.initial_states import resize_frames

    return resize_frames(frames, (24, 20))


def test_resize_frames_works_in_a_forked_child_of_a_process_that_used_it():
    """A thread pool inherited through fork has no threads: the child must make its own, not wait forever."""
    import multiprocessing

    from cosmos3_gym.data.initial_states import resize_frames

    frames = np.random.default_rng(1).integers(0, 256, (32, 40, 56, 3), dtype=np.uint8)
    expected = resize_frames(frames, (24, 20))  # the parent's pool exists now
    with multiprocessing.get_context("fork").Pool(1) as pool:
        np.testing.assert_array_equal(pool.apply_async(_resize_in_child, (frames,)).get(timeout=60), expected)
