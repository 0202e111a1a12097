"""``WorldModelEnv`` (one Cosmos3 forward-dynamics rollout), its initial-state sources and the Gymnasium registration.

Everything runs the real tiny model (chunk 4, 2 denoising steps, tier 256, 96x128 frames), so the checks see the
real frame sizes, noise seeding and decode.
"""

import dataclasses
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env as gym_check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.envs import ENV_ID, WorldModelEnv, load_initial_states, model_frame_size, register_envs
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.media import write_video
from cosmos3_gym.processor import ActionStats

FAST = dict(domain="pusht", chunk=4, num_steps=2, resolution_tier=256)  # pusht: raw_action_dim 2


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


def image(seed: int, size=(96, 128)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def make_env(shared_engine, **kwargs) -> WorldModelEnv:
    return WorldModelEnv(**{"engine": shared_engine, **FAST, "initial_states": image(0), **kwargs})


def actions(seed: int, n: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (4, 2)).astype(np.float32) for _ in range(n)]


def rollout(env, seed, chunks):
    observations = [env.reset(seed=seed)[0]["image"]]
    observations += [env.step(chunk)[0]["image"] for chunk in chunks]
    return observations


def mean_brightness(frames, tasks):
    """A deterministic reward model: the mean pixel value of each slot's chunk, in [0, 1]."""
    return frames.mean(dim=(1, 2, 3, 4))


class CountingEngine:
    """Counts the requests that reach ``engine.step`` (to prove bad input never does)."""

    def __init__(self, engine, monkeypatch):
        self.batches = []
        original = engine.step

        def step(requests, **kwargs):
            self.batches.append(len(requests))
            return original(requests, **kwargs)

        monkeypatch.setattr(engine, "step", step)


# ---------------------------------------------------------------------------------------------------- checkers


def test_gymnasium_check_env_passes(tiny_checkpoint):
    """Through gym.make (so the checker also rebuilds the env per render mode and checks close); deterministic,
    not registered as nondeterministic."""
    register_envs()
    env = gym.make(ENV_ID, checkpoint=tiny_checkpoint, initial_states=image(0), render_mode="rgb_array", **FAST)
    assert env.spec.nondeterministic is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gym_check_env(env.unwrapped)
    assert not [str(w.message) for w in caught if "gymnasium" in w.filename]
    env.close()


