"""Context noise with its level as the context's timestep (issue 42 item 4): training noises each policy /
forward-dynamics sample's context frames to a level drawn from U(0, context_noise_max) and gives their tokens that
level's timestep embedding; inference (``Cosmos3Request.context_noise``, the env's ``context_noise`` setting, a
checkpoint's meta.json) can do the same at a small level. At level 0 everything is exactly as without it."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from test_training import FPS, _windows, make_dataset, world_model_config

from cosmos3_gym.checkpoint import checkpoint_defaults
from cosmos3_gym.engine import MODES, Cosmos3Engine, Cosmos3Request
from cosmos3_gym.envs import WorldModelEnv, WorldModelSettings
from cosmos3_gym.errors import InputError
from cosmos3_gym.training import train_world_model
from cosmos3_gym.training.flow_matching import FlowMatchingObjective
from cosmos3_gym.training.world_model import sample_batch

TIER = 256
REQUEST = dict(task="push the T", domain="pusht", num_inference_steps=2, resolution_tier=TIER, chunk=4)
INVERSE = MODES.index("inverse_dynamics")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


def image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)


def forward(seed: int = 3, **fields) -> Cosmos3Request:
    actions = np.random.default_rng(1).uniform(-1, 1, (4, 2)).astype(np.float32)
    return Cosmos3Request(mode="forward_dynamics", observation=image(0), action=actions, seed=seed, **REQUEST, **fields)


def gen_inputs(engine, batch: int = 2, latent_t: int = 3):
    """A forward-dynamics GEN batch: frame 0 clean, the rest noisy at timestep 700."""
    transformer = engine.transformer
    g = torch.Generator().manual_seed(0)
    c, h, w = transformer.config.latent_channel, 4, 6
    text = transformer.encode_text([[1, 2, 3, 4]] * batch)
    layout = transformer.gen_layout(text.lengths, (latent_t, h, w), 4, [FPS] * batch)
    video = torch.randn(batch, c, latent_t, h, w, generator=g)
    actions = torch.zeros(batch, 4, engine.action_dim)
    actions[..., :2] = torch.randn(batch, 4, 2, generator=g)
    video_noisy = (torch.arange(latent_t) >= 1)[None].expand(batch, -1)
    action_noisy = torch.zeros(batch, 4, dtype=torch.bool)
    timesteps = torch.full((batch,), 700)
    domain_ids = torch.full((batch,), 4)
    return text, layout, video, video_noisy, timesteps, actions, action_noisy, domain_ids


# ---------------------------------------------------------------------------------------------- the transformer


def test_context_timesteps_of_zero_change_nothing(engine):
    inputs = gen_inputs(engine)
    with torch.no_grad():
        plain = engine.transformer(*inputs)
        zero = engine.transformer(*inputs, context_timesteps=torch.zeros(2, dtype=torch.long))
    assert torch.equal(plain[0], zero[0]) and torch.equal(plain[1], zero[1])


def test_a_context_timestep_embeds_the_context_as_a_noisy_frame_at_that_level(engine):
    """A clean frame given context timestep t gets exactly the tokens a noisy frame at timestep t gets: marking frame
    0 noisy at the batch's timestep gives the same velocities on the generated frames. A row at 0 keeps its clean
    context (equal to the plain pass), and a context level does change what the model predicts."""
    text, layout, video, video_noisy, timesteps, actions, action_noisy, domain_ids = gen_inputs(engine)
    with torch.no_grad():
        plain, _ = engine.transformer(text, layout, video, video_noisy, timesteps, actions, action_noisy, domain_ids)
        labelled, _ = engine.transformer(text, layout, video, video_noisy, timesteps, actions, action_noisy,
                                         domain_ids, context_timesteps=torch.tensor([0, 700]))
        all_noisy = torch.ones_like(video_noisy)
        as_noisy, _ = engine.transformer(text, layout, video, all_noisy, timesteps, actions, action_noisy, domain_ids)
    torch.testing.assert_close(labelled[1, :, 1:], as_noisy[1, :, 1:], rtol=1e-6, atol=1e-6)
    assert torch.equal(labelled[0], plain[0])
    assert (labelled[1, :, 1:] - plain[1, :, 1:]).abs().max() > 1e-3
    assert torch.equal(labelled[:, :, 0], torch.zeros_like(labelled[:, :, 0]))  # the context still gets no velocity


# ---------------------------------------------------------------------------------------------------- the engine


class ForwardSpy:
    """Records the inputs of every GEN forward of an engine."""

    def __init__(self, engine, monkeypatch):
        self.calls: list[dict] = []
        forward = type(engine.transformer).forward

        def spy(*args, **kwargs):
            bound = inspect.signature(forward).bind(*args, **kwargs).arguments
            context_timesteps = bound.get("context_timesteps")
            self.calls.append(dict(video=bound["video"].clone(), context_timesteps=None
                                   if context_timesteps is None else context_timesteps.clone()))
            return forward(*args, **kwargs)

        monkeypatch.setattr(type(engine.transformer), "forward", spy)


def test_the_engine_noises_the_context_from_the_requests_seed(engine, monkeypatch):
    """The context the model sees is (1 - s) * x0 + s * noise, the noise the request's generator draws after the
    pipeline's video and action noise, and every row (conditional and unconditional) gets timestep int(1000 s); the
    result's context frame stays the clean x0, and the pipeline's own noise is unchanged."""
    level, seed = 0.2, 11
    spy = ForwardSpy(engine, monkeypatch)
    result = engine.step(forward(seed=seed, context_noise=level))
    x0 = Cosmos3Engine.encode_frames(engine, image(0)[None], resolution_tier=TIER)[0]  # [C, 1, h, w]
    generator = torch.Generator().manual_seed(seed)
    c, t, h, w = result.video_latents.shape
    video_noise = torch.randn((1, c, t, h, w), generator=generator)
    torch.randn((4, engine.action_dim), generator=generator)
    context_noise = torch.randn((1, c, t, h, w), generator=generator)
    expected = (1 - level) * x0[:, 0] + level * context_noise[0, :, 0]
    first = spy.calls[0]
    assert len(first["video"]) == 2  # guidance 3: the conditional and the unconditional row
    for row in first["video"]:
        torch.testing.assert_close(row[:, 0], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row[:, 1:], video_noise[0, :, 1:], rtol=0, atol=0)
    assert all(call["context_timesteps"].tolist() == [200, 200] for call in spy.calls)
    torch.testing.assert_close(result.video_latents[:, 0], x0[:, 0], rtol=1e-5, atol=1e-5)


def test_context_noise_is_seeded_and_leaves_clean_rows_of_a_batch_exact(engine):
    clean = engine.step(forward(seed=5))
    noised = engine.step(forward(seed=6, context_noise=0.3))
    again = engine.step(forward(seed=6, context_noise=0.3))
    batch = engine.step([forward(seed=5), forward(seed=6, context_noise=0.3)])
    assert torch.equal(noised.video_latents, again.video_latents)
    torch.testing.assert_close(batch[0].video_latents, clean.video_latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch[1].video_latents, noised.video_latents, rtol=1e-5, atol=1e-5)
    other_level = engine.step(forward(seed=6, context_noise=0.05))
    assert (other_level.video_latents[:, 1:] - noised.video_latents[:, 1:]).abs().max() > 1e-4


@pytest.mark.parametrize("value", [1.0, -0.1, float("nan"), "0.1", True])
def test_bad_context_noise_names_the_field(engine, value):
    with pytest.raises(InputError, match="context_noise: expected a noise level in"):
        engine.step(forward(context_noise=value))


def test_inverse_dynamics_has_no_context_to_noise(engine):
    video = np.stack([image(i) for i in range(5)])
    with pytest.raises(InputError, match="context_noise: only modes"):
        engine.step(Cosmos3Request(mode="inverse_dynamics", observation=video, context_noise=0.1, **REQUEST))


# ---------------------------------------------------------------------------------------------- the env settings


@pytest.mark.parametrize("value", [1.0, -0.5, float("inf"), "x"])
def test_env_setting_names_the_field(value):
    with pytest.raises(InputError, match="context_noise"):
        WorldModelSettings(domain="pusht", context_noise=value)


def test_env_sends_its_level_and_agents_do_not(engine, monkeypatch):
    env = WorldModelEnv(engine=engine, domain="pusht", chunk=4, num_steps=1, resolution_tier=TIER,
                        initial_states=image(0), context_noise=0.15)
    requests: list[Cosmos3Request] = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda batch, **kwargs: requests.extend(batch) or step(batch, **kwargs))
    env.reset(seed=0)
    env.step(env.action_space.sample())
    assert [r.context_noise for r in requests] == [0.15]
    assert "context_noise" not in env.settings.request_fields()  # agents condition on real observations
    env.close()


# ---------------------------------------------------------------------------------------------------- training


def test_training_noises_each_samples_context_to_its_level(tmp_path):
    """Against the same draws without it: the context frames of policy and forward-dynamics samples become
    (1 - s) * x0 + s * n with s ~ U(0, max) and n drawn after everything else; inverse-dynamics samples and every
    other frame stay as they were."""
    windows = _windows([True, True])
    windows.latents = torch.randn(2, 16, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    kwargs = dict(domain_id=4, raw_action_dim=2, action_dim=32, fps=FPS)
    generator = torch.Generator().manual_seed(1)
    plain = sample_batch(windows, generator, world_model_config(tmp_path, batch_size=16), **kwargs)
    config = world_model_config(tmp_path, batch_size=16, context_noise_max=0.5)
    noisy = sample_batch(windows, torch.Generator().manual_seed(1), config, **kwargs)
    assert plain.context_sigmas is None
    levels = torch.rand(16, generator=generator) * 0.5
    inverse = noisy.modes == INVERSE
    assert inverse.any() and (~inverse).any()
    assert torch.equal(noisy.context_sigmas, torch.where(inverse, 0.0, levels))
    n = torch.randn(plain.video[:, :, :1].shape, generator=generator)
    s = noisy.context_sigmas.view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(noisy.video[:, :, :1], (1 - s) * plain.video[:, :, :1] + s * n, rtol=0, atol=1e-6)
    assert torch.equal(noisy.video[inverse], plain.video[inverse])
    assert torch.equal(noisy.video[:, :, 1:], plain.video[:, :, 1:]) and torch.equal(noisy.modes, plain.modes)


def test_the_objective_gives_the_levels_as_context_timesteps(engine, monkeypatch):
    from test_latent_context import _training_batch

    seen = []
    forward = type(engine.transformer).forward

    def spy(module, *args, context_timesteps=None, **kwargs):
        seen.append(context_timesteps)
        return forward(module, *args, context_timesteps=context_timesteps, **kwargs)

    monkeypatch.setattr(type(engine.transformer), "forward", spy)
    objective = FlowMatchingObjective(engine.transformer)
    batch = _training_batch(engine, 1)
    plain = objective(batch)["loss"]
    batch.context_sigmas = torch.tensor([0.25])
    labelled = objective(batch)["loss"]
    assert seen[0] is None and seen[1].tolist() == [250]
    assert plain != labelled


@pytest.mark.parametrize("overrides, field", [
    (dict(context_noise_max=1.0), "context_noise_max"),
    (dict(context_noise_max=-0.1), "context_noise_max"),
    (dict(context_noise=0.1), "context_noise"),
    (dict(context_noise_max=0.5, context_noise=1.5), "context_noise"),
    (dict(context_noise_max=0.5, cond_noise_std=0.3), "cond_noise_std"),
    (dict(context_noise_max=0.5, rollout_prob=0.5), "rollout_prob"),
])
def test_bad_training_settings_name_the_field(tmp_path, overrides, field):
    with pytest.raises(InputError, match=f"WorldModelTrainConfig.{field}:"):
        world_model_config(tmp_path, **overrides).validate()


def test_a_checkpoint_trained_with_it_runs_its_envs_at_its_level(tmp_path, tiny_checkpoint):
    dataset = make_dataset(tmp_path / "dataset", num_episodes=1, steps=12, size=32)
    out = train_world_model(dataset, tmp_path / "trained", world_model_config(
        tmp_path, steps=2, context_noise_max=0.4, context_noise=0.1), tiny_checkpoint / "vae")
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["context_noise"], meta["context_noise_max"]) == (0.1, 0.4)
    assert checkpoint_defaults(out)["context_noise"] == 0.1
    frame = np.load(next((dataset / "episodes").glob("*.npz")))["frames"][0]
    env = WorldModelEnv(out, device="cpu", dtype="fp32", initial_states=frame, num_steps=1)
    assert env.settings.context_noise == 0.1
    env.close()
