"""Deepen or widen a trained transformer without changing what it computes.

**Depth** (block expansion, as LLaMA Pro does).
A fine-tune that wants more capacity than a small checkpoint has would otherwise start a bigger model from scratch
and lose everything the checkpoint learnt. ``grow_depth`` builds a model with ``num_layers`` layers per tower: each
original layer keeps its weights and is followed by copies of itself whose attention output and MLP down
projections are zero. A zero-output block adds nothing to the residual stream, so the grown model's outputs are the
checkpoint's exactly; training then moves the copies off zero. Text and GEN towers grow together because GEN layer
``i`` attends to the keys and values of text layer ``i``.

**Width** (``grow_width``): more MLP units and more attention heads per layer, the residual stream's width kept (its
norms, the timestep embedding's sinusoids and every embedding depend on it). A new MLP unit reads the layer's input
through new gate/up rows drawn at the scale of the trained ones and writes through a zero column of the down
projection; a new query head and its new key/value heads (the query-per-key/value ratio is kept, so every old head
still reads its old key/value head) read through new rows and write through zero columns of the output projection.
Nothing new reaches the residual stream until training moves those zeros; the zero columns get gradients from the
first step, because what they multiply is not zero.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import InputError
from ..models.transformer import Cosmos3Transformer, build_on_meta

__all__ = ["grow_depth", "grow_width", "grown_key_value_heads", "layer_sources"]

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
    return _filled(grown, state, model)


def _filled(grown: Cosmos3Transformer, state: dict[str, torch.Tensor], model: Cosmos3Transformer) -> Cosmos3Transformer:
    """``grown`` (built on the meta device) holding ``state``, ``model``'s non-persistent buffers (the RoPE tables,
    not in a state dict) and its train/eval mode."""
    grown.load_state_dict(state, strict=True, assign=True)
    persistent = model.state_dict().keys()
    for name, buffer in model.named_buffers():
        if name not in persistent:
            module_name, _, attribute = name.rpartition(".")
            grown.get_submodule(module_name).register_buffer(attribute, buffer.clone(), persistent=False)
    grown.train(model.training)
    return grown


def grown_key_value_heads(num_attention_heads: int, num_key_value_heads: int, grown_attention_heads: int) -> int:
    """The key/value heads of a model widened to ``grown_attention_heads``: the query-per-key/value ratio is kept."""
    return grown_attention_heads // (num_attention_heads // num_key_value_heads)


def _with_rows(value: torch.Tensor, parts: list[int], added: list[int], generator: torch.Generator) -> torch.Tensor:
    """``value``'s first dimension cut into ``parts``, each followed by ``added`` new rows: weights (2-D) drawn
    N(0, std of that part), biases (1-D) zero."""
    pieces = []
    for part, extra in zip(value.split(parts), added):
        pieces.append(part)
        if extra:
            shape = (extra, *part.shape[1:])
            if part.ndim == 1:
                pieces.append(part.new_zeros(shape))
            else:
                std = part.float().std().item()
                pieces.append((std * torch.randn(shape, generator=generator)).to(part))
    return torch.cat(pieces)


@torch.no_grad()
def grow_width(
    model: Cosmos3Transformer,
    *,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    seed: int = 0,
) -> Cosmos3Transformer:
    """A new ``Cosmos3Transformer`` with ``intermediate_size`` MLP units and ``num_attention_heads`` query heads per
    layer (None: the model's) that computes what ``model`` does (see the module docstring), on its device and
    dtypes; ``model`` itself when nothing grows. The key/value heads grow with the query heads (their ratio is kept);
    ``seed`` draws the new rows."""
    c = model.config
    group = c.num_attention_heads // c.num_key_value_heads
    intermediate = c.intermediate_size if intermediate_size is None else intermediate_size
    heads = c.num_attention_heads if num_attention_heads is None else num_attention_heads
    for field, wanted, old in (
        ("intermediate_size", intermediate, c.intermediate_size),
        ("num_attention_heads", heads, c.num_attention_heads),
    ):
        if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < old:
            raise InputError(f"grow_width: {field}: expected an integer >= the checkpoint's {old}, got {wanted!r}.")
    if heads % group:
        raise InputError(
            f"grow_width: num_attention_heads: expected a multiple of {group} (the checkpoint's query heads per "
            f"key/value head, kept so that every head keeps its key/value head), got {heads}."
        )
    if (intermediate, heads) == (c.intermediate_size, c.num_attention_heads):
        return model
    kv_heads = grown_key_value_heads(c.num_attention_heads, c.num_key_value_heads, heads)
    grown = build_on_meta(
        Cosmos3Transformer,
        dataclasses.replace(c, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads),
        dtype=next(model.parameters()).dtype,
    )
    generator = torch.Generator().manual_seed(seed)
    hd = c.head_dim
    q_old, kv_old = c.num_attention_heads * hd, c.num_key_value_heads * hd
    q_new, kv_new = (heads - c.num_attention_heads) * hd, (kv_heads - c.num_key_value_heads) * hd
    mlp_rows = [c.intermediate_size] * (2 if c.hidden_act == "silu" else 1)  # gated: gate rows, then up rows
    state = {}
    for name, value in model.state_dict().items():
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            value = _with_rows(value, [q_old, kv_old, kv_old], [q_new, kv_new, kv_new], generator)
        elif name.endswith(("mlp.gate_up.weight", "mlp.gate_up.bias")):
            value = _with_rows(value, mlp_rows, [intermediate - c.intermediate_size] * len(mlp_rows), generator)
        elif name.endswith("attn.out.weight"):
            value = torch.cat([value, value.new_zeros(value.shape[0], q_new)], dim=1)
        elif name.endswith("mlp.down.weight"):
            value = torch.cat([value, value.new_zeros(value.shape[0], intermediate - c.intermediate_size)], dim=1)
        state[name] = value.clone()
    return _filled(grown, state, model)