def test_sb3_check_env_passes(engine):
    env = make_env(engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sb3_check_env(env, warn=True)
    assert not [str(w.message) for w in caught if "stable_baselines3" in w.filename]


# ---------------------------------------------------------------------------------------------------- behaviour


def test_spaces_reset_step_render(engine):
    env = make_env(engine, return_frames=True, render_mode="rgb_array", fps=8.0, task="push the T")
    assert env.observation_space["image"].shape == (96, 128, 3) and env.observation_space["image"].dtype == np.uint8
    assert env.action_space.shape == (4, 2) and env.action_space.dtype == np.float32
    assert (env.action_space.low == -1).all() and (env.action_space.high == 1).all()
    assert env.metadata["render_fps"] == 8.0 / 4  # one rendered frame per step = per chunk of 4 frames at 8 fps

    obs, info = env.reset(seed=0)
    assert np.array_equal(obs["image"], image(0))  # 96x128 is a fixed point of the model's size map: not resized
    assert info == {"task": "push the T", "initial_state_index": 0}
    assert np.array_equal(env.render(), obs["image"])

    obs, reward, terminated, truncated, info = env.step(actions(1)[0])
    assert env.observation_space.contains(obs)
    assert (reward, terminated, truncated) == (0.0, False, False)  # no reward model
    assert type(terminated) is bool and type(truncated) is bool and type(reward) is float
    assert info["frames"].shape == (4, 96, 128, 3) and info["frames"].dtype == np.uint8
    assert np.array_equal(obs["image"], info["frames"][-1])  # the rollout continues from the chunk's last frame
    assert np.array_equal(env.render(), obs["image"])
    assert info["elapsed_steps"] == 1 and info["task"] == "push the T" and "score" not in info
    assert not np.array_equal(obs["image"], image(0))


def test_step_is_the_engines_forward_dynamics(engine):
    """One step = one forward_dynamics request on the current frame with the action unchanged; the env continues
    from the chunk's last frame (the proof that nothing is lost in between, e.g. a denormalisation)."""
    from cosmos3_gym.engine import Cosmos3Request
    from cosmos3_gym.media import to_uint8

    env = make_env(engine, task="push the T", return_frames=True)
    frame, _ = env.reset(seed=2)
    chunk = actions(4)[0]
    obs, *_, info = env.step(chunk)
    expected = engine.step(Cosmos3Request(
        mode="forward_dynamics", observation=frame["image"], task="push the T", action=chunk, domain="pusht",
        chunk=4, num_inference_steps=2, resolution_tier=256, seed=info["noise_seed"],
    ))
    expected_frames = to_uint8(expected.pixels[:, 1:].permute(1, 2, 3, 0).numpy())
    assert np.array_equal(info["frames"], expected_frames)
    assert np.array_equal(obs["image"], expected_frames[-1])


def test_same_seed_and_actions_give_same_frames(engine):
    env = make_env(engine)
    chunks = actions(2, n=2)
    first, second = rollout(env, 7, chunks), rollout(env, 7, chunks)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    other_seed = rollout(env, 8, chunks)
    assert not np.array_equal(first[1], other_seed[1])  # the diffusion noise comes from the seed


def test_frame_size_is_the_models_fixed_point(engine):
    # 240x336 -> 224x320 (canvas bin 0.8) -> 192x272 (bin 0.6) -> 192x272: the frame must not keep shrinking.
    assert model_frame_size(240, 336, 256) == (192, 272)
    assert model_frame_size(192, 272, 256) == (192, 272)
    env = make_env(engine, initial_states=image(3, (240, 336)))
    assert env.image_size == (192, 272) and env.observation_space["image"].shape == (192, 272, 3)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (192, 272, 3)
    obs, *_ = env.step(actions(0)[0])
    assert obs["image"].shape == (192, 272, 3)


def test_observation_size_downscales_only_the_observation(engine):
    env = make_env(engine, observation_size=(48, 64), render_mode="rgb_array")
    assert env.observation_space["image"].shape == (48, 64, 3)
    obs, _ = env.reset(seed=0)
    obs, *_ = env.step(actions(0)[0])
    assert obs["image"].shape == (48, 64, 3)
    assert env.render().shape == (96, 128, 3)


@pytest.mark.parametrize("mode", ["per_step", "relative", "terminal"])
def test_reward_modes(engine, mode):
    env = make_env(engine, reward_model=mean_brightness, reward_mode=mode, max_episode_steps=2)
    env.reset(seed=1)
    steps = [env.step(chunk) for chunk in actions(3, n=2)]
    scores = [info["score"] for *_, info in steps]
    rewards = [reward for _, reward, *_ in steps]
    assert [truncated for *_, truncated, _ in steps] == [False, True]
    assert all(0.0 < s < 1.0 for s in scores) and scores[0] != scores[1]
    expected = {
        "per_step": scores,
        "relative": [scores[0], scores[1] - scores[0]],  # the first chunk's score minus 0
        "terminal": [0.0, scores[1]],  # only on the step that ends the episode
    }[mode]
    assert rewards == pytest.approx(expected, abs=1e-12)


def test_terminal_reward_without_any_episode_end_warns(engine):
    with pytest.warns(UserWarning, match="terminal"):
        make_env(engine, reward_model=mean_brightness, reward_mode="terminal")


def test_success_threshold_terminates(engine):
    env = make_env(engine, reward_model=mean_brightness, success_threshold=0.0)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step(actions(0)[0])
    assert terminated is True and truncated is False and info["success"] is True and reward == info["score"]
    env = make_env(engine, reward_model=mean_brightness, success_threshold=1.0)
    env.reset(seed=0)
    _, _, terminated, _, info = env.step(actions(0)[0])
    assert terminated is False and info["success"] is False


def test_time_limit_is_counted_once(engine, tiny_checkpoint):
    """gym.make's max_episode_steps becomes TimeLimit (the env does not count too); direct construction counts."""
    register_envs()
    made = gym.make(ENV_ID, checkpoint=tiny_checkpoint, initial_states=image(0), max_episode_steps=2, **FAST)
    assert isinstance(made, gym.wrappers.TimeLimit) and made.unwrapped.settings.max_episode_steps is None
    direct = make_env(engine, max_episode_steps=2)
    for env in (made, direct):
        env.reset(seed=0)
        truncations = [env.step(chunk)[3] for chunk in actions(0, n=2)]
        assert truncations == [False, True]
    made.close()


def test_action_stats_only_annotate(engine):
    stats = ActionStats.from_json({"min": [0.0, -2.0], "max": [10.0, 2.0]}, mode="minmax")
    chunk = actions(5)[0]
    plain, annotated = make_env(engine), make_env(engine, action_stats=stats)
    plain.reset(seed=3)
    annotated.reset(seed=3)
    obs_plain, *_ = plain.step(chunk)
    obs_annotated, *_, info = annotated.step(chunk)
    assert np.array_equal(obs_plain["image"], obs_annotated["image"])  # the model sees the normalised action
    assert np.allclose(info["raw_action"], stats.denormalize(chunk))
    assert annotated.action_stats is stats


def test_handover_projection_replaces_only_the_chunks_last_frame(engine):
    calls = []

    def grey_out(frames):  # a stand-in for PushT's rigid_block: every last frame becomes mid-grey
        calls.append(frames.copy())
        return np.full_like(frames, 128), np.ones(len(frames), dtype=bool)

    plain = make_env(engine, return_frames=True, reward_model=mean_brightness)
    projected = make_env(engine, return_frames=True, reward_model=mean_brightness, handover_projection=grey_out)
    chunks = actions(5, 2)
    plain.reset(seed=2)
    projected.reset(seed=2)
    _, plain_reward, *_, plain_info = plain.step(chunks[0])
    observation, reward, *_, info = projected.step(chunks[0])
    # The projection saw the chunk's last frame as generated; the other frames stay as generated.
    np.testing.assert_array_equal(calls[0], plain_info["frames"][-1:])
    np.testing.assert_array_equal(info["frames"][:-1], plain_info["frames"][:-1])
    assert (info["frames"][-1] == 128).all() and (observation["image"] == 128).all()
    assert bool(info["handover_projected"]) and "handover_projected" not in plain_info
    # Scored with the projected frame, and the next chunk starts from it.
    frames = torch.from_numpy(info["frames"]).permute(0, 3, 1, 2).float().div(255)
    assert reward == pytest.approx(float(mean_brightness(frames[None], [""])[0]), abs=1e-5)
    assert reward != pytest.approx(plain_reward, abs=1e-5)
    assert (projected._core.frame(0) == 128).all()
    plain.close()
    projected.close()


def test_offload_and_onload_keep_results(engine):
    env = make_env(engine)
    chunks = actions(6, n=2)
    reference = rollout(env, 4, chunks)
    env.reset(seed=4)
    env.step(chunks[0])
    env.offload()
    assert len(engine._text_cache) == 0  # the cached prompt K/V lived on the model's device
    assert engine.transformer.device.type == "cpu" and env._core._home_device is not None
    obs, *_ = env.step(chunks[1])  # moves the model back by itself
    assert env._core._home_device is None
    assert np.array_equal(obs["image"], reference[2])
    env.offload()
    env.onload()
    assert env._core._home_device is None


def test_close_is_idempotent_and_releases_only_an_owned_engine(engine, tiny_checkpoint):
    shared = make_env(engine)
    shared.close()
    shared.close()
    assert not engine.closed
    with pytest.raises(InputError, match="closed"):
        shared.reset(seed=0)

    owned = WorldModelEnv(tiny_checkpoint, initial_states=image(0), **FAST)
    owned_engine = owned.engine
    owned.close()
    owned.close()
    assert owned_engine.closed


# ---------------------------------------------------------------------------------------------------- initial states


def test_initial_states_from_a_folder(tmp_path, engine):
    from PIL import Image

    Image.fromarray(image(1)).save(tmp_path / "a_image.png")
    write_video(tmp_path / "b_video.mp4", np.stack([image(2), image(3)]), fps=4)
    np.save(tmp_path / "c_frames.npy", np.stack([image(4), image(5)]))
    (tmp_path / "c_frames.txt").write_text("stack the cups\n")
    np.savez(tmp_path / "d_episode.npz", frames=image(6)[None], task=np.array("open the drawer"))
    (tmp_path / "notes.md").write_text("ignored")

    source = load_initial_states(tmp_path)
    assert len(source) == 4
    states = [source[i] for i in range(4)]
    assert np.array_equal(states[0].frame, image(1)) and states[0].task is None
    assert np.abs(states[1].frame.astype(int) - image(2)).mean() < 60  # lossy H.264 of a noise image
    assert np.array_equal(states[2].frame, image(4)) and states[2].task == "stack the cups"
    assert np.array_equal(states[3].frame, image(6)) and states[3].task == "open the drawer"

    env = make_env(engine, initial_states=tmp_path)
    obs, info = env.reset(seed=0, options={"initial_state_index": 3})
    assert info == {"task": "open the drawer", "initial_state_index": 3} and np.array_equal(obs["image"], image(6))
    _, info = env.reset(options={"initial_state_index": 3, "task": "close it"})  # a per-reset task wins
    assert info["task"] == "close it"
    env = make_env(engine, initial_states=tmp_path, task="global task")  # the env's task wins over the item's
    assert env.reset(options={"initial_state_index": 3})[1]["task"] == "global task"
    picks = {env.reset(seed=s)[1]["initial_state_index"] for s in range(12)}
    assert picks == {0, 1, 2, 3}  # drawn with np_random


def test_frames_from_reset_options(engine):
    env = WorldModelEnv(engine=engine, image_size=(96, 128), **FAST)
    obs, info = env.reset(seed=0, options={"frames": image(9), "task": "wipe"})
    assert np.array_equal(obs["image"], image(9)) and info == {"task": "wipe", "initial_state_index": -1}
    obs, _ = env.reset(options={"frames": image(9, (192, 256))})  # other sizes are resized to image_size
    assert obs["image"].shape == (96, 128, 3)
    with pytest.raises(InputError, match="options"):
        env.reset()


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.zeros((3, 2), np.float32), "shape"),
        (np.zeros((4, 3), np.float32), "shape"),
        (np.zeros((4, 2), np.int64), "dtype"),
        (np.full((4, 2), np.nan, np.float32), "NaN"),
        (np.full((4, 2), np.inf, np.float32), "NaN or infinity"),
        (np.full((4, 2), 1.5, np.float32), r"\[-1, 1\]"),
        ([[0.0, 0.0], [0.0]], "ragged"),
    ],
)
def test_bad_actions_never_reach_the_model(engine, monkeypatch, bad, message):
    env = make_env(engine)
    env.reset(seed=0)
    counter = CountingEngine(engine, monkeypatch)
    with pytest.raises(InputError, match=f"action: .*{message}"):
        env.step(bad)
    assert counter.batches == []


