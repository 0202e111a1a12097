"""Helper agents on the tiny checkpoint: shapes, batching equal to one-by-one calls, seeds, windowing, error math."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosmos3_gym.agents import InverseDynamicsAgent, PolicyAgent, action_errors, video_windows
from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.errors import InputError

SETTINGS = dict(domain="pusht", chunk=4, num_steps=2, resolution_tier=256)  # pusht: raw_action_dim 2
CHUNK, RAW = 4, 2


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


def images(count: int, seed: int, size=(48, 64)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


class RecordingEngine:
    """Stands in for the engine: records each step's requests and returns fixed out-of-range actions."""

    def __init__(self, value: float):
        self.action_dim = 64
        self.value = value
        self.calls = []

    def step(self, requests, decode=None):
        self.calls.append((list(requests), decode))
        return [SimpleNamespace(action=np.full((r.chunk, r.raw_action_dim), self.value, np.float32)) for r in requests]


# ------------------------------------------------------------------ PolicyAgent


def test_policy_batched_equals_one_by_one(engine):
    observations = images(3, seed=0)
    batched = PolicyAgent(engine, "push the T", seed=7, **SETTINGS).act({"image": observations})
    one_by_one_agent = PolicyAgent(engine, "push the T", seed=7, **SETTINGS)
    one_by_one = np.stack([one_by_one_agent.act(image) for image in observations])
    assert batched.shape == (3, CHUNK, RAW) and batched.dtype == np.float32
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5, rtol=0)
    assert np.abs(batched).max() <= 1.0
    assert not np.allclose(batched[0], batched[1])  # different observations and seeds give different chunks


def test_policy_observation_forms_and_reproducibility(engine):
    image = images(1, seed=1)[0]
    agent = PolicyAgent(engine, "push the T", seed=3, **SETTINGS)
    from_array = agent.act(image)
    agent.reset(3)
    from_dict = agent({"image": image, "state": np.zeros(2)})
    agent.reset(3)
    from_tensor = agent.act(torch.from_numpy(image).permute(2, 0, 1))  # CHW uint8 tensor
    agent.reset(3)
    action, state = agent.predict({"image": image[None]}, state=None, episode_start=np.array([True]))
    assert from_array.shape == (CHUNK, RAW) and action.shape == (1, CHUNK, RAW) and state is None
    np.testing.assert_array_equal(from_array, from_dict)
    np.testing.assert_array_equal(from_array, from_tensor)
    np.testing.assert_allclose(action[0], from_array, atol=1e-5, rtol=0)
    assert not np.array_equal(agent.act(image), from_array)  # the sequence moved on: a new seed


def test_policy_one_batched_step_with_seeded_requests_and_clipping():
    fake = RecordingEngine(value=5.0)
    agent = PolicyAgent(fake, "push", seed=11, **SETTINGS)
    actions = agent.act([{"image": image} for image in images(3, seed=2)], task=["a", "b", "c"])
    assert actions.shape == (3, CHUNK, RAW) and (actions == 1.0).all()  # clipped to the action space
    assert len(fake.calls) == 1
    requests, decode = fake.calls[0]
    expected_seeds = np.random.default_rng(11)
    assert [r.seed for r in requests] == [int(expected_seeds.integers(0, 2**63)) for _ in range(3)]
    assert [r.task for r in requests] == ["a", "b", "c"] and decode is False
    fields = {(r.mode, r.chunk, r.num_inference_steps, r.resolution_tier, r.domain, r.raw_action_dim) for r in requests}
    assert fields == {("policy", CHUNK, 2, 256, "pusht", RAW)}
    PolicyAgent(fake, "push", **SETTINGS).act(images(1, seed=0)[0])
    assert fake.calls[1][0][0].seed is None  # no agent seed: the engine draws one


@pytest.mark.parametrize(
    "kwargs, observation, call_kwargs, message",
    [
        (dict(task=None), "image", {}, "task: PolicyAgent needs a task"),
        ({}, "image", dict(task=["a", "b"]), "task: expected one string or a list of 1 strings"),
        ({}, {"rgb": 0}, {}, r"observation: a dict observation needs an 'image' entry, got keys \['rgb'\]"),
        ({}, np.zeros((2, 2)), {}, r"observation: expected an HWC image, a batch"),
        ({}, [], {}, "observation: got an empty list"),
        ({}, [np.zeros((2, 8, 8, 3), np.uint8)], {}, "observation: a list must hold single observations"),
        (dict(chunk=0), "image", {}, "chunk: expected an integer >= 1"),
        (dict(num_steps=1.5), "image", {}, "num_steps: expected an integer >= 1"),
        (dict(domain="mars_rover"), "image", {}, "domain: unknown embodiment 'mars_rover'"),
        (dict(raw_action_dim=100), "image", {}, r"raw_action_dim: expected an integer in \[1, 64\]"),
        (dict(resolution_tier=300), "image", {}, "resolution_tier: expected one of"),
        (dict(guidance_scale=-1.0), "image", {}, "guidance_scale: expected a number >= 0"),
        (dict(fps=0), "image", {}, "fps: expected a number > 0"),
        (dict(seed=-1), "image", {}, "seed: expected a non-negative integer"),
        (dict(view_point="sky"), "image", {}, "view_point: expected one of"),
        (dict(task=3), "image", {}, "task: expected a string or None"),
    ],
)
def test_policy_rejects_bad_input(kwargs, observation, call_kwargs, message):
    fake = RecordingEngine(value=0.0)
    if isinstance(observation, str):
        observation = images(1, seed=0)[0]
    with pytest.raises(InputError, match=message):
        PolicyAgent(fake, **{"task": "push", **SETTINGS, **kwargs}).act(observation, **call_kwargs)


