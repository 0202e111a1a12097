"""Run diffusers' reference ``Cosmos3OmniTransformer`` exactly as ``Cosmos3OmniPipeline.__call__`` packs one sample.

The pipeline's own segment builders are called unbound on a stand-in ``self`` so the packing (positions, noisy
indexes, offsets) is diffusers' code, not a re-implementation of it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from diffusers import Cosmos3OmniTransformer
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

TINY_TRANSFORMER = dict(
    action_gen=True,
    action_dim=64,
    hidden_size=64,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    num_hidden_layers=2,
    latent_channel=8,
    patch_latent_dim=32,
    rope_scaling={"mrope_section": [4, 2, 2]},
    # A small theta makes every frequency slot rotate visibly on tiny grids, so position bugs show up.
    rope_theta=50.0,
    vocab_size=300,
    num_embodiment_domains=32,
)


def random_reference_transformer(seed: int = 0, **overrides) -> Cosmos3OmniTransformer:
    """A tiny diffusers transformer whose every parameter is random and non-trivial (no zeros, no ones)."""
    torch.manual_seed(seed)
    model = Cosmos3OmniTransformer(**{**TINY_TRANSFORMER, **overrides}).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def reference_velocities(
    model: Cosmos3OmniTransformer,
    input_ids: list[int],
    latents: torch.Tensor,
    actions: torch.Tensor | None,
    vision_clean_frames: list[int],
    action_clean_rows: list[int],
    timestep: int,
    domain_id: int,
    fps: float,
):
    """One sample through diffusers' transformer. latents [1, C, t, h, w]; actions [chunk, A]."""
    stand_in = SimpleNamespace(transformer=model, vae_scale_factor_temporal=4)
    device = latents.device
    text = Cosmos3OmniPipeline._prepare_text_segment(stand_in, input_ids, device=device)
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        stand_in,
        input_vision_tokens=latents,
        has_image_condition=bool(vision_clean_frames),
        mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=fps,
        curr=text["und_len"],
        device=device,
        condition_frame_indexes=vision_clean_frames,
    )
    segments = [text["text_mrope_ids"], vision["vision_mrope_ids"]]
    seq_len = text["und_len"] + vision["num_vision_tokens"]
    kwargs = {}
    if actions is not None:
        action = Cosmos3OmniPipeline._prepare_action_segment(
            stand_in,
            input_action_tokens=actions,
            condition_frame_indexes=action_clean_rows,
            mrope_offset=text["vision_start_temporal_offset"],
            action_fps=fps,
            curr=seq_len,
            device=device,
        )
        segments.append(action["action_mrope_ids"])
        seq_len += action["action_len"]
        kwargs = dict(
            action_tokens=[actions],
            action_token_shapes=action["action_token_shapes"],
            action_sequence_indexes=action["action_sequence_indexes"],
            action_mse_loss_indexes=action["action_mse_loss_indexes"],
            action_timesteps=torch.full((action["num_noisy_action_tokens"],), timestep, device=device),
            action_noisy_frame_indexes=action["action_noisy_frame_indexes"],
            action_domain_ids=[torch.tensor([domain_id], device=device)],
        )
    preds_vision, _, preds_action = model(
        input_ids=text["input_ids"],
        text_indexes=text["text_indexes"],
        position_ids=torch.cat(segments, dim=1),
        und_len=text["und_len"],
        sequence_length=seq_len,
        vision_tokens=[latents],
        vision_token_shapes=vision["vision_token_shapes"],
        vision_sequence_indexes=vision["vision_sequence_indexes"],
        vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
        vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), timestep, device=device),
        vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
        return_dict=False,
        **kwargs,
    )
    action_velocity = preds_action[0].float() if preds_action is not None else None
    return preds_vision[0].float(), action_velocity


def relative_error(a, b) -> float:
    """``|a - b| / |b|`` (Frobenius norms, float64) of two arrays or tensors: how the tests compare against a
    reference."""
    a, b = torch.as_tensor(np.asarray(a), dtype=torch.float64), torch.as_tensor(np.asarray(b), dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