def test_other_float_actions_are_accepted(engine):
    """float64 (numpy's default) and bfloat16 (what a bf16 torch policy outputs) actions are cast to float32: the env
    steps exactly as it does with the same float32 actions (issue 43: this test used to assert nothing)."""
    env = make_env(engine)
    values = np.array([[-0.75, -0.5], [-0.25, 0.0], [0.25, 0.5], [0.75, 1.0]])  # exact in bfloat16
    given = {"float32": values.astype(np.float32), "float64": values,
             "bfloat16": torch.tensor(values, dtype=torch.bfloat16)}
    steps = {}
    for name, action in given.items():
        env.reset(seed=0)
        observation, reward, terminated, truncated, info = env.step(action)
        assert observation["image"].dtype == np.uint8 and np.isfinite(reward), name
        steps[name] = (observation["image"], reward, terminated, truncated)
    reference = steps["float32"]
    for name in ("float64", "bfloat16"):
        np.testing.assert_array_equal(steps[name][0], reference[0], err_msg=name)
        assert steps[name][1:] == reference[1:], name
    env.reset(seed=0)
    other = env.step(values[::-1].astype(np.float32))[0]["image"]
    assert not np.array_equal(other, reference[0])  # the actions reach the model: other actions, other frames


def test_step_before_reset_and_bad_options(engine):
    env = make_env(engine, render_mode="rgb_array")
    with pytest.raises(InputError, match="reset"):
        env.step(actions(0)[0])
    with pytest.raises(InputError, match="reset"):
        env.render()
    with pytest.raises(InputError, match=r"options: unknown keys \['frame'\]"):
        env.reset(options={"frame": image(0)})
    with pytest.raises(InputError, match="initial_state_index"):
        env.reset(options={"initial_state_index": 1})
    with pytest.raises(InputError, match="task"):
        env.reset(options={"task": 3})
    with pytest.raises(InputError, match="options\\['frames'\\]"):
        env.reset(options={"frames": np.zeros((8, 8, 5), np.uint8)})


