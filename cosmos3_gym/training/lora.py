"""LoRA fine-tuning (PEFT) of the GEN tower: low-rank adapters on its linear layers, merged into the weights at export.

For users with one GPU and a large checkpoint: the base weights stay frozen (they can be bf16), only the float32
adapters ``W + (alpha / r) * B @ A`` on every GEN layer's fused q/k/v, attention output, gate/up and down projections
train (PEFT's ``LoraLayer``, the implementation diffusers integrates; B starts at zero, so step 0 is the base model).
The UND (text) tower has no adapters and is frozen, so its K/V are cached per prompt as with ``freeze_text_tower``.

``merge_lora_state_dict`` folds the adapters into plain weights: the exported checkpoint is an ordinary diffusers
checkpoint with no PEFT dependency at inference.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from ..errors import InputError

ADAPTER = "default"
# The GEN tower's linear layers (names inside models.transformer.DecoderBlock), as a full-match regex over module
# names (PEFT's target_modules).
GEN_LINEAR_PATTERN = r"gen_layers\.\d+\.(attn\.(qkv|out)|mlp\.(gate_up|down))"


def apply_lora(model: nn.Module, rank: int, alpha: float, seed: int = 0) -> list[str]:
    """Inject adapters into ``model``'s GEN linear layers in place, freeze everything else and return the names of
    the trainable (adapter) parameters. The adapters' init draws from a generator seeded with ``seed``."""
    from peft import LoraConfig, inject_adapter_in_model

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"lora_rank: expected an integer >= 1, got {rank!r}")
    # peft annotates lora_alpha as an int, but any number works: it only computes the scaling alpha / r.
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]
        target_modules=GEN_LINEAR_PATTERN,
        lora_dropout=0.0,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # PEFT initialises A (Kaiming uniform) from the global RNG
        inject_adapter_in_model(config, model)
    names = []
    for name, param in model.named_parameters():
        trainable = ".lora_A." in name or ".lora_B." in name
        param.requires_grad_(trainable)
        if trainable:
            param.data = param.data.float()  # float32 adapters (and AdamW states) even on a bf16 base
            names.append(name)
    if not names:
        raise InputError("lora_rank: the model has no GEN linear layers to adapt")
    return names


def merge_lora_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT-adapted state dict -> the plain one (``X.base_layer.weight + scaling * B @ A`` as ``X.weight``).

    The merge is computed in float32 and returned in the base weight's dtype."""
    adapted = {key.split(".base_layer.")[0] for key in state if ".base_layer." in key}
    out = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            module, suffix = key.split(".base_layer.")
            if suffix == "weight":
                a, b = state[f"{module}.lora_A.{ADAPTER}.weight"], state[f"{module}.lora_B.{ADAPTER}.weight"]
                value = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
            key = f"{module}.{suffix}"
        out[key] = value
    leftover = [k for k in state if re.search(r"\.lora_[AB]\.", k) and k.split(".lora_")[0] not in adapted]
    if leftover:
        raise InputError(f"LoRA state dict: adapters without a base layer {leftover[:4]}")
    return out
