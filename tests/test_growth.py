"""Block expansion (``training.growth.grow_depth``): the grown transformer computes exactly what the checkpoint did,
and its new blocks are real parameters that training moves."""

import pytest
import torch

from cosmos3_gym.errors import InputError
from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG
from cosmos3_gym.training.growth import grow_depth, layer_sources
from reference import random_reference_transformer
from test_transformer import ours_from, run_ours


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
