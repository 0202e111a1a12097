"""Trained weights -> a complete diffusers-layout Cosmos3 checkpoint.

``native_to_diffusers_state_dict`` inverts ``models.transformer.diffusers_to_native_state_dict`` (it splits the fused
q/k/v and gate/up GEMMs back into diffusers' separate projections). ``export_checkpoint`` writes the checkpoint with
diffusers' own ``Cosmos3OmniPipeline.save_pretrained``, exactly as ``testing.build_tiny_checkpoint`` does, so both
``Cosmos3Engine.from_pretrained`` and ``Cosmos3OmniPipeline.from_pretrained`` load it, and adds the two files the
environments read next to it: ``action_stats.json`` (the dataset's action statistics, to denormalise actions) and
``meta.json`` (domain, action width, fps, chunk, resolution tier, image size, ...).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import POLICY_SCHEDULER_CONFIG, check_no_pickle_weights, validate_checkpoint
from ..errors import InputError
from ..models.transformer import Cosmos3TransformerConfig, module_name_map
from ..storage import fault_point, replace_entries

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ACTION_STATS_FILE = "action_stats.json"
META_FILE = "meta.json"


def native_to_diffusers_state_dict(
    state_dict: Mapping[str, torch.Tensor], cfg: Cosmos3TransformerConfig
) -> dict[str, torch.Tensor]:
    """Map ``Cosmos3Transformer`` keys back to ``Cosmos3OmniTransformer``'s, un-fusing q/k/v and gate/up.

    The result holds every key ``diffusers_to_native_state_dict`` reads; the text tower's ``norm.weight`` and
    ``lm_head.weight`` (never used for velocities, so absent from the native model) are not produced. Split tensors
    are cloned: safetensors refuses tensors that share storage.
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in state_dict:
            raise InputError(f"native state dict: missing key {key!r}")
        used.add(key)
        return state_dict[key]

    def split(src: str, dsts: list[str], sizes: list[int]) -> None:
        for suffix in ("weight", "bias"):
            if f"{src}.{suffix}" in state_dict:
                for dst, part in zip(dsts, take(f"{src}.{suffix}").split(sizes)):
                    out[f"{dst}.{suffix}"] = part.clone()

    def copy(dst: str, src: str) -> None:
        for suffix in ("weight", "bias"):
            if f"{src}.{suffix}" in state_dict:
                out[f"{dst}.{suffix}"] = take(f"{src}.{suffix}")

    for native, parts in module_name_map(cfg):
        if len(parts) == 1:
            copy(parts[0][0], native)
        else:
            split(native, [name for name, _ in parts], [rows for _, rows in parts])
    if cfg.action_gen:
        out["action_modality_embed"] = take("action_modality_embed")
    leftover = set(state_dict) - used
    if leftover:
        raise InputError(f"native state dict: unexpected keys {sorted(leftover)[:8]}")
    return out


def scheduler_config(flow_shift: float) -> dict[str, Any]:
    """The UniPC flow scheduler written into exported checkpoints: the native policy server's sampler (linear flow
    sigmas, order-2 bh2 UniPC) with the flow shift the model was trained with."""
    return {**POLICY_SCHEDULER_CONFIG, "flow_shift": float(flow_shift)}


def resolve_save_dtype(save_dtype: str) -> torch.dtype:
    if save_dtype not in SAVE_DTYPES:
        raise InputError(f"save_dtype: expected one of {sorted(SAVE_DTYPES)}, got {save_dtype!r}")
    return SAVE_DTYPES[save_dtype]