def test_bad_reward_model_output(engine):
    env = make_env(engine, reward_model=lambda frames, tasks: torch.zeros(3))
    env.reset(seed=0)
    with pytest.raises(InputError, match="reward_model"):
        env.step(actions(0)[0])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(engine=None), "checkpoint"),
        (dict(checkpoint="CKPT"), "checkpoint"),  # both checkpoint and engine
        (dict(chunk=6), "chunk"),
        (dict(num_steps=0), "num_steps"),
        (dict(resolution_tier=300), "resolution_tier"),
        (dict(reward_mode="sparse"), "reward_mode"),
        (dict(success_threshold=0.5), "success_threshold"),
        (dict(max_episode_steps=0), "max_episode_steps"),
        (dict(initial_states=None), "initial_states"),
        (dict(image_size=(100, 100)), "image_size"),
        (dict(observation_size=(0, 10)), "observation_size"),
        (dict(task=["a"]), "task"),
        (dict(render_mode="human"), "render_mode"),
        (dict(request_options={"seed": 1}), "request_options"),
        (dict(action_stats={"min": [0.0], "max": [1.0]}), "action_stats"),
        (dict(domain="no_such_robot"), "domain"),
        (dict(handover_projection="rigid"), "handover_projection"),
    ],
)
def test_bad_construction_arguments(engine, tiny_checkpoint, kwargs, field):
    if kwargs.get("checkpoint") == "CKPT":
        kwargs = {"checkpoint": tiny_checkpoint}
    with pytest.raises(InputError, match=field):
        make_env(engine, **kwargs)


