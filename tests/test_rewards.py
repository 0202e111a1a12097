"""Reward models: the protocol, the built-in models, the registry and every input check."""

import importlib.metadata
import json
import pickle
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.rewards import (
    ENTRY_POINT_GROUP,
    CallableRewardModel,
    ClassifierRewardModel,
    GoalImageRewardModel,
    RewardModel,
    RewardModelSpec,
    available_reward_models,
    check_frames,
    register_reward_model,
    registry,
    resolve_reward_model,
    train_classifier,
    validate_reward,
)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


@pytest.fixture
def isolated_registry(monkeypatch):
    """A private copy of the in-process registry, so registrations do not leak into other tests."""
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))


def brightness_dataset(count: int, seed: int, size=(24, 20)):
    """uint8 frames [N, H, W, 3]: label 1 frames are bright noise (150..255), label 0 frames dark noise (0..105)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, count).astype(np.float32)
    low = np.where(labels[:, None, None, None] == 1, 150, 0)
    frames = (low + rng.integers(0, 106, (count, *size, 3))).astype(np.uint8)
    return frames, labels


def to_chunks(frames_uint8: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float [N, 1, 3, H, W] in [0, 1]: one single-frame chunk per frame."""
    return torch.from_numpy(frames_uint8).permute(0, 3, 1, 2)[:, None].float() / 255.0


@pytest.fixture(scope="module")
def trained_classifier():
    frames, labels = brightness_dataset(96, seed=0)
    return train_classifier(frames, labels, epochs=6, lr=3e-3, batch_size=16, seed=0, progress=False)


# ------------------------------------------------------------------ protocol and shapes


def test_builtin_models_follow_the_protocol(tmp_path):
    frames = torch.rand(3, 2, 3, 32, 48)
    tasks = ["a", "b", "c"]
    goal = tmp_path / "goal.png"
    Image.fromarray(np.zeros((32, 48, 3), np.uint8)).save(goal)
    models = [
        ClassifierRewardModel(),
        GoalImageRewardModel(goal),
        CallableRewardModel(lambda f, t: f.mean(dim=(1, 2, 3, 4))),
        CallableRewardModel(lambda f, t: np.arange(len(t))),  # numpy output -> float32 tensor
    ]
    for model in models:
        assert isinstance(model, RewardModel)
        rewards = validate_reward(model.to("cpu")(frames, tasks), 3, model)
        assert rewards.shape == (3,) and rewards.dtype == torch.float32 and rewards.device.type == "cpu"
    assert models[3](frames, tasks).tolist() == [0.0, 1.0, 2.0]


def test_classifier_reductions_over_the_chunk():
    torch.manual_seed(0)
    model = ClassifierRewardModel().eval()
    frames = torch.rand(2, 3, 3, 40, 40)
    per_frame = model.score_frames(frames.flatten(0, 1)).view(2, 3)
    for reduce, expected in (("last", per_frame[:, -1]), ("max", per_frame.amax(1)), ("mean", per_frame.mean(1))):
        model.reduce = reduce
        torch.testing.assert_close(model(frames, ["x", "y"]), expected)
    # GroupNorm, not BatchNorm: a frame's score does not depend on the rest of the batch.
    torch.testing.assert_close(model.score_frames(frames[0]), per_frame[0])


# ------------------------------------------------------------------ classifier training and files


def test_classifier_learns_bright_vs_dark(trained_classifier):
    frames, labels = brightness_dataset(64, seed=1, size=(30, 40))  # held out, and another frame size
    predictions = trained_classifier(to_chunks(frames), ["t"] * len(frames)) > 0.5
    accuracy = (predictions.numpy() == (labels == 1)).mean()
    assert accuracy >= 0.95


def test_training_is_seeded_and_takes_float_frames():
    frames, labels = brightness_dataset(16, seed=2)
    float_frames = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0
    state_before = torch.random.get_rng_state()
    first = train_classifier(float_frames, labels, epochs=1, batch_size=8, seed=5, progress=False)
    second = train_classifier(float_frames, labels, epochs=1, batch_size=8, seed=5, progress=False)
    assert torch.equal(torch.random.get_rng_state(), state_before)  # the caller's RNG is untouched
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key


