"""Deepen a trained transformer without changing what it computes (block expansion, as LLaMA Pro does).

A fine-tune that wants more capacity than a small checkpoint has would otherwise start a bigger model from scratch
and lose everything the checkpoint learnt. ``grow_depth`` builds a model with ``num_layers`` layers per tower: each
original layer keeps its weights and is followed by copies of itself whose attention output and MLP down
projections are zero. A zero-output block adds nothing to the residual stream, so the grown model's outputs are the
checkpoint's exactly; training then moves the copies off zero. Text and GEN towers grow together because GEN layer
``i`` attends to the keys and values of text layer ``i``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import InputError
from ..models.transformer import Cosmos3Transformer, build_on_meta

__all__ = ["grow_depth", "layer_sources"]

ZEROED_OUTPUTS = ("attn.out.weight", "attn.out.bias", "mlp.down.weight", "mlp.down.bias")


def layer_sources(old_layers: int, new_layers: int) -> list[tuple[int, bool]]:
    """For each new layer: ``(the old layer it copies, whether it is that layer's first copy)``. Copies are spread
    evenly: old layer ``i`` fills new layers ``[i * new // old, (i + 1) * new // old)``."""
    sources = []
    for old in range(old_layers):
        first, end = old * new_layers // old_layers, (old + 1) * new_layers // old_layers
        sources += [(old, new == first) for new in range(first, end)]
    return sources


@torch.no_grad()
def grow_depth(model: Cosmos3Transformer, num_layers: int) -> Cosmos3Transformer:
    """A new ``Cosmos3Transformer`` with ``num_layers`` layers per tower that computes what ``model`` does (see the
    module docstring), on ``model``'s device and dtypes; ``model`` itself when it already has ``num_layers``. A
    grown copy leaves ``model`` as it was."""
    old_layers = model.config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < old_layers:
        raise InputError(
            f"grow_depth: expected an integer >= the checkpoint's {old_layers} layers, got {num_layers!r}."
        )
    if num_layers == old_layers:
        return model
    grown = build_on_meta(
        Cosmos3Transformer,
        dataclasses.replace(model.config, num_hidden_layers=num_layers),
        dtype=next(model.parameters()).dtype,
    )
    old_state = model.state_dict()
    state = {name: value for name, value in old_state.items() if not name.startswith(("text_layers.", "gen_layers."))}
    for tower in ("text_layers", "gen_layers"):
        for new, (old, first) in enumerate(layer_sources(old_layers, num_layers)):
            prefix = f"{tower}.{old}."
            for name, value in old_state.items():
                if name.startswith(prefix):
                    suffix = name[len(prefix) :]
                    copied = value.clone()
                    if not first and suffix in ZEROED_OUTPUTS:
                        copied.zero_()
                    state[f"{tower}.{new}.{suffix}"] = copied
    grown.load_state_dict(state, strict=True, assign=True)
    for name, buffer in model.named_buffers():  # non-persistent ones (the RoPE tables) are not in the state dict
        if name not in old_state:
            module_name, _, attribute = name.rpartition(".")
            grown.get_submodule(module_name).register_buffer(attribute, buffer.clone(), persistent=False)
    grown.train(model.training)
    return grown