def test_bad_initial_state_sources(tmp_path, engine):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no frames here")
    with pytest.raises(InputError, match="initial_states: folder .* has no image"):
        make_env(engine, initial_states=empty)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(InputError, match=r"initial_states.*broken.png\): not a readable image") as raised:
        make_env(engine, initial_states=broken)
    assert "video" not in str(raised.value)  # issue 41: it said which endings videos must have
    pickled = tmp_path / "traj.npy"
    np.save(pickled, np.array([{"image": image(0)}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match="pickled"):
        make_env(engine, initial_states=pickled)
    pickled_npz = tmp_path / "traj.npz"
    np.savez(pickled_npz, frames=np.array([image(0)], dtype=object))
    with pytest.raises(InputError, match="pickled"):
        make_env(engine, initial_states=pickled_npz)
    no_frames = tmp_path / "no_frames.npz"
    np.savez(no_frames, pixels=image(0))
    with pytest.raises(InputError, match="'frames'"):
        make_env(engine, initial_states=no_frames)
    with pytest.raises(InputError, match="initial_states"):
        make_env(engine, initial_states=tmp_path / "missing.png")
    with pytest.raises(InputError, match="initial_states"):
        make_env(engine, initial_states=[])


def test_a_folder_that_is_not_a_checkpoint_says_so(tmp_path, tiny_checkpoint):
    """Issue 41: it used to fail on the missing initial_states; it names the part that is missing."""
    from PIL import Image

    from cosmos3_gym.envs.core import check_is_checkpoint

    folder = tmp_path / "frames"  # e.g. a folder of start frames given as the checkpoint
    folder.mkdir()
    Image.fromarray(image(0)).save(folder / "start.png")
    for kwargs in ({}, dict(initial_states=image(0), **FAST)):
        with pytest.raises(CheckpointError,
                           match=r"is not a usable Cosmos3 checkpoint .*missing directory .*transformer"):
            WorldModelEnv(folder, **kwargs)
    partial = tmp_path / "partial"
    (partial / "transformer").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"not a usable Cosmos3 checkpoint .*missing directory .*vae"):
        WorldModelEnv(partial)
    check_is_checkpoint(tiny_checkpoint)  # a real one passes


def test_num_threads_sets_torchs_threads_in_the_process(engine, tiny_checkpoint):
    """Issue 41: two torch processes on 2 cores made a step 20x slower; the envs set the process's threads."""
    from cosmos3_gym.envs import WorldModelVectorEnv

    before = torch.get_num_threads()
    try:
        make_env(engine, num_threads=2)
        assert torch.get_num_threads() == 2
        WorldModelVectorEnv(2, engine=engine, initial_states=image(0), num_threads=1, **FAST)
        assert torch.get_num_threads() == 1
        register_envs()
        env = gym.make(ENV_ID, checkpoint=tiny_checkpoint, initial_states=image(0), num_threads=2, device="cpu",
                       dtype="fp32", **FAST)
        assert torch.get_num_threads() == 2
        env.close()
        torch.set_num_threads(1)
        pusht = gym.make("cosmos3_gym/PushT-v0", num_threads=2, device="cpu")  # a task's factory passes it on
        assert torch.get_num_threads() == 2
        pusht.close()
        make_env(engine, num_threads=None)  # None: torch's setting as it is
        assert torch.get_num_threads() == 2
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(InputError, match="num_threads: expected an integer >= 1"):
                make_env(engine, num_threads=bad)
    finally:
        torch.set_num_threads(before)


def test_checkpoint_meta_decoder_is_the_default_decoder(tiny_checkpoint, tmp_path, monkeypatch):
    """Issue 41: a checkpoint's defaults apply everywhere: its meta.json ``decoder`` is WorldModelEnv's too, where
    the user gives none and one rank decodes (the light decoder cannot decode tile-parallel)."""
    import json
    import shutil

    from cosmos3_gym.envs import core

    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "checkpoint")
    loaded = []
    monkeypatch.setattr(core, "load_engine", lambda path, **options: loaded.append(options) or engine_stub())
    arguments = dict(initial_states=image(0), **FAST)
    WorldModelEnv(checkpoint, **arguments)
    assert "decoder" not in loaded[-1]  # no meta.json: load_engine's own default, the VAE
    (checkpoint / "meta.json").write_text(json.dumps({"decoder": "light"}))
    WorldModelEnv(checkpoint, **arguments)
    assert loaded[-1]["decoder"] == "light"
    WorldModelEnv(checkpoint, decoder="vae", **arguments)
    assert loaded[-1]["decoder"] == "vae"  # the user's choice wins
    WorldModelEnv(checkpoint, tp=2, **arguments)
    assert "decoder" not in loaded[-1]  # tile-parallel decode: the VAE, not an error


def engine_stub():
    """Enough of an engine for an env to be constructed (never stepped)."""
    from cosmos3_gym.engine_protocol import WorldModelEngine

    class Stub:
        action_dim, temporal_compression, vae, is_output_rank, closed = 64, 4, None, True, False
        device = torch.device("cpu")

        def step(self, requests, **kwargs):
            raise AssertionError("not stepped")

        def close(self):
            self.closed = True

        def offload(self):
            pass

        def onload(self):
            pass

        def optimize(self, **kwargs):
            return self

    stub = Stub()
    assert isinstance(stub, WorldModelEngine)
    return stub


def test_registration_is_idempotent():
    register_envs()
    register_envs()
    spec = gym.spec(ENV_ID)
    assert spec.entry_point == "cosmos3_gym.envs:make_world_model_env"
    assert spec.vector_entry_point == "cosmos3_gym.envs:make_world_model_vector_env"