def test_classifier_round_trips_through_safetensors(trained_classifier, tmp_path, monkeypatch):
    directory = trained_classifier.save(tmp_path / "rm")
    raw = (directory / "model.safetensors").read_bytes()
    header_length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + header_length])  # safetensors: u64 header size, JSON header, raw tensor bytes
    assert set(header) - {"__metadata__"} == set(trained_classifier.state_dict())
    assert not raw.startswith(b"PK") and not raw.startswith(b"\x80")  # neither torch.save's zip nor a pickle
    config = json.loads((directory / "config.json").read_text())
    assert config["reduce"] == "last" and config["input_size"] == 64

    def no_unpickling(*args, **kwargs):
        raise AssertionError("reward model loading must not unpickle")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    loaded = ClassifierRewardModel.load(directory)
    for key, value in trained_classifier.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    frames = torch.rand(4, 2, 3, 50, 60)
    assert torch.equal(loaded(frames, ["t"] * 4), trained_classifier(frames, ["t"] * 4))

    by_name = resolve_reward_model(f"classifier:{directory}?reduce=max")
    assert isinstance(by_name, ClassifierRewardModel) and by_name.reduce == "max"
    best_frame_scores = trained_classifier.score_frames(frames.flatten(0, 1)).view(4, 2).amax(1)
    assert torch.equal(by_name(frames, ["t"] * 4), best_frame_scores)
    assert resolve_reward_model(f"classifier:{directory / 'model.safetensors'}").reduce == "last"