@pytest.mark.parametrize("agent_class", [PolicyAgent, InverseDynamicsAgent])
def test_agents_need_an_engine(agent_class):
    with pytest.raises(InputError, match="engine: expected a Cosmos3Engine, got object"):
        agent_class(object(), "push", **SETTINGS)


# ------------------------------------------------------------------ InverseDynamicsAgent


def test_inverse_dynamics_shapes_layouts_and_batching(engine):
    video = images(CHUNK + 1, seed=4)
    agent = InverseDynamicsAgent(engine, seed=5, **SETTINGS)
    from_uint8 = agent.infer(video)
    agent.reset(5)
    channels_first = torch.from_numpy(video).permute(0, 3, 1, 2).float().numpy() / 255.0  # float [T, 3, H, W]
    from_float = agent(channels_first)
    agent.reset(5)
    from_list = agent.infer(list(video))
    assert from_uint8.shape == (CHUNK, RAW) and from_uint8.dtype == np.float32
    np.testing.assert_array_equal(from_uint8, from_float)
    np.testing.assert_array_equal(from_uint8, from_list)

    other = images(CHUNK + 1, seed=6)
    agent.reset(5)
    batched = agent.infer([video, other])
    agent.reset(5)
    stacked = agent.infer(np.stack([video, other]))
    assert batched.shape == (2, CHUNK, RAW)
    np.testing.assert_allclose(batched[0], from_uint8, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(batched, stacked)


def test_video_windows():
    assert video_windows(5, 4) == [(0, 4)]
    assert video_windows(9, 4) == [(0, 4), (4, 4)]  # consecutive windows share frame 4
    assert video_windows(10, 4) == [(0, 4), (4, 4), (5, 1)]  # the last window keeps only transition 8 -> 9
    assert video_windows(7, 4) == [(0, 4), (2, 2)]
    for frames, chunk in ((5, 4), (9, 4), (10, 4), (7, 4), (23, 5), (2, 1)):
        windows = video_windows(frames, chunk)
        labelled = [t for start, keep in windows for t in range(start + chunk - keep, start + chunk)]
        assert labelled == list(range(frames - 1))  # every transition exactly once, in order
    with pytest.raises(InputError, match=r"frames: expected at least chunk \+ 1 = 5 frames, got 4"):
        video_windows(4, 4)


def test_label_video_matches_per_window_inference(engine):
    long_video = images(10, seed=7)
    labels = InverseDynamicsAgent(engine, seed=9, **SETTINGS).label_video(long_video)
    windows = InverseDynamicsAgent(engine, seed=9, **SETTINGS).infer(
        [long_video[0:5], long_video[4:9], long_video[5:10]]
    )
    assert labels.shape == (9, RAW)
    np.testing.assert_allclose(labels, np.concatenate([windows[0], windows[1], windows[2][-1:]]), atol=1e-5, rtol=0)
    in_pairs = InverseDynamicsAgent(engine, seed=9, **SETTINGS).label_video(long_video, batch_size=2)
    np.testing.assert_allclose(in_pairs, labels, atol=1e-5, rtol=0)

    fake = RecordingEngine(value=0.0)
    assert InverseDynamicsAgent(fake, **SETTINGS).label_video(images(13, seed=0), chunk=2).shape == (12, RAW)
    assert [len(requests) for requests, _ in fake.calls] == [6]  # all windows in one engine.step
    assert {r.chunk for r in fake.calls[0][0]} == {2}


def test_action_errors_math():
    inferred = np.array([[1.0, 2.0], [3.0, 4.0]])
    commanded = np.array([[0.0, 0.0], [3.0, 2.0]])  # differences [[1, 2], [0, 2]]
    errors = action_errors(inferred, commanded)
    assert errors["mse"] == pytest.approx(9 / 4) and errors["mae"] == pytest.approx(5 / 4)
    np.testing.assert_allclose(errors["per_step"], [2.5, 2.0])
    batched = action_errors(np.stack([inferred, commanded]), np.stack([commanded, commanded]))
    np.testing.assert_allclose(batched["mse"], [2.25, 0.0])
    np.testing.assert_allclose(batched["mae"], [1.25, 0.0])
    np.testing.assert_allclose(batched["per_step"], [[2.5, 2.0], [0.0, 0.0]])


def test_action_following_error(engine):
    video = images(CHUNK + 1, seed=8)
    inferred = InverseDynamicsAgent(engine, seed=2, **SETTINGS).infer(video)
    agent = InverseDynamicsAgent(engine, seed=2, **SETTINGS)
    exact = agent.action_following_error(video, inferred)
    assert exact["mse"] < 1e-10 and exact["per_step"].shape == (CHUNK,)
    np.testing.assert_array_equal(exact["inferred_actions"], inferred)

    agent.reset(2)
    shifted = agent.action_following_error([video], (inferred + 0.5)[None])  # a batch of one
    np.testing.assert_allclose(shifted["mse"], [0.25], atol=1e-5)
    np.testing.assert_allclose(shifted["mae"], [0.5], atol=1e-5)
    assert shifted["per_step"].shape == (1, CHUNK)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda a: a.infer(images(CHUNK, seed=0)), r"frames: expected chunk \+ 1 = 5 frames per video, got 4"),
        (lambda a: a.infer(np.zeros((5, 8, 8, 2), np.uint8)), "frames: expected 1 .grayscale., 3 .RGB. or 4"),
        (lambda a: a.infer([]), "frames: got an empty list"),
        (lambda a: a.infer(images(5, seed=0), task=["a", "b"]), "task: expected one string or a list of 1"),
        (lambda a: a.label_video(images(9, seed=0), chunk=0), "chunk: expected an integer >= 1"),
        (lambda a: a.label_video(images(9, seed=0), batch_size=0), "batch_size: expected an integer >= 1"),
        (lambda a: a.label_video(images(9, seed=0), task=["a"]), "task: expected one string for the whole video"),
        (lambda a: a.label_video(images(3, seed=0)), r"frames: expected at least chunk \+ 1 = 5 frames, got 3"),
        (lambda a: a.action_following_error(images(5, seed=0), np.zeros((4, 3))), "commanded_actions: expected"),
        (lambda a: a.action_following_error(images(5, seed=0), np.full((4, 2), np.nan)), "commanded_actions: contains"),
        (lambda a: a.action_following_error([images(5, 0)] * 2, np.zeros((3, 4, 2))), "commanded_actions: shape"),
    ],
)
def test_inverse_dynamics_rejects_bad_input(call, message):
    with pytest.raises(InputError, match=message):
        call(InverseDynamicsAgent(RecordingEngine(value=0.0), **SETTINGS))


