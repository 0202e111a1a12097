"""Our batch-first Cosmos3 transformer against diffusers' ``Cosmos3OmniTransformer`` on the same weights."""

import pytest
import torch
from reference import random_reference_transformer, reference_velocities

from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig, TextKV, build_on_meta
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG

MODES = {
    # mode: (clean latent frames given t, clean action rows given chunk)
    "policy": (lambda t: [0], lambda chunk: []),
    "forward_dynamics": (lambda t: [0], lambda chunk: list(range(chunk))),
    "inverse_dynamics": (lambda t: list(range(t)), lambda chunk: []),
}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def ours_from(reference) -> Cosmos3Transformer:
    model = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict(dict(reference.config)))
    model.load_diffusers_state_dict(reference.state_dict())
    return model.eval()


def run_ours(model, prompts, latents, actions, modes, timesteps, domains, fps):
    t, chunk = latents.shape[2], actions.shape[1]
    video_noisy = torch.ones(len(prompts), t, dtype=torch.bool)
    action_noisy = torch.ones(len(prompts), chunk, dtype=torch.bool)
    for b, mode in enumerate(modes):
        clean_frames, clean_rows = MODES[mode]
        video_noisy[b, clean_frames(t)] = False
        action_noisy[b, clean_rows(chunk)] = False
    text = TextKV.stack([model.encode_text([p]) for p in prompts])
    layout = model.gen_layout(text.lengths, tuple(latents.shape[2:]), chunk, fps)
    return model(
        text, layout, latents, video_noisy, torch.tensor(timesteps), actions, action_noisy, torch.tensor(domains)
    )


@pytest.fixture(scope="module")
def models():
    reference = random_reference_transformer(seed=0)
    return reference, ours_from(reference)


@pytest.mark.parametrize(
    "latent_thw, chunk, fps",
    [
        ((3, 4, 6), 8, 15.0),  # fps-modulated positions (t > 1)
        ((1, 5, 3), 3, 24.0),  # t == 1: integer positions; odd h and w exercise patch padding
        ((2, 3, 4), 1, 10.0),  # one action step: integer action positions
    ],
)
def test_batch_matches_reference_per_sample(models, latent_thw, chunk, fps):
    reference, ours = models
    g = torch.Generator().manual_seed(1)
    modes = ["policy", "forward_dynamics", "inverse_dynamics"]
    prompts = [list(torch.randint(0, 300, (n,), generator=g).tolist()) for n in (7, 12, 4)]  # different lengths
    latents = torch.randn(3, 8, *latent_thw, generator=g)
    actions = torch.randn(3, chunk, 64, generator=g)
    timesteps, domains = [937, 500, 12], [8, 4, 31]

    with torch.no_grad():
        video_v, action_v = run_ours(ours, prompts, latents, actions, modes, timesteps, domains, fps)
        for b, mode in enumerate(modes):
            clean_frames, clean_rows = MODES[mode]
            ref_v, ref_a = reference_velocities(
                reference,
                prompts[b],
                latents[b : b + 1],
                actions[b],
                clean_frames(latent_thw[0]),
                clean_rows(chunk),
                timesteps[b],
                domains[b],
                fps,
            )
            if mode != "inverse_dynamics" or latent_thw[0] > 0:
                if ref_v.abs().sum() > 0:
                    assert relative_error(video_v[b : b + 1], ref_v) < 1e-4, mode
                else:  # every frame clean: both must be exactly zero
                    assert video_v[b].abs().sum() == 0
            if mode == "forward_dynamics":
                assert action_v[b].abs().sum() == 0 and ref_a.abs().sum() == 0
            else:
                assert relative_error(action_v[b], ref_a) < 1e-4, mode


def test_wrong_rope_section_is_detected(models):
    """Guard against a test that cannot fail: a model with another mRoPE split must disagree with the reference."""
    reference, _ = models
    cfg = dict(reference.config)
    cfg["rope_axes_dim"] = [2, 3, 3]
    wrong = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict(cfg))
    wrong.load_diffusers_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 300, (9,), generator=g).tolist()
    latents, actions = torch.randn(1, 8, 2, 4, 4, generator=g), torch.randn(1, 4, 64, generator=g)
    with torch.no_grad():
        v, a = run_ours(wrong, [prompt], latents, actions, ["policy"], [700], [8], 15.0)
        ref_v, ref_a = reference_velocities(reference, prompt, latents, actions[0], [0], [], 700, 8, 15.0)
    assert relative_error(v, ref_v) > 1e-2


