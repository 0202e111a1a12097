"""Block expansion (``training.growth.grow_depth``): the grown transformer computes exactly what the checkpoint did,
and its new blocks are real parameters that training moves."""

import pytest
import torch
from reference import random_reference_transformer
from test_transformer import ours_from, run_ours

from cosmos3_gym.errors import InputError
from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG
from cosmos3_gym.training.growth import grow_depth, grow_width, layer_sources


def randomized_model() -> Cosmos3Transformer:
    # diffusers' init zeroes the output projections; random ones make "unchanged output" a real check.
    model = ours_from(random_reference_transformer(seed=0))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05 + parameter)
    return model


def inputs(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(3, model.config.latent_channel, 3, 4, 4, generator=g)
    actions = torch.randn(3, 4, model.config.action_dim, generator=g)
    return ([[1, 5, 7, 2], [3], [4, 4, 9]], latents, actions, ["policy", "forward_dynamics", "inverse_dynamics"],
            [900, 500, 100], [0, 1, 0], 10.0)


def test_layer_sources_spread_copies_evenly():
    assert layer_sources(2, 5) == [(0, True), (0, False), (1, True), (1, False), (1, False)]
    assert layer_sources(3, 3) == [(0, True), (1, True), (2, True)]
    assert [old for old, _ in layer_sources(4, 8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_grown_model_computes_the_same_outputs():
    model = randomized_model().eval()
    old_layers = model.config.num_hidden_layers
    grown = grow_depth(model, old_layers * 2 + 1).eval()
    assert grown.config.num_hidden_layers == old_layers * 2 + 1 == len(grown.gen_layers) == len(grown.text_layers)
    with torch.no_grad():
        video, action = run_ours(model, *inputs(model))
        grown_video, grown_action = run_ours(grown, *inputs(model))
    assert video.abs().max() > 0 and action.abs().max() > 0
    torch.testing.assert_close(grown_video, video, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grown_action, action, rtol=1e-5, atol=1e-6)
    # The new blocks are trainable copies, not aliases of the old ones.
    assert grown.gen_layers[1].mlp.gate_up.weight.data_ptr() != model.gen_layers[0].mlp.gate_up.weight.data_ptr()
    assert grown.gen_layers[1].mlp.down.weight.abs().max() == 0
    torch.testing.assert_close(grown.gen_layers[1].mlp.gate_up.weight, model.gen_layers[0].mlp.gate_up.weight)


def test_moving_a_new_block_changes_the_output():
    model = randomized_model().eval()
    grown = grow_depth(model, model.config.num_hidden_layers + 1).eval()
    with torch.no_grad():
        before, _ = run_ours(grown, *inputs(model))
        grown.gen_layers[-1].mlp.down.weight.normal_(0, 0.1)
        after, _ = run_ours(grown, *inputs(model))
    assert (after - before).abs().max() > 1e-3


def test_shrinking_is_refused():
    model = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict(dict(TINY_TRANSFORMER_CONFIG)))
    with pytest.raises(InputError, match="grow_depth"):
        grow_depth(model, model.config.num_hidden_layers - 1)
    assert grow_depth(model, model.config.num_hidden_layers) is model


# ------------------------------------------------------------------ width


def randomized(config: dict) -> Cosmos3Transformer:
    model = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict(config))
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1 + parameter)
    return model.eval()