def test_world_model_env_without_checkpoint_is_the_builtin_pusht_model():
    env = gym.make(ENV_ID)
    try:
        assert env.unwrapped.engine.transformer.config.action_dim == 64
        assert env.action_space.shape == (8, 2)  # PushT: chunk 8, 2-D actions, from the checkpoint's meta.json
        obs, _ = env.reset(seed=0)
        assert obs["image"].shape == (256, 256, 3)
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------------- settings


def test_settings_are_one_validated_object(engine):
    from cosmos3_gym.envs import WorldModelSettings

    env = make_env(engine, guidance_scale=1.5, request_options={"view_point": "ego_view"})
    settings = env.settings
    assert isinstance(settings, WorldModelSettings) and settings.raw_action_dim == 2  # the pusht domain's width
    assert (settings.chunk, settings.num_steps, settings.guidance_scale, settings.resolution_tier) == (4, 2, 1.5, 256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.chunk = 8
    other = make_env(engine, settings=settings, initial_states=image(1))
    assert other.settings == settings and other.action_space == env.action_space
    assert make_env(engine, settings=settings, num_steps=3).settings == settings.replace(num_steps=3)
    assert settings.replace(domain="droid_lerobot").raw_action_dim == 10  # a new domain brings its own width
    assert settings.replace(raw_action_dim=3).replace(domain="pusht").raw_action_dim == 3  # same domain: kept
    assert hash(settings) == hash(settings.replace())  # usable as a key
    for kwargs, message in [
        (dict(chunk=0), "chunk: expected an integer >= 1"),
        (dict(obs_type="pixels_agent_pos"), "obs_type: 'pixels_agent_pos' needs the agent's position"),
        (dict(obs_type="state"), "obs_type: expected one of"),
        (dict(score_name="not a name"), "score_name: expected"),
        (dict(image_size=(100, 100)), "image_size: the model turns a 100x100 frame into"),
    ]:
        with pytest.raises(InputError, match=message):
            WorldModelSettings(**{**FAST, **kwargs})
    with pytest.raises(InputError, match=r"unknown settings \['chunks'\]"):
        settings.replace(chunks=8)
    with pytest.raises(InputError, match=r"\['chunks'\]: unknown arguments"):
        make_env(engine, chunks=8)


def test_checkpoint_settings_are_defaults_and_overrides_are_logged(tiny_checkpoint, tmp_path, caplog):
    """Issue 20: a checkpoint's meta.json gives the env its settings; a keyword that changes one is logged."""
    import json
    import shutil

    from cosmos3_gym.checkpoint import checkpoint_defaults

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, checkpoint)
    np.savez(checkpoint / "starts.npz", frames=np.stack([image(0), image(1)]), task=np.asarray("push the T"))
    meta = {**FAST, "raw_action_dim": 2, "guidance_scale": 1.0, "fps": 10.0, "max_episode_steps": 3,
            "initial_states": "starts.npz", "score_name": "coverage", "action_normalization": "minmax"}
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    (checkpoint / "action_stats.json").write_text(json.dumps({"min": [0.0, 0.0], "max": [512.0, 512.0]}))
    defaults = checkpoint_defaults(checkpoint)
    assert defaults["chunk"] == 4 and defaults["fps"] == 10.0 and len(
        load_initial_states(defaults["initial_states"])) == 2
    assert defaults["action_stats"].dim == 2 and "action_normalization" not in defaults

    with caplog.at_level("WARNING", logger="cosmos3_gym.envs.settings"):
        env = WorldModelEnv(checkpoint, device="cpu", dtype="fp32")
    assert not caplog.records  # nothing overridden
    assert env.settings.guidance_scale == 1.0 and env.settings.max_episode_steps == 3
    assert env.action_space.shape == (4, 2)
    assert len(env.initial_states) == 2 and env.action_stats is not None
    _, info = env.reset(seed=0)
    assert info["task"] == "push the T"
    env.close()
    with caplog.at_level("WARNING", logger="cosmos3_gym.envs.settings"):
        env = WorldModelEnv(checkpoint, device="cpu", dtype="fp32", guidance_scale=2.0, chunk=4)
    assert env.settings.guidance_scale == 2.0
    assert [r.getMessage() for r in caplog.records if "guidance_scale=2.0 (was 1.0)" in r.getMessage()]
    assert not [r for r in caplog.records if "chunk=" in r.getMessage()]  # same value: not an override
    env.close()
    env = WorldModelEnv(checkpoint, device="cpu", dtype="fp32", initial_states=None, image_size=(96, 128))
    assert env.initial_states is None  # an explicit None is "none", not "the checkpoint's"
    env.reset(options={"frames": image(3)})
    env.close()


# ---------------------------------------------------------------------------------------------------- rendering