@torch.no_grad()
def build_diffusers_transformer(
    native_state_dict: Mapping[str, torch.Tensor], transformer_config: Mapping[str, Any], save_dtype: str = "float32"
):
    """A ``Cosmos3OmniTransformer`` holding the native weights (cast to ``save_dtype``; the time embedder stays
    float32, diffusers' ``_keep_in_fp32_modules``). The unused text ``norm`` is set to ones and ``lm_head`` to zeros.
    Built on the meta device and filled by assignment, so no random init runs (seconds even for Nano)."""
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer

    dtype = resolve_save_dtype(save_dtype)
    cfg = Cosmos3TransformerConfig.from_dict(dict(transformer_config))
    state = native_to_diffusers_state_dict(native_state_dict, cfg)
    state["norm.weight"] = torch.ones(cfg.hidden_size)
    state["lm_head.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    keep_fp32 = tuple(f"{name}." for name in Cosmos3OmniTransformer._keep_in_fp32_modules)
    state = {
        name: tensor.detach().to("cpu", torch.float32 if name.startswith(keep_fp32) else dtype).contiguous()
        for name, tensor in state.items()
    }
    with torch.device("meta"):
        transformer = Cosmos3OmniTransformer(**transformer_config)
    transformer.load_state_dict(state, strict=True, assign=True)
    # The rotary inverse frequencies are a non-persistent buffer (not in the state dict): rebuild them for real.
    rotary = transformer.rotary_emb
    transformer.rotary_emb = type(rotary)(
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rope_axes_dim=cfg.rope_axes_dim
    )
    return transformer.eval()


def export_checkpoint(
    out_dir: str | os.PathLike,
    *,
    native_state_dict: Mapping[str, torch.Tensor],
    transformer_config: Mapping[str, Any],
    vae_dir: str | os.PathLike,
    tokenizer,
    flow_shift: float,
    action_stats: str | os.PathLike | Mapping,
    meta: Mapping[str, Any],
    save_dtype: str = "float32",
    vae_save_dtype: str = "float32",
) -> Path:
    """Write a complete ``Cosmos3OmniPipeline`` checkpoint to ``out_dir`` and return its path.

    ``transformer_config`` is the diffusers ``Cosmos3OmniTransformer`` config (keyword arguments), ``vae_dir`` a
    trained ``AutoencoderKLWan`` folder (``train_vae`` output, copied with its latent statistics), ``action_stats`` the
    dataset's ``stats.json`` (path or parsed dict) written as ``action_stats.json``, ``meta`` written as ``meta.json``.
    ``save_dtype`` / ``vae_save_dtype`` are the stored weight dtypes (the engine computes in the dtype it is asked
    for whatever is stored). The checkpoint is written with ``storage.replace_entries``: staged complete (with a
    MANIFEST.json of sizes and sha256s) and fsynced before it replaces an earlier export's entries in ``out_dir``
    (``transformer/``, ``vae/``, ...; a crash in between is completed by the next export); other files there are left
    alone.
    """
    from diffusers import UniPCMultistepScheduler
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    out_dir = Path(out_dir)
    transformer = build_diffusers_transformer(native_state_dict, transformer_config, save_dtype)
    check_no_pickle_weights(vae_dir)
    vae = AutoencoderKLWan.from_pretrained(
        str(vae_dir), torch_dtype=resolve_save_dtype(vae_save_dtype), use_safetensors=True
    )
    scheduler = UniPCMultistepScheduler(**scheduler_config(flow_shift))
    pipeline = Cosmos3OmniPipeline(
        transformer=transformer, text_tokenizer=tokenizer, vae=vae, scheduler=scheduler, enable_safety_checker=False
    )
    if isinstance(action_stats, Mapping):
        stats_document = dict(action_stats)
    else:
        stats_document = json.loads(Path(action_stats).read_text())

    def fill(staging: Path) -> None:
        pipeline.save_pretrained(staging, safe_serialization=True)
        fault_point("pipeline written")
        (staging / ACTION_STATS_FILE).write_text(json.dumps(stats_document, indent=2))
        (staging / META_FILE).write_text(json.dumps(dict(meta), indent=2))
        validate_checkpoint(staging)  # complete before it replaces anything

    # The previous export's transformer/, vae/, ... stay in place until the new ones are complete and fsynced; each
    # then replaces its namesake as a whole (no stale shards of a differently sharded export survive).
    replace_entries(out_dir, fill)
    validate_checkpoint(out_dir)
    return out_dir