def test_classifier_load_rejects_damaged_files(trained_classifier, tmp_path):
    directory = trained_classifier.save(tmp_path / "rm")
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        ClassifierRewardModel.load(directory)
    (directory / "config.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="config.json"):
        ClassifierRewardModel.load(directory)
    with pytest.raises(CheckpointError, match="classifier"):
        ClassifierRewardModel.load(tmp_path / "missing")


# ------------------------------------------------------------------ goal image


def goal_and_candidates(tmp_path):
    rng = np.random.default_rng(3)

    def smooth_image():  # low-frequency content, so that resizing it back and forth changes it little
        coarse = torch.rand(1, 3, 4, 6, generator=torch.Generator().manual_seed(int(rng.integers(100))))
        fine = torch.nn.functional.interpolate(coarse, size=(32, 48), mode="bilinear", align_corners=False)
        return (fine[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)

    goal = smooth_image()
    path = tmp_path / "goal.png"
    Image.fromarray(goal).save(path)
    noisy = np.clip(goal.astype(int) + rng.integers(-40, 41, goal.shape), 0, 255).astype(np.uint8)
    candidates = [goal, noisy, goal[::-1].copy(), smooth_image()]
    # Each candidate is the last frame of a 2-frame chunk whose first frame is noise (only the last frame counts).
    chunks = torch.stack([torch.cat([torch.rand(1, 3, 32, 48), to_chunks(c[None])[0]]) for c in candidates])
    return path, chunks


def test_goal_image_reward_is_highest_for_the_goal(tmp_path, engine):
    path, chunks = goal_and_candidates(tmp_path)
    tasks = ["reach the goal"] * len(chunks)
    pixel = resolve_reward_model(f"goal_image:{path}?scale=0.02")(chunks, tasks)
    assert pixel[0].item() == 1.0 and pixel.argmax().item() == 0 and (pixel[1:] < 1).all()
    assert pixel[1] > pixel[3]  # a noisy goal is closer than an unrelated image

    # Frames of another size are resized to the goal's before comparing.
    upscaled = torch.nn.functional.interpolate(chunks[:, -1], scale_factor=2, mode="bilinear")[:, None]
    pixel_upscaled = resolve_reward_model(f"goal_image:{path}?scale=0.02")(upscaled, tasks)
    assert pixel_upscaled.argmax().item() == 0 and pixel_upscaled[0] > 0.9

    latent = resolve_reward_model(f"goal_image:{path}?space=latent", vae=engine.vae)(chunks, tasks)
    assert abs(latent[0].item() - 1.0) < 1e-5 and (latent[1:] < latent[0]).all()


# ------------------------------------------------------------------ registry


PLUGIN_SOURCE = '''
from cosmos3_gym.rewards import CallableRewardModel

def make(spec):
    value = spec.float_option("value", 1.0)
    return CallableRewardModel(lambda frames, tasks: [value] * len(tasks), name=spec.text)
'''


def fake_entry_points(*entry_points):
    def entry_points_of(group=None, **kwargs):
        return [ep for ep in entry_points if ep.group == group]

    return entry_points_of


def test_entry_point_lookup(tmp_path, monkeypatch):
    (tmp_path / "cosmos3_gym_test_plugin.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        fake_entry_points(
            importlib.metadata.EntryPoint("constant", "cosmos3_gym_test_plugin:make", ENTRY_POINT_GROUP),
            importlib.metadata.EntryPoint("broken", "cosmos3_gym_missing_module:make", ENTRY_POINT_GROUP),
            importlib.metadata.EntryPoint("other_group", "cosmos3_gym_test_plugin:make", "another.group"),
        ),
    )
    # the tasks' come from entry points
    assert available_reward_models() == ["broken", "classifier", "constant", "goal_image"]
    model = resolve_reward_model("constant?value=2.5")
    assert model.name == "constant?value=2.5"
    assert model(torch.rand(2, 1, 3, 8, 8), ["a", "b"]).tolist() == [2.5, 2.5]
    with pytest.raises(InputError, match="entry point 'broken'"):
        resolve_reward_model("broken")
    with pytest.raises(InputError, match=r"unknown reward model 'other_group'.*'constant'.*'goal_image'"):
        resolve_reward_model("other_group")
    with pytest.raises(InputError, match="option value: expected a number"):
        resolve_reward_model("constant?value=high")


def test_in_process_registration(isolated_registry, monkeypatch):
    seen = []

    def factory(spec: RewardModelSpec):
        seen.append(spec)
        return lambda frames, tasks: torch.full((len(tasks),), float(spec.argument))

    register_reward_model("fixed", factory)
    model = resolve_reward_model("fixed:7?mode=fast&k=", device="cpu")
    assert isinstance(model, CallableRewardModel)  # a plain callable from a factory is wrapped
    assert model(torch.rand(3, 1, 3, 8, 8), list("abc")).tolist() == [7.0] * 3
    spec = seen[0]
    assert (spec.name, spec.argument, dict(spec.options), spec.device) == (
        "fixed", "7", {"mode": "fast", "k": ""}, torch.device("cpu")
    )
    assert "fixed" in available_reward_models()

    with pytest.raises(InputError, match="already registered"):
        register_reward_model("fixed", factory)
    register_reward_model("fixed", lambda spec: CallableRewardModel(lambda f, t: [0.0] * len(t)), replace=True)
    assert resolve_reward_model("fixed:1")(torch.rand(1, 1, 3, 8, 8), ["a"]).tolist() == [0.0]

    # An in-process name wins over an entry point of the same name (which would fail to import).
    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points(
        importlib.metadata.EntryPoint("fixed", "cosmos3_gym_missing_module:make", ENTRY_POINT_GROUP)))
    assert resolve_reward_model("fixed:1") is not None


def test_resolve_passes_models_and_callables_through():
    assert resolve_reward_model(None) is None
    model = ClassifierRewardModel()
    assert resolve_reward_model(model, device="cpu") is model

    def my_reward(frames, tasks):
        return torch.ones(len(tasks))

    wrapped = resolve_reward_model(my_reward)
    assert isinstance(wrapped, CallableRewardModel) and wrapped.name == "my_reward"


# ------------------------------------------------------------------ bad input


def _goal_path(tmp_path):
    path = tmp_path / "goal.png"
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(path)
    return path