def test_render_modes_and_render_fps(engine):
    """rgb_array: the current frame; rgb_array_list: every frame since the last reset/render; render_fps is the step
    rate (fps / chunk) on the instance, and the class does not claim a number it cannot know."""
    assert WorldModelEnv.metadata["render_fps"] is None
    assert {"rgb_array", "rgb_array_list"} <= set(WorldModelEnv.metadata["render_modes"])
    env = make_env(engine, render_mode="rgb_array_list", return_frames=True, fps=8.0)
    assert env.metadata["render_fps"] == 2.0
    observation, _ = env.reset(seed=0)
    first = env.render()
    assert len(first) == 1 and np.array_equal(first[0], observation["image"])
    infos = [env.step(chunk)[-1] for chunk in actions(2, n=2)]
    frames = env.render()
    assert len(frames) == 2 * 4
    assert np.array_equal(np.stack(frames), np.concatenate([info["frames"] for info in infos]))
    assert env.render() == []  # collected since the last call


def test_rgb_array_list_decodes_every_frame_of_a_chunk(engine):
    """Without return_frames the env decodes only each chunk's last frame (nothing else reads the others), except
    for a render mode that shows every frame: rgb_array_list gets chunk frames per step, rgb_array the last one."""
    listing = make_env(engine, render_mode="rgb_array_list")
    single = make_env(engine, render_mode="rgb_array")
    assert listing._core.decode_mode() == "all" and single._core.decode_mode() == "last"
    for env in (listing, single):
        env.reset(seed=0)
    chunk = actions(1, n=1)[0]
    last = single.step(chunk)[0]["image"]
    listing.step(chunk)
    frames = listing.render()
    assert len(frames) == 1 + 4  # the reset frame, then the chunk's 4 frames
    assert np.array_equal(frames[-1], last)  # the same last frame whichever way it was decoded


def test_record_video_plays_in_real_time(engine, tmp_path):
    """RecordVideo records one frame per step; at render_fps = fps / chunk the video lasts as long as the robot's
    motion: here 1 + 3 frames at 2 fps for a reset and 3 chunks of 4 frames at 8 fps."""
    moviepy = pytest.importorskip("moviepy", reason="RecordVideo needs moviepy (the 'video' extra)")

    env = gym.wrappers.RecordVideo(make_env(engine, render_mode="rgb_array", fps=8.0), str(tmp_path / "videos"),
                                   episode_trigger=lambda episode: True, disable_logger=True)
    env.reset(seed=0)
    for chunk in actions(3, n=3):
        env.step(chunk)
    env.close()
    (video,) = (tmp_path / "videos").glob("*.mp4")
    clip = moviepy.VideoFileClip(str(video))
    assert clip.fps == pytest.approx(2.0) and clip.n_frames == 4
    assert clip.duration == pytest.approx(4 / 2.0)  # 3 chunks x 4 frames / 8 fps of motion, plus the start frame
    clip.close()


def test_human_rendering_needs_a_display(engine, monkeypatch):
    """Issue 41: the same messages with and without the window libraries installed (pygame comes with the sim
    extra, OpenCV with gym-pusht); only the window itself needs pygame."""
    from cosmos3_gym.envs import rendering

    for name in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER"):
        monkeypatch.delenv(name, raising=False)
    with monkeypatch.context() as patched:
        patched.setattr(rendering, "_window_backend", lambda: "pygame")  # a window library, no display
        with pytest.raises(InputError, match="render_mode: 'human' needs a display"):
            make_env(engine, render_mode="human")
        patched.setattr(rendering, "_window_backend", lambda: None)  # neither library
        with pytest.raises(InputError, match="render_mode: 'human' needs pygame or opencv-python"):
            make_env(engine, render_mode="human")
    pytest.importorskip("pygame", reason="the window itself needs pygame (the sim extra brings it)")
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")  # pygame's headless window
    env = make_env(engine, render_mode="human", fps=400.0)
    env.reset(seed=0)
    env.step(actions(0)[0])
    assert env.render() is None  # the window showed the frames as they came
    env.close()


# ---------------------------------------------------------------------------------------------------- conventions


def test_gym_pusht_info_keys_and_pixels_observations(engine):
    """gym-pusht's info["is_success"] / info["coverage"] beside ours; obs_type="pixels" observes the bare image."""
    env = make_env(engine, reward_model=mean_brightness, success_threshold=0.0, score_name="coverage")
    env.reset(seed=0)
    *_, info = env.step(actions(0)[0])
    assert info["is_success"] is True and info["success"] is True and info["coverage"] == info["score"]

    pixels = make_env(engine, obs_type="pixels", observation_size=(48, 64))
    assert pixels.observation_space == gym.spaces.Box(0, 255, (48, 64, 3), np.uint8)
    observation, _ = pixels.reset(seed=0)
    assert isinstance(observation, np.ndarray) and pixels.observation_space.contains(observation)
    observation, *_ = pixels.step(actions(0)[0])
    assert pixels.observation_space.contains(observation)
    from cosmos3_gym.envs import WorldModelVectorEnv

    vector = WorldModelVectorEnv(2, engine=engine, initial_states=image(0), obs_type="pixels", **FAST)
    observations, _ = vector.reset(seed=0)
    assert observations.shape == (2, 96, 128, 3) and vector.observation_space.contains(observations)
    with pytest.raises(InputError, match="obs_type: 'pixels_agent_pos' needs the agent's position"):
        make_env(engine, obs_type="pixels_agent_pos")


