"""End-to-end parity: ``Cosmos3Engine`` against diffusers' ``Cosmos3OmniPipeline`` on the same tiny checkpoint.

Both run in fp32 on CPU with the same inputs and seed. Differences come only from summation order (batched GEMMs,
our fused QKV) and the sampler port (< 1e-5), so 1e-4 relative is tight: a wrong mask, RoPE section, CFG formula
or noise order changes the outputs by O(1) (checked below by perturbing each).
"""

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
from PIL import Image
from reference import relative_error

from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import InputError

TIER, FPS, STEPS = 256, 15.0, 3


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_checkpoint, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


def image(seed: int, size=(200, 280)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def run_pipeline(pipe, mode, chunk, seed, guidance, obs, actions=None, output_type="latent", task="push the block"):
    condition = CosmosActionCondition(
        mode=mode, chunk_size=chunk, domain_name="pusht", resolution_tier=TIER,
        raw_actions=torch.as_tensor(actions) if actions is not None else None,
        image=obs if not isinstance(obs, list) else None, video=obs if isinstance(obs, list) else None,
    )
    return pipe(
        prompt=task, action=condition, num_inference_steps=STEPS, guidance_scale=guidance, fps=FPS,
        generator=torch.Generator().manual_seed(seed), output_type=output_type, enable_safety_check=False,
    )


def request(mode, chunk, seed, guidance, obs, actions=None, task="push the block", **kw):
    return Cosmos3Request(
        mode=mode, observation=obs, task=task, action=actions, domain="pusht", chunk=chunk, num_inference_steps=STEPS,
        guidance_scale=guidance, fps=FPS, seed=seed, resolution_tier=TIER, **kw,
    )


CASES = [
    # mode, chunk, guidance
    ("policy", 4, 2.5),
    ("policy", 8, 1.0),  # no CFG: the unconditional pass is skipped by both
    ("forward_dynamics", 8, 3.0),
    ("inverse_dynamics", 4, 2.0),
]


@pytest.mark.parametrize("mode, chunk, guidance", CASES)
def test_engine_matches_pipeline(pipeline, engine, mode, chunk, guidance):
    seed = 11
    actions = np.random.default_rng(0).uniform(-1, 1, (chunk - 2, 2)).astype(np.float32)  # short: last row repeats
    obs = [image(s) for s in range(chunk + 1)] if mode == "inverse_dynamics" else image(1)
    ref = run_pipeline(pipeline, mode, chunk, seed, guidance, obs, actions if mode == "forward_dynamics" else None)
    ours = engine.step(request(mode, chunk, seed, guidance, obs, actions if mode == "forward_dynamics" else None),
                       decode=False)

    assert ours.video_latents.shape == ref.video.shape[1:]
    assert relative_error(ours.video_latents, ref.video[0]) < 1e-4
    if mode != "forward_dynamics":
        assert ours.action.shape == (chunk, 2)
        assert relative_error(ours.action, ref.action[0]) < 1e-4
    else:  # the conditioning actions come back as given (trimmed / last row repeated)
        assert np.allclose(ours.action[: chunk - 2], actions) and np.allclose(ours.action[-1], actions[-1])


def test_decoded_video_matches_pipeline(pipeline, engine):
    ref = run_pipeline(pipeline, "policy", 4, 3, 2.0, image(2), output_type="np")
    ours = engine.step(request("policy", 4, 3, 2.0, image(2)), decode=True)
    frames = ours.pixels.permute(1, 2, 3, 0).numpy()  # [T, H, W, 3] like output_type="np"
    assert frames.shape == ref.video.shape
    assert np.abs(frames - ref.video).max() < 1e-4


def test_optimized_engine_matches_the_pipeline(pipeline, tiny_checkpoint):
    """``optimize=True`` (compiled transformer blocks, fused VAE norms) keeps the pipeline's numbers, decode
    included."""
    optimized = Cosmos3Engine.from_pretrained(tiny_checkpoint, progress=False, optimize=True)
    ref = run_pipeline(pipeline, "policy", 4, 3, 2.0, image(2), output_type="np")
    ours = optimized.step(request("policy", 4, 3, 2.0, image(2)), decode=True)
    assert np.abs(ours.pixels.permute(1, 2, 3, 0).numpy() - ref.video).max() < 1e-4
    latents = run_pipeline(pipeline, "policy", 4, 3, 2.0, image(2))
    assert relative_error(ours.action, latents.action[0]) < 1e-4


def test_batched_step_equals_single_requests(engine):
    """Mixed modes, prompts and guidance in one batched pass give each request's solo result."""
    acts = np.random.default_rng(1).uniform(-1, 1, (4, 2)).astype(np.float32)
    batch = [
        request("policy", 4, 1, 2.0, image(3), task="push the T"),
        request("forward_dynamics", 4, 2, 3.0, image(4), acts, task="a much longer task description for padding"),
        request("inverse_dynamics", 4, 3, 1.0, [image(s) for s in range(5)]),
        request("policy", 8, 4, 2.0, image(5)),  # another latent shape: its own group
    ]
    together = engine.step(batch, decode=False)
    for req, res in zip(batch, together):
        solo = engine.step(req, decode=False)
        assert relative_error(res.video_latents, solo.video_latents) < 1e-5
        assert relative_error(res.action, solo.action) < 1e-5


def test_same_seed_same_output_different_seed_different(engine):
    a = engine.step(request("policy", 4, 5, 2.0, image(6)), decode=False)
    b = engine.step(request("policy", 4, 5, 2.0, image(6)), decode=False)
    c = engine.step(request("policy", 4, 6, 2.0, image(6)), decode=False)
    assert np.array_equal(a.action, b.action) and torch.equal(a.video_latents, b.video_latents)
    assert relative_error(a.action, c.action) > 1e-2


def test_parity_checks_would_catch_wrong_cfg_and_noise(pipeline, engine, monkeypatch):
    """The tolerance above is meaningful: a wrong CFG formula or noise order moves outputs far beyond it."""
    ref = run_pipeline(pipeline, "policy", 4, 9, 2.5, image(7))
    import cosmos3_gym.engine as engine_module

    monkeypatch.setattr(engine_module, "cfg_combine", lambda c, u, g: c + g[:, None, None] * (c - u)
                        if c.ndim == 3 else c + g.view(-1, *[1] * (c.ndim - 1)) * (c - u))
    wrong_cfg = engine.step(request("policy", 4, 9, 2.5, image(7)), decode=False)
    monkeypatch.undo()
    assert relative_error(wrong_cfg.action, ref.action[0]) > 1e-2

    original = Cosmos3Engine.initial_noise
    def reversed_draws(self, p):  # the action noise drawn before the video noise, from the same seed
        video, action, context = original(self, p)
        generator = torch.Generator().manual_seed(p.seed)
        wrong_action = torch.randn(action.shape, generator=generator)
        return torch.randn(video.shape, generator=generator), wrong_action, context

    monkeypatch.setattr(Cosmos3Engine, "initial_noise", reversed_draws)
    wrong_noise = engine.step(request("policy", 4, 9, 2.5, image(7)), decode=False)
    assert relative_error(wrong_noise.action, ref.action[0]) > 1e-2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mode="dream"), "mode"),
        (dict(domain="no_such_robot"), "domain"),
        (dict(domain=4), "raw_action_dim"),
        (dict(raw_action_dim=65), "raw_action_dim"),
        (dict(mode="forward_dynamics"), "action"),
        (dict(mode="forward_dynamics", action=np.full((4, 2), np.nan)), "action"),
        (dict(mode="forward_dynamics", action=np.zeros((4, 3))), "action"),
        (dict(num_inference_steps=0), "num_inference_steps"),
        (dict(chunk=0), "chunk"),
        (dict(cond_frame_indexes=[0, 5]), "cond_frame_indexes"),
        (dict(observation="/nonexistent/image.png"), "observation"),
        (dict(resolution_tier=333), "resolution_tier"),
    ],
)
def test_bad_requests_name_the_field(engine, kwargs, field):
    base = dict(mode="policy", observation=image(0), domain="pusht", chunk=4, num_inference_steps=2, seed=0,
                resolution_tier=TIER)
    with pytest.raises(InputError, match=field):
        engine.step(Cosmos3Request(**{**base, **kwargs}), decode=False)