BAD_RESOLVE_SPECS = [
    (42, "reward_model: expected None"),
    (ClassifierRewardModel, "reward_model: got the class ClassifierRewardModel"),
    ("no_such_model", r"unknown reward model 'no_such_model'; known: \['classifier', 'goal_image', 'returns_text'\]"),
    ("bad name!", "reward_model: cannot parse 'bad name!'"),
    ("returns_text", r"reward_model 'returns_text': the factory of 'returns_text' returned str, not a reward model"),
    ("classifier", r"expected 'classifier:PATH"),
    ("classifier:{tmp}/missing", "reward_model 'classifier:.*/missing': classifier: expected a directory"),
    ("goal_image:{goal}?colour=red", r"unknown option\(s\) \['colour'\]; 'goal_image' accepts \['scale', 'space'\]"),
    ("goal_image:{goal}?scale=abc", "option scale: expected a number"),
    ("goal_image:{goal}?scale=-1", "scale: expected a positive number"),
    ("goal_image:{goal}?space=fourier", r"space: expected one of \['pixel', 'latent'\]"),
    ("goal_image:{goal}?space=latent", r"reward_model 'goal_image:.*\?space=latent': vae: space='latent' needs a"),
    ("goal_image:{goal}?scale=1&scale=2", "option 'scale' given twice"),
    ("goal_image:{goal}?noequals", "options must read KEY=VALUE"),
    ("goal_image:{tmp}/missing.png", "observation: file not found"),
]


@pytest.mark.parametrize("spec, message", BAD_RESOLVE_SPECS)
def test_resolve_rejects_bad_specs(tmp_path, monkeypatch, isolated_registry, spec, message):
    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points())  # no installed plug-ins
    register_reward_model("returns_text", lambda spec: "not a model")
    if isinstance(spec, str):
        spec = spec.format(tmp=tmp_path, goal=_goal_path(tmp_path))
    with pytest.raises(InputError, match=message):
        resolve_reward_model(spec)


def test_validate_reward_names_the_model():
    model = CallableRewardModel(lambda f, t: None, name="my_rm")
    for rewards, message in (
        (torch.zeros(3), r"reward_model 'my_rm': expected rewards of shape \[2\]"),
        (torch.zeros(2, 1), r"expected rewards of shape \[2\] \(one per batch row\), got \[2, 1\]"),
        (torch.tensor([0.0, float("nan")]), "reward_model 'my_rm': returned NaN or infinite rewards"),
        (torch.tensor([True, False]), "expected real-valued rewards"),
        ([1.0, 2.0], "expected a tensor of 2 rewards, got list"),
    ):
        with pytest.raises(InputError, match=message):
            validate_reward(rewards, 2, model)
    assert validate_reward(np.array([1, 2]), 2, model).dtype == torch.float32


@pytest.mark.parametrize(
    "frames, tasks, message",
    [
        ("pixels", ["a"], "frames: expected a float tensor"),
        (torch.rand(1, 3, 8, 8), ["a"], r"frames: expected a non-empty tensor \[B, T, 3, H, W\]"),
        (torch.rand(1, 1, 4, 8, 8), ["a"], r"frames: expected a non-empty tensor"),
        (torch.zeros(1, 1, 3, 8, 8, dtype=torch.uint8), ["a"], "frames: expected floating-point"),
        (torch.full((1, 1, 3, 8, 8), 2.0), ["a"], r"frames: expected pixel values in \[0, 1\]"),
        (torch.full((1, 1, 3, 8, 8), float("nan")), ["a"], r"frames: expected pixel values in \[0, 1\]"),
        (torch.rand(2, 1, 3, 8, 8), "a", "tasks: expected a list of 2 strings"),
        (torch.rand(2, 1, 3, 8, 8), ["a"], "tasks: expected 2 strings"),
        (torch.rand(1, 1, 3, 8, 8), [3], "tasks: expected 1 strings"),
    ],
)
def test_reward_inputs_are_checked(frames, tasks, message):
    with pytest.raises(InputError, match=message):
        check_frames(frames, tasks)
    with pytest.raises(InputError, match=message):
        ClassifierRewardModel()(frames, tasks)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(labels=np.zeros(5)), r"labels: expected shape \[8\]"),
        (dict(labels=np.full(8, 1.5)), r"labels: expected values in \[0, 1\]"),
        (dict(frames=np.zeros((8, 3, 10, 10), np.uint8)), r"frames: uint8 frames must be \[N, H, W, 3\]"),
        (dict(frames=np.zeros((8, 10, 10, 3), np.float32)), r"frames: float frames must be \[N, 3, H, W\]"),
        (dict(frames=np.full((8, 3, 10, 10), 3.0, np.float32)), r"frames: float frames must lie in \[0, 1\]"),
        (dict(frames=np.zeros((8, 10, 10, 3), np.int64)), "frames: expected uint8"),
        (dict(frames=[[0]]), "frames: expected a numpy array or torch tensor"),
        (dict(epochs=0), "epochs: expected an integer >= 1"),
        (dict(batch_size=1.5), "batch_size: expected an integer >= 1"),
        (dict(lr=-1.0), "lr: expected a positive number"),
        (dict(reduce="median"), r"reduce: expected one of \['last', 'max', 'mean'\]"),
        (dict(input_size=4), "input_size: expected an integer >= 8"),
        (dict(channels=[]), "channels: expected a non-empty list"),
    ],
)
def test_train_classifier_checks_inputs(kwargs, message):
    arguments = dict(frames=np.zeros((8, 10, 10, 3), np.uint8), labels=np.zeros(8), epochs=1, progress=False)
    arguments.update(kwargs)
    frames, labels = arguments.pop("frames"), arguments.pop("labels")
    with pytest.raises(InputError, match=message):
        train_classifier(frames, labels, **arguments)