# ------------------------------------------------------------------ agents built from an env (WorldModelSettings)


def test_from_env_acts_in_the_envs_action_space(engine):
    """Issue 20: PolicyAgent(env.engine, task=...) used DROID defaults (32 x 10 chunks that env.step refused);
    from_env takes the env's settings, so its actions are the env's, through wrappers and the vector env too."""
    import gymnasium as gym

    from cosmos3_gym.envs import WorldModelEnv, WorldModelVectorEnv

    frame = images(1, seed=5, size=(96, 128))[0]
    settings = dict(SETTINGS, guidance_scale=1.0, fps=10.0, task="push the T")
    env = gym.wrappers.ClipAction(WorldModelEnv(engine=engine, initial_states=frame, **settings))
    agent = PolicyAgent.from_env(env, seed=0)
    assert agent.settings is env.unwrapped.settings and agent.engine is engine and agent.task == "push the T"
    assert (agent.chunk, agent.raw_action_dim, agent.guidance_scale, agent.fps) == (4, 2, 1.0, 10.0)
    observation, _ = env.reset(seed=0)
    action = agent.act(observation)
    assert env.action_space.contains(action)
    env.step(action)  # accepted
    recording = RecordingEngine(0.5)
    PolicyAgent(recording, "t", settings=env.unwrapped.settings, num_steps=3).act(observation)
    request = recording.calls[0][0][0]
    assert (request.chunk, request.domain, request.guidance_scale, request.fps, request.num_inference_steps) == \
        (4, "pusht", 1.0, 10.0, 3)  # keywords win over settings

    vector = WorldModelVectorEnv(2, engine=engine, initial_states=frame, **settings)
    observations, _ = vector.reset(seed=0)
    actions = PolicyAgent.from_env(vector, seed=0).act(observations)
    assert vector.action_space.contains(actions)

    inverse = InverseDynamicsAgent.from_env(env, seed=0)
    assert inverse.settings is env.unwrapped.settings and inverse.task == "push the T"
    with pytest.raises(InputError, match="from_env needs a cosmos3_gym world-model env"):
        PolicyAgent.from_env(gym.make("CartPole-v1"))
