"""Test helpers: a tiny random Cosmos3 policy checkpoint (``build_tiny_checkpoint``), built with diffusers' own
classes, for tests, demos and CPU dry runs (``cosmos3-gym make-tiny-checkpoint``), and its per-version cached copy
(``cached_tiny_checkpoint``: the demo's fallback when no world model is installed, the examples' and benchmarks'
default). The envs, engine and trainers never import this module."""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cosmos3_gym.checkpoint import POLICY_SCHEDULER_CONFIG, validate_checkpoint
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.models.vae import WAN22_FIXED_CONFIG
from cosmos3_gym.tokenizer import build_tiny_tokenizer

# The Nano transformer scaled down: same structure (GQA, qk-norm, interleaved mRoPE, domain-aware action heads),
# tiny widths. mrope_section sums to head_dim / 2 as in Nano (24 + 20 + 20 = 64 = 128 / 2).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "action_gen": True,
    "action_dim": 64,
    "hidden_size": 64,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "latent_channel": 16,
    "latent_patch_size": 2,
    "patch_latent_dim": 2 * 2 * 16,
    "rope_scaling": {"mrope_section": [4, 2, 2]},
    # Nano's 5e6 barely rotates the slots that matter on tiny grids; a small theta makes position bugs visible.
    "rope_theta": 50.0,
    "num_embodiment_domains": 32,
}

# The Wan2.2 VAE (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: base_dim 160, decoder_base_dim 256, z_dim 48,
# num_res_blocks 2) with the same structure but narrow channels, one residual block per level and 16 latent
# channels. Compression stays 16x spatial (2x pixel patchify + 3 downsamples) and 4x temporal.
TINY_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 4,
    "decoder_base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    **WAN22_FIXED_CONFIG,
}

# The tiny checkpoints sample as the native policy server does.
TINY_SCHEDULER_CONFIG: dict[str, Any] = POLICY_SCHEDULER_CONFIG


def _check_override_keys(overrides: Mapping[str, Any], cls: type[Any], field: str) -> None:
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise InputError(f"{field}: unknown {cls.__name__} config keys {unknown}")


@torch.no_grad()
def _redraw_transformer_weights(transformer: torch.nn.Module, generator: torch.Generator) -> None:
    """Redraw every parameter so none is zero or one: the default init leaves biases and
    ``action_modality_embed`` at 0 and norm weights at 1, which would hide bugs in a reimplementation."""
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3NemotronRMSNorm

    for module in transformer.modules():
        is_norm = isinstance(module, (RMSNorm, Cosmos3NemotronRMSNorm))
        for param in module.parameters(recurse=False):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(1.0 + 0.1 * noise if is_norm else 0.02 * noise)


@torch.no_grad()
def _perturb_vae_norm_scales(vae: torch.nn.Module, generator: torch.Generator) -> None:
    """The VAE's convolutions keep their (random) default init; its RMS-norm scales start at 1 and are perturbed."""
    for name, param in vae.named_parameters():
        if name.endswith("gamma"):
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator, dtype=torch.float32))


def build_tiny_checkpoint(
    path: str | os.PathLike,
    seed: int = 0,
    *,
    vae_overrides: Mapping[str, Any] | None = None,
    scheduler_overrides: Mapping[str, Any] | None = None,
    **transformer_overrides: Any,
) -> Path:
    """Write a small random ``Cosmos3OmniPipeline`` checkpoint (about 4 MB, safetensors) and return its path.

    Built from diffusers' own classes and ``save_pretrained``, so the layout is exactly diffusers'. The same seed
    gives identical weights. ``transformer_overrides`` update ``TINY_TRANSFORMER_CONFIG`` (e.g.
    ``num_hidden_layers=3, hidden_act="relu2"``); ``vae_overrides`` / ``scheduler_overrides`` update the VAE and
    scheduler configs. ``path`` must not exist or be an empty directory.
    """
    # From their modules: mypy reads the top-level names as diffusers' dummy (no-torch) placeholders.
    from diffusers import UniPCMultistepScheduler
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    path = Path(path).expanduser()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InputError(f"path: {path} already exists and is not an empty directory")
    vae_overrides = dict(vae_overrides or {})
    scheduler_overrides = dict(scheduler_overrides or {})
    _check_override_keys(transformer_overrides, Cosmos3OmniTransformer, "transformer_overrides")
    _check_override_keys(vae_overrides, AutoencoderKLWan, "vae_overrides")
    _check_override_keys(scheduler_overrides, UniPCMultistepScheduler, "scheduler_overrides")

    tokenizer = build_tiny_tokenizer()
    transformer_config = {**TINY_TRANSFORMER_CONFIG, "vocab_size": len(tokenizer), **transformer_overrides}
    vae_config = {**TINY_VAE_CONFIG, **vae_overrides}

    generator = torch.Generator().manual_seed(seed)
    z_dim = vae_config["z_dim"]
    # Latent statistics away from the identity (mean 0, std 1) so a missing (de)normalisation shows up in tests.
    latents_mean = (0.5 * torch.randn(z_dim, generator=generator)).tolist()
    latents_std = (0.5 + torch.rand(z_dim, generator=generator)).tolist()
    vae_config.setdefault("latents_mean", [round(value, 4) for value in latents_mean])
    vae_config.setdefault("latents_std", [round(value, 4) for value in latents_std])

    # The modules draw their default init from the global RNG; seed it without disturbing the caller's state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = Cosmos3OmniTransformer(**transformer_config)
        vae = AutoencoderKLWan(**vae_config)
    _redraw_transformer_weights(transformer, generator)
    _perturb_vae_norm_scales(vae, generator)
    scheduler = UniPCMultistepScheduler(**{**TINY_SCHEDULER_CONFIG, **scheduler_overrides})

    pipeline = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=scheduler,
        enable_safety_checker=False,
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    validate_checkpoint(path)
    return path


def tiny_checkpoint_cache_dir() -> Path:
    """Where ``cached_tiny_checkpoint`` keeps its checkpoint: ``$XDG_CACHE_HOME/cosmos3_gym`` (default
    ``~/.cache/cosmos3_gym``), one directory per package version."""
    from cosmos3_gym import __version__

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return root / "cosmos3_gym" / f"tiny-checkpoint-{__version__}"


def cached_tiny_checkpoint() -> Path:
    """The tiny RANDOM-weight checkpoint (``build_tiny_checkpoint(seed=0)``), built once into
    ``tiny_checkpoint_cache_dir()`` and reused. Built in a temporary sibling folder and renamed into place, so an
    interrupted or concurrent build never leaves a half-written checkpoint behind."""
    target = tiny_checkpoint_cache_dir()
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
        try:
            build_tiny_checkpoint(building, seed=0)
            building.rename(target)
        except OSError:
            if not target.exists():  # not a concurrent build that got there first
                raise
        finally:
            if building.exists():
                shutil.rmtree(building, ignore_errors=True)
    try:
        validate_checkpoint(target)
    except CheckpointError as error:
        raise CheckpointError(
            f"{error}\nThe cached tiny checkpoint {target} is damaged; delete it to rebuild."
        ) from error
    return target