def test_goal_image_and_registration_check_inputs(tmp_path):
    with pytest.raises(InputError, match="goal: expected one image, got 2 frames"):
        GoalImageRewardModel(np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(InputError, match="vae: space='latent' needs a Cosmos3VAE"):
        GoalImageRewardModel(_goal_path(tmp_path), space="latent")
    with pytest.raises(InputError, match="name: expected a reward model name"):
        register_reward_model("has space", lambda spec: None)
    with pytest.raises(InputError, match="factory: expected a callable"):
        register_reward_model("fine_name", "not callable")
    with pytest.raises(InputError, match="reward_model: expected a callable"):
        CallableRewardModel(3)
    with pytest.raises(InputError, match="device: expected a torch device"):
        resolve_reward_model(lambda frames, tasks: [0.0] * len(tasks), device="graphics card")
    with pytest.raises(InputError, match="reward_model 'text_rm': expected numeric rewards"):
        CallableRewardModel(lambda f, t: "high", name="text_rm")(torch.rand(1, 1, 3, 8, 8), ["a"])


# ---------------------------------------------------------------------------------------------------------------
# pusht_geometric: coverage of a rigid T fitted to the frame; deformed blocks flagged
# ---------------------------------------------------------------------------------------------------------------

_BLOCK_FILL = np.array([143, 163, 184], np.uint8)  # gym-pusht's block fill colour


def _body_coordinates(size: int, pose) -> tuple[np.ndarray, np.ndarray]:
    centres = (np.arange(size) + 0.5) * 512 / size
    x, y = np.meshgrid(centres, centres)
    dx, dy = x - pose[0], y - pose[1]
    cos, sin = np.cos(pose[2]), np.sin(pose[2])
    return cos * dx + sin * dy, -sin * dx + cos * dy


def _tee_parts(bx, by):
    return (np.abs(bx) <= 60) & (by >= 0) & (by <= 30), (np.abs(bx) <= 15) & (by >= 30) & (by <= 120)


def _repaint(frame, shape):
    """The frame with its block erased (table white) and ``shape`` painted in the block's colour."""
    pixels = frame.astype(int)
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    block = (np.abs(r - 135) < 40) & (np.abs(g - 153) < 40) & (np.abs(b - 175) < 40) & (b - r > 15) & (b - r < 70)
    out = frame.copy()
    out[block] = 255
    out[shape] = _BLOCK_FILL
    return out


def _bent(frame, pose):  # the stem turned 50 degrees about its joint with the bar
    bx, by = _body_coordinates(frame.shape[0], pose)
    bar, _ = _tee_parts(bx, by)
    angle = np.radians(50.0)
    sx = np.cos(angle) * bx + np.sin(angle) * (by - 30)
    sy = -np.sin(angle) * bx + np.cos(angle) * (by - 30) + 30
    _, stem = _tee_parts(sx, sy)
    return _repaint(frame, bar | (stem & (sy > 30)))


def _melted(frame, pose):  # the T smeared into a blob of about its size
    bx, by = _body_coordinates(frame.shape[0], pose)
    return _repaint(frame, (bx / 70) ** 2 + ((by - 45) / 55) ** 2 <= 1.0)


def _split(frame, pose):  # the stem torn 45 px off the bar
    bx, by = _body_coordinates(frame.shape[0], pose)
    bar, _ = _tee_parts(bx, by)
    _, stem = _tee_parts(bx, by - 45)
    return _repaint(frame, bar | stem)


@pytest.fixture(scope="module")
def pusht_frames():
    """Real gym-pusht frames (96 x 96) along scripted pushes, their true coverage and block poses."""
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.tasks.pusht import episodes as pusht

    sim = pusht.PushTSim((96, 96))
    frames, coverage, poses = [], [], []
    try:
        for seed in range(4):
            episode = pusht.rollout_episode(sim, pusht.ScriptedPusher(np.random.default_rng(seed)), seed, 150)
            steps = np.arange(0, 151, 15)
            frames.append(episode["frames"][steps])
            coverage.append(episode["coverage"][steps])
            poses.append(episode["sim_states"][steps][:, 4:7])
    finally:
        sim.close()
    return np.concatenate(frames), np.concatenate(coverage), np.concatenate(poses)


@pytest.mark.sim
def test_geometric_coverage_agrees_with_the_simulator(pusht_frames):
    from cosmos3_gym.tasks.pusht.reward import fit_tee

    frames, coverage, poses = pusht_frames
    assert coverage.max() > 0.9 and coverage.min() < 0.3  # the set spans the range
    fit = fit_tee(frames)
    estimate = fit.coverage.numpy()
    assert np.corrcoef(estimate, coverage)[0, 1] > 0.99
    assert np.abs(estimate - coverage).mean() < 0.02
    position_error = np.hypot(*(fit.pose.numpy()[:, :2] - poses[:, :2]).T)
    assert np.median(position_error) < 2.0  # table px (a 96 x 96 pixel is 5.3 px)
    assert fit.rigidity.min() > 0.85  # real blocks are rigid Ts


@pytest.mark.sim
def test_deformed_blocks_are_flagged_and_pay_nothing(pusht_frames):
    from cosmos3_gym.rewards import resolve_reward_model
    from cosmos3_gym.tasks.pusht.reward import fit_tee, rigidity

    frames, coverage, poses = pusht_frames
    chosen = np.argsort(-coverage)[:4]  # blocks on or near the target: a deformed one could fake coverage
    for deform in (_bent, _melted, _split):
        deformed = np.stack([deform(frames[i], poses[i]) for i in chosen])
        assert rigidity(deformed).max() < 0.75, deform.__name__
    reward = resolve_reward_model("pusht_geometric?min_iou=0.8")
    melted = np.stack([_melted(frames[i], poses[i]) for i in chosen])
    as_chunks = torch.from_numpy(np.stack([frames[chosen], melted])).permute(0, 1, 4, 2, 3).float() / 255.0
    scores = reward(as_chunks.reshape(2 * 4, 1, 3, 96, 96), ["t"] * 8)
    np.testing.assert_allclose(scores[:4].numpy(), fit_tee(frames[chosen]).coverage.numpy(), atol=1e-6)
    assert (scores[4:] == 0).all()


def test_geometric_reward_options_and_empty_frames():
    from cosmos3_gym.rewards import available_reward_models, resolve_reward_model
    from cosmos3_gym.tasks.pusht.reward import PushTGeometricReward

    assert "pusht_geometric" in available_reward_models()
    model = resolve_reward_model("pusht_geometric?reduce=max&min_iou=0.5")
    assert isinstance(model, PushTGeometricReward) and model.reduce == "max" and model.min_iou == 0.5
    assert torch.equal(model(torch.ones(2, 3, 3, 32, 32), ["a", "b"]), torch.zeros(2))  # no block: 0
    with pytest.raises(InputError, match="unknown option"):
        resolve_reward_model("pusht_geometric?iou=1")
    with pytest.raises(InputError, match="reduce"):
        PushTGeometricReward(reduce="mean")