@pytest.mark.parametrize("variant", [{}, {"hidden_act": "relu2", "attention_bias": True}])
def test_widened_model_computes_the_same_outputs(variant):
    """SwiGLU and squared-ReLU MLPs, with and without attention biases; the grown shapes are the config's."""
    model = randomized({**TINY_TRANSFORMER_CONFIG, **variant}) if variant else randomized_model().eval()
    c = model.config
    group = c.num_attention_heads // c.num_key_value_heads
    grown = grow_width(model, intermediate_size=c.intermediate_size * 2, num_attention_heads=c.num_attention_heads * 2)
    g = grown.config
    assert (g.intermediate_size, g.num_attention_heads, g.num_key_value_heads) == (
        c.intermediate_size * 2, c.num_attention_heads * 2, c.num_attention_heads * 2 // group)
    assert g.hidden_size == c.hidden_size and g.head_dim == c.head_dim
    assert grown.gen_layers[0].attn.qkv.weight.shape[0] == (
        g.num_attention_heads + 2 * g.num_key_value_heads) * g.head_dim
    with torch.no_grad():
        video, action = run_ours(model, *inputs(model))
        grown_video, grown_action = run_ours(grown.eval(), *inputs(model))
    assert video.abs().max() > 0 and action.abs().max() > 0
    # Longer GEMM reductions (zero terms added) round differently, by ~1e-6; a wrong head or unit mapping is ~1e-1.
    torch.testing.assert_close(grown_video, video, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grown_action, action, rtol=1e-4, atol=1e-5)
    # The new rows are drawn, not copies or zeros; only the new columns of the output projections are zero.
    new_q = grown.gen_layers[0].attn.qkv.weight[c.num_attention_heads * c.head_dim : g.num_attention_heads * c.head_dim]
    assert new_q.abs().max() > 0
    assert grown.gen_layers[0].mlp.down.weight[:, c.intermediate_size :].abs().max() == 0
    assert grown.gen_layers[0].attn.out.weight[:, c.num_attention_heads * c.head_dim :].abs().max() == 0


def test_the_new_columns_learn_from_the_first_step():
    model = randomized_model().eval()
    c = model.config
    grown = grow_width(model, intermediate_size=c.intermediate_size + 16, num_attention_heads=c.num_attention_heads * 2)
    video, action = run_ours(grown, *inputs(model))
    (video.square().mean() + action.square().mean()).backward()
    for layer in (grown.text_layers[0], grown.gen_layers[-1]):
        assert layer.mlp.down.weight.grad[:, c.intermediate_size :].abs().max() > 0
        assert layer.attn.out.weight.grad[:, c.num_attention_heads * c.head_dim :].abs().max() > 0


def test_width_and_depth_compose_and_bad_widths_are_refused():
    model = randomized_model().eval()
    c = model.config
    both = grow_width(grow_depth(model, c.num_hidden_layers + 1), intermediate_size=c.intermediate_size * 3)
    with torch.no_grad():
        torch.testing.assert_close(run_ours(both.eval(), *inputs(model))[0], run_ours(model, *inputs(model))[0],
                                   rtol=1e-4, atol=1e-5)
    assert grow_width(model) is model
    with pytest.raises(InputError, match="grow_width: intermediate_size: expected an integer >= "):
        grow_width(model, intermediate_size=c.intermediate_size - 1)
    group = c.num_attention_heads // c.num_key_value_heads
    if group > 1:
        with pytest.raises(InputError, match=f"num_attention_heads: expected a multiple of {group}"):
            grow_width(model, num_attention_heads=c.num_attention_heads + 1)
    with pytest.raises(InputError, match="grow_width: num_attention_heads"):
        grow_width(model, num_attention_heads=True)


def test_a_fine_tune_widens_its_init_checkpoint_and_exports_the_wider_model(tmp_path, tiny_checkpoint):
    from test_training import make_dataset, world_model_config

    from cosmos3_gym.engine import Cosmos3Engine
    from cosmos3_gym.training import train_world_model
    from cosmos3_gym.training.world_model import WorldModelTrainConfig

    old = Cosmos3Transformer.from_pretrained(tiny_checkpoint / "transformer").config
    width = {"intermediate_size": old.intermediate_size * 2, "num_attention_heads": old.num_attention_heads * 2}
    dataset = make_dataset(tmp_path / "dataset", num_episodes=2, steps=8)
    config = world_model_config(tmp_path, model={}, init_checkpoint=str(tiny_checkpoint), grow_width=width, steps=1)
    out = train_world_model(dataset, tmp_path / "wide", config, tiny_checkpoint / "vae")
    engine = Cosmos3Engine.from_pretrained(out, device="cpu", dtype="fp32", progress=False)
    try:
        grown = engine.transformer.config
        assert (grown.intermediate_size, grown.num_attention_heads, grown.num_key_value_heads) == (
            width["intermediate_size"], width["num_attention_heads"], old.num_key_value_heads * 2)
    finally:
        engine.close()
    with pytest.raises(InputError, match="grow_width: expected None, or a dict"):
        WorldModelTrainConfig(grow_width={"hidden_size": 128}, init_checkpoint=str(tiny_checkpoint)).validate()
    with pytest.raises(InputError, match="grow_width: expected None, or a dict"):
        WorldModelTrainConfig(grow_width={"intermediate_size": 128}).validate()