def test_text_cache_reuse_equals_fresh_batch(models):
    """Per-prompt caches stacked later give the same velocities as encoding the batch of prompts together."""
    _, ours = models
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 11)]
    latents, actions = torch.randn(2, 8, 2, 4, 4, generator=g), torch.randn(2, 4, 64, generator=g)
    noisy_v, noisy_a = torch.ones(2, 2, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool)
    with torch.no_grad():
        together = ours.encode_text(prompts)
        separate = TextKV.stack([ours.encode_text([p]) for p in prompts])
        outs = []
        for text in (together, separate):
            layout = ours.gen_layout(text.lengths, (2, 4, 4), 4, 15.0)
            outs.append(ours(text, layout, latents, noisy_v, torch.tensor([900, 900]), actions, noisy_a,
                             torch.tensor([8, 8])))
    assert relative_error(outs[0][0], outs[1][0]) < 1e-5
    assert relative_error(outs[0][1], outs[1][1]) < 1e-5


def test_relu2_checkpoint_matches_reference():
    reference = random_reference_transformer(seed=4, hidden_act="relu2")
    ours = ours_from(reference)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 300, (6,), generator=g).tolist()
    latents, actions = torch.randn(1, 8, 2, 2, 4, generator=g), torch.randn(1, 4, 64, generator=g)
    with torch.no_grad():
        v, a = run_ours(ours, [prompt], latents, actions, ["policy"], [400], [3], 15.0)
        ref_v, ref_a = reference_velocities(reference, prompt, latents, actions[0], [0], [], 400, 3, 15.0)
    assert relative_error(v, ref_v) < 1e-4
    assert relative_error(a[0], ref_a) < 1e-4


def test_bf16_matches_reference_in_bf16(models):
    """In bf16 both implementations round the same way. (The bf16-vs-fp32 gap of this tiny high-frequency config is
    ~10% for diffusers itself, so that bound is checked on the full Nano config in the GPU smoke benchmark.)"""
    reference, _ = models
    reference_bf16 = random_reference_transformer(seed=0).to(torch.bfloat16)
    reference_bf16.time_embedder.float()  # diffusers keeps it in fp32 (_keep_in_fp32_modules)
    ours = ours_from(reference).to(torch.bfloat16)
    ours.time_embedder.float()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 300, (8,), generator=g).tolist()
    latents, actions = torch.randn(1, 8, 2, 4, 4, generator=g), torch.randn(1, 4, 64, generator=g)
    with torch.no_grad():
        v, a = run_ours(ours, [prompt], latents, actions, ["policy"], [800], [8], 15.0)
        ref_v, ref_a = reference_velocities(
            reference_bf16, prompt, latents.bfloat16(), actions[0].bfloat16(), [0], [], 800, 8, 15.0
        )
    assert relative_error(v, ref_v) < 2e-3
    assert relative_error(a[0], ref_a) < 2e-3


def test_gradients_flow_to_both_towers(models):
    _, ours = models
    g = torch.Generator().manual_seed(6)
    text = ours.encode_text([torch.randint(0, 300, (5,), generator=g).tolist()])
    layout = ours.gen_layout(text.lengths, (2, 2, 2), 4, 15.0)
    v, a = ours(text, layout, torch.randn(1, 8, 2, 2, 2, generator=g), torch.tensor([[False, True]]),
                torch.tensor([500]), torch.randn(1, 4, 64, generator=g), torch.ones(1, 4, dtype=torch.bool),
                torch.tensor([8]))
    (v.square().mean() + a.square().mean()).backward()
    assert ours.text_layers[0].attn.qkv.weight.grad.abs().sum() > 0
    assert ours.gen_layers[-1].mlp.down.weight.grad.abs().sum() > 0
    assert ours.action_proj_in.fc.weight.grad.abs().sum() > 0
    ours.zero_grad(set_to_none=True)


def test_build_on_meta_builds_without_memory_in_the_dtype_and_restores_the_default():
    config = Cosmos3TransformerConfig.from_dict(TINY_TRANSFORMER_CONFIG)
    model = build_on_meta(Cosmos3Transformer, config, dtype=torch.bfloat16)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(ZeroDivisionError):
        build_on_meta(lambda: 1 / 0, dtype=torch.float16)
    assert torch.get_default_dtype() == torch.float32  # restored when the build fails too