def test_registered_pusht_spec_carries_the_episode_length():
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets

    register_envs()
    assert gym.spec("cosmos3_gym/PushT-v0").max_episode_steps == load_pusht_assets().meta["max_episode_steps"] == 38


def test_builtin_model_by_name(tiny_checkpoint):
    """checkpoint="pusht" is the built-in model with its own settings, as PushT-v0 (no model call here)."""
    register_envs()
    env = gym.make(ENV_ID, checkpoint="pusht", device="cpu")
    try:
        settings = env.unwrapped.settings
        assert (settings.domain, settings.chunk, settings.guidance_scale, settings.fps) == ("pusht", 8, 1.0, 10.0)
        assert env.action_space.shape == (8, 2) and env.unwrapped.action_stats is not None
        assert len(env.unwrapped.initial_states) > 1 and env.unwrapped._core.reward_model is not None
    finally:
        env.close()


def test_world_model_v0_with_the_builtin_model_is_pusht_v0():
    """Issue 41: WorldModel-v0 with checkpoint="pusht" is PushT-v0 (light decoder, the fast path, the reward model):
    the same observations and rewards for the same seed and actions. A path to the same folder is a plain
    WorldModelEnv that still takes the checkpoint's meta.json defaults, its decoder included."""
    from cosmos3_gym.registration import builtin_model

    register_envs()
    chunks = actions_like((8, 2), seed=0, n=2)
    results = []
    for env_id, kwargs in ((ENV_ID, dict(checkpoint="pusht")), ("cosmos3_gym/PushT-v0", {})):
        env = gym.make(env_id, device="cpu", num_steps=1, **kwargs)
        try:
            assert env.unwrapped.engine.decoder == "light" and env.unwrapped._core.owns_engine
            observation, _ = env.reset(seed=5)
            steps = [env.step(chunk)[:2] for chunk in chunks]
            results.append((observation["image"], [(o["image"], r) for o, r in steps], env.unwrapped.settings))
        finally:
            env.close()
    (first, first_steps, first_settings), (second, second_steps, second_settings) = results
    assert first_settings == second_settings
    np.testing.assert_array_equal(first, second)
    for (image_a, reward_a), (image_b, reward_b) in zip(first_steps, second_steps):
        np.testing.assert_array_equal(image_a, image_b)
        assert reward_a == reward_b

    by_path = gym.make(ENV_ID, checkpoint=str(builtin_model("pusht").checkpoint_dir), device="cpu", num_steps=1)
    try:
        assert type(by_path.unwrapped) is WorldModelEnv
        assert by_path.unwrapped.engine.decoder == "light"  # meta.json's decoder
        assert by_path.unwrapped.settings == first_settings.replace(action_stats=by_path.unwrapped.action_stats)
        assert by_path.unwrapped._core.reward_model is not None
    finally:
        by_path.close()


def actions_like(shape, seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, shape).astype(np.float32) for _ in range(n)]


def blue_pixels(frames: np.ndarray) -> np.ndarray:
    """Pixels of the PushT agent's royal-blue disc per frame ``[..., H, W, 3]`` (the T is grey, the target green)."""
    red, green, blue = (frames[..., channel].astype(int) for channel in range(3))
    return ((blue > 150) & (blue - red > 70) & (blue - green > 40)).sum(axis=(-2, -1))


def test_builtin_pusht_agent_stays_visible_under_random_actions():
    """Issue 18: the built-in PushT model used to lose the blue agent disc after one step under
    ``action_space.sample()`` (each of the 8 targets drawn independently over the table: its training data moved
    smoothly). Trained since on uniform-random episodes too, it keeps the agent under random and constant actions."""
    envs = gym.make_vec("cosmos3_gym/PushT-v0", num_envs=4, device="cpu")
    try:
        observations, _ = envs.reset(seed=0, options={"initial_state_index": [0, 2, 0, 2]})
        start = blue_pixels(observations["image"])
        assert (start > 100).all()  # the agent is visible in every start frame
        envs.action_space.seed(0)
        chunks = envs.action_space.sample()
        chunks[2:] = 0.0  # slots 2 and 3: a constant action (the table's centre) from the same two starts
        observations, *_ = envs.step(chunks)
        after = blue_pixels(observations["image"])
    finally:
        envs.close()
    assert (after[:2] > 0.5 * start[:2]).all(), f"random actions: agent pixels {start[:2]} -> {after[:2]}"
    assert (after[2:] > 0.5 * start[2:]).all(), f"constant action: agent pixels {start[2:]} -> {after[2:]}"
