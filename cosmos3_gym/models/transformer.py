"""The Cosmos3 Mixture-of-Transformers denoiser, batch-first, loading diffusers' ``Cosmos3OmniTransformer`` weights.

Cosmos3 has two towers of identical shape: the UND (text) tower runs causal self-attention over the prompt, the GEN
tower runs full attention over video + action tokens, and every GEN query also attends to the UND keys/values of
the same layer. Information flows one way (UND never sees GEN), so the text tower is run **once per prompt**
(``encode_text``) and its per-layer K/V are reused across denoising steps, env steps and every batch slot that
shares the prompt. Each denoising step then runs only the GEN tower (``forward``).

Differences from diffusers' packed single-sample implementation, all numerically neutral:
- batch-first tensors; prompts of different lengths are right-padded, and the GEN attention runs per group of
  equal text length over the unpadded K/V;
- to_q/to_k/to_v (and gate/up) fused into one GEMM after loading;
- velocities are computed for every token and zeroed on clean frames/rows (diffusers computes only noisy ones);
- ``norm`` and ``lm_head`` of the UND tower are never used for velocities and are not loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.embeddings import TimestepEmbedding, Timesteps

from ..errors import CheckpointError

if TYPE_CHECKING:
    from ..parallel.tensor_parallel import RowParallelLinear


@dataclass(frozen=True)
class Cosmos3TransformerConfig:
    """The fields of diffusers' ``transformer/config.json`` that define the network."""

    hidden_size: int = 4096
    head_dim: int = 128
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    qk_norm_for_text: bool = True
    use_und_k_norm_for_gen: bool = False
    vocab_size: int = 151936
    rope_theta: float = 5_000_000.0
    rope_axes_dim: tuple[int, int, int] = (24, 20, 20)
    latent_channel: int = 48
    latent_patch_size: int = 2
    patch_latent_dim: int = 192
    timestep_scale: float = 0.001
    base_fps: int = 24
    enable_fps_modulation: bool = True
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000
    action_gen: bool = False
    action_dim: int | None = None
    num_embodiment_domains: int = 32
    # The VAE's temporal compression; diffusers' pipeline reads it from the VAE, it is 4 for every Cosmos3 VAE.
    temporal_compression: int = 4

    @classmethod
    def from_dict(cls, config: dict) -> Cosmos3TransformerConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in known}
        if config.get("rope_axes_dim") is None:
            rope_scaling = config.get("rope_scaling") or {}
            values["rope_axes_dim"] = rope_scaling.get("mrope_section", [24, 20, 20])
        values["rope_axes_dim"] = tuple(int(x) for x in values["rope_axes_dim"])
        if config.get("sound_gen"):
            raise CheckpointError("transformer/config.json: sound_gen=True checkpoints are not supported")
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.hidden_act not in ("silu", "relu2"):
            raise CheckpointError(f"transformer config: hidden_act must be 'silu' or 'relu2', got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("transformer config: num_attention_heads must be a multiple of num_key_value_heads")
        if sum(self.rope_axes_dim) != self.head_dim // 2:
            raise CheckpointError(
                f"transformer config: rope axes {self.rope_axes_dim} must sum to head_dim/2 = {self.head_dim // 2}"
            )
        if self.patch_latent_dim != self.latent_patch_size**2 * self.latent_channel:
            raise CheckpointError(
                "transformer config: patch_latent_dim must equal latent_patch_size**2 * latent_channel"
            )
        if self.action_gen and not self.action_dim:
            raise CheckpointError("transformer config: action_gen=True needs action_dim")


# ----------------------------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm with diffusers' ``RMSNorm`` numerics (``silu`` checkpoints) or Nemotron's (``relu2`` checkpoints).

    diffusers normalises in fp32 and casts to the weight dtype *before* the affine product; the Nemotron variant
    multiplies in fp32 and casts back to the input dtype. The two round differently in bf16, so both are kept.
    """

    def __init__(self, dim: int, eps: float, nemotron: bool = False):
        super().__init__()
        self.eps = eps
        self.nemotron = nemotron
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nemotron:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.weight.float() * xf).to(x.dtype)
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


class MLP(nn.Module):
    """SwiGLU (``silu``, gate and up fused into one GEMM) or squared-ReLU (``relu2``) feed-forward."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gated = act == "silu"
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, intermediate * (2 if self.gated else 1), bias=bias)
        self.down: nn.Linear | RowParallelLinear = nn.Linear(intermediate, hidden, bias=bias)  # row-parallel under tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(x))

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The input of ``down``: silu(gate) * up, or relu(h)^2."""
        h = self.gate_up(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return torch.relu(h).square()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Fused-QKV projection, per-head q/k RMSNorm and RoPE; the attention itself is done by the block."""

    def __init__(self, cfg: Cosmos3TransformerConfig, qk_norm: bool, k_norm_for_gen: bool):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        nemotron = cfg.hidden_act == "relu2"
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        # row-parallel under tensor parallelism (parallel.tensor_parallel)
        self.out: nn.Linear | RowParallelLinear = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, nemotron) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, nemotron) if qk_norm else nn.Identity()
        # Only for checkpoints without text qk-norm: the UND keys get a separate norm before the GEN tower sees them.
        self.k_norm_for_gen = RMSNorm(self.head_dim, cfg.rms_norm_eps, nemotron) if k_norm_for_gen else None

    def project(self, x: torch.Tensor):
        """[B, S, hidden] -> q [B, H, S, D], k [B, KV, S, D], v [B, KV, S, D] (normed, before RoPE)."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
            dim=-1,
        )
        q = self.q_norm(q.view(b, s, -1, self.head_dim)).transpose(1, 2)
        k_raw = k.view(b, s, -1, self.head_dim)
        k = self.k_norm(k_raw).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        k_for_gen = None
        if self.k_norm_for_gen is not None:
            k_for_gen = self.k_norm_for_gen(self.k_norm(k_raw)).transpose(1, 2)
        return q, k, v, k_for_gen


class DecoderBlock(nn.Module):
    """One layer of one tower (UND and GEN layers have the same shape and separate weights)."""

    def __init__(self, cfg: Cosmos3TransformerConfig, text_tower: bool):
        super().__init__()
        nemotron = cfg.hidden_act == "relu2"
        qk_norm = cfg.qk_norm_for_text if text_tower else True
        k_norm_for_gen = text_tower and cfg.use_und_k_norm_for_gen and not cfg.qk_norm_for_text
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, nemotron)
        self.attn = Attention(cfg, qk_norm=qk_norm, k_norm_for_gen=k_norm_for_gen)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, nemotron)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def text_forward(self, x, cos, sin, kv_only: bool = False):
        """Causal text self-attention. Returns (new hidden or None, k for GEN, v). Right padding is harmless:
        under a causal mask real tokens never attend to the pads that follow them."""
        q, k, v, k_for_gen = self.attn.project(self.input_norm(x))
        k = apply_rope(k, cos, sin)
        k_gen = k if k_for_gen is None else apply_rope(k_for_gen, cos, sin)
        if kv_only:
            return None, k_gen, v
        q = apply_rope(q, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.attn.out(o.transpose(1, 2).flatten(2))
        return x + self.mlp(self.post_attn_norm(x)), k_gen, v

    def gen_forward(self, x, cos, sin, text_k, text_v, length_groups):
        x = x + self.attn.out(self.gen_attention(x, cos, sin, text_k, text_v, length_groups))
        return x + self.mlp(self.post_attn_norm(x))

    def gen_attention(self, x, cos, sin, text_k, text_v, length_groups) -> torch.Tensor:
        """The GEN tokens' attention over their prompt's text K/V and all GEN tokens: [B, S, heads * head_dim], the
        input of ``attn.out``."""
        q, k, v, _ = self.attn.project(self.input_norm(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if length_groups is None:
            o = F.scaled_dot_product_attention(
                q, torch.cat([text_k, k], dim=2), torch.cat([text_v, v], dim=2), enable_gqa=True
            )
        else:
            # Prompts of different lengths: attend per group of equal length over the unpadded text K/V. A padding
            # mask would force SDPA off the flash / cuDNN kernels onto a much slower masked path.
            outputs = [
                (
                    rows,
                    F.scaled_dot_product_attention(
                        q[rows],
                        torch.cat([text_k[rows, :, :length], k[rows]], dim=2),
                        torch.cat([text_v[rows, :, :length], v[rows]], dim=2),
                        enable_gqa=True,
                    ),
                )
                for rows, length in length_groups
            ]
            # Allocated from an output, not from q: under autocast SDPA returns bf16 while q may be fp32.
            o = outputs[0][1].new_empty(q.shape)
            for rows, out in outputs:
                o[rows] = out
        return o.transpose(1, 2).flatten(2)


class DomainAwareLinear(nn.Module):
    """One weight/bias per embodiment domain, stored as embedding tables exactly like diffusers' layout.

    diffusers' version validates ``domain_id`` with a device->host ``torch.any`` every call; domains are validated
    once per request by the engine instead, so the hot path has no host sync.
    """

    def __init__(self, in_features: int, out_features: int, num_domains: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fc = nn.Embedding(num_domains, in_features * out_features)
        self.bias = nn.Embedding(num_domains, out_features)

    def forward(self, x: torch.Tensor, domain_ids: torch.Tensor) -> torch.Tensor:
        weight = self.fc(domain_ids).view(-1, self.in_features, self.out_features)
        return torch.bmm(x, weight) + self.bias(domain_ids).unsqueeze(1)


# ----------------------------------------------------------------------------------------------------------------
# Rotary positions (interleaved 3-D mRoPE)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TextKV:
    """Per-layer UND keys (normed, rotated) and values for a batch of prompts, right-padded to ``max(lengths)``."""

    keys: list[torch.Tensor]  # per layer [B, KV, L, D]
    values: list[torch.Tensor]  # per layer [B, KV, L, D]
    lengths: list[int]

    def select(self, index: int) -> TextKV:
        """One prompt's cache, trimmed to its real length."""
        n = self.lengths[index]
        return TextKV(
            [k[index : index + 1, :, :n] for k in self.keys], [v[index : index + 1, :, :n] for v in self.values], [n]
        )

    @staticmethod
    def stack(items: list[TextKV]) -> TextKV:
        """Batch single-prompt caches, right-padding shorter prompts with zeros (masked in attention)."""
        lengths = [it.lengths[0] for it in items]
        max_len = max(lengths)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, max_len - t.shape[2])) if t.shape[2] < max_len else t

        num_layers = len(items[0].keys)
        keys = [torch.cat([pad(it.keys[i]) for it in items]) for i in range(num_layers)]
        values = [torch.cat([pad(it.values[i]) for it in items]) for i in range(num_layers)]
        return TextKV(keys, values, lengths)


@dataclass
class GenLayout:
    """Static per-batch facts of one GEN forward: token grid, rotary tables and the text padding mask."""

    latent_thw: tuple[int, int, int]
    patch_hw: tuple[int, int]
    chunk: int
    cos: torch.Tensor = field(repr=False)  # [B, 1, S_gen, D]
    sin: torch.Tensor = field(repr=False)
    # (row indexes, text length) per distinct prompt length; None when every prompt has the same length.
    length_groups: list[tuple[torch.Tensor, int]] | None = field(repr=False, default=None)

    @property
    def num_video_tokens(self) -> int:
        return self.latent_thw[0] * self.patch_hw[0] * self.patch_hw[1]


class Cosmos3RotaryEmbedding(nn.Module):
    """Interleaved mRoPE: frequency slot j rotates with the t, h or w position id, in the pattern t,h,w,t,h,w,...
    for the first 3*h (h) / 3*w (w) slots, t elsewhere (Qwen3-VL layout, as diffusers' ``apply_interleaved_mrope``)."""

    inv_freq: torch.Tensor  # buffers (register_buffer)
    slot_axis: torch.Tensor

    def __init__(self, cfg: Cosmos3TransformerConfig):
        super().__init__()
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        axis = torch.zeros(dim // 2, dtype=torch.long)
        for ax, offset in ((1, 1), (2, 2)):
            axis[offset : cfg.rope_axes_dim[ax] * 3 : 3] = ax
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("slot_axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, B, N] (float32) -> cos, sin [B, 1, N, head_dim] in ``dtype``."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # [3, B, N, D/2]
        index = self.slot_axis.to(positions.device).view(1, 1, 1, -1).expand(1, *freqs.shape[1:])
        freqs = freqs.gather(0, index).squeeze(0)  # [B, N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def media_positions(
    grid_t: int,
    grid_h: int,
    grid_w: int,
    offset: float,
    fps: float | None,
    cfg: Cosmos3TransformerConfig,
    temporal_compression: int,
    start_frame_offset: int = 0,
) -> torch.Tensor:
    """[3, grid_t*grid_h*grid_w] float position ids for video (or action) tokens, as diffusers'
    ``get_3d_mrope_ids_vae_tokens``: fps-modulated float time when there is more than one step, integer otherwise."""
    if fps is not None and cfg.enable_fps_modulation and grid_t > 1:
        ticks_per_second = fps / temporal_compression
        base_ticks_per_second = cfg.base_fps / cfg.temporal_compression
        frames = torch.arange(grid_t, dtype=torch.float32)
        t = (frames + start_frame_offset) / ticks_per_second * base_ticks_per_second + offset
    else:
        t = (torch.arange(grid_t) + int(offset) + start_frame_offset).float()
    t = t.view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    h = torch.arange(grid_h).view(1, -1, 1).expand(grid_t, -1, grid_w).flatten().float()
    w = torch.arange(grid_w).view(1, 1, -1).expand(grid_t, grid_h, -1).flatten().float()
    if not cfg.unified_3d_mrope_reset_spatial_ids:
        h, w = h + int(offset), w + int(offset)
    return torch.stack([t, h, w])


# ----------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------

_Module = TypeVar("_Module", bound=nn.Module)


def build_on_meta(factory: Callable[..., _Module], *args, dtype: torch.dtype, **kwargs) -> _Module:
    """``factory(*args, **kwargs)`` on the meta device with ``dtype`` as torch's default dtype (restored after): the
    structure without memory or initialisation, to materialise with ``to_empty`` or ``load_state_dict(assign=True)``
    (how the 15 B Nano model is built without an fp32 copy or a CPU init)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return factory(*args, **kwargs)
    finally:
        torch.set_default_dtype(previous)


class Cosmos3Transformer(nn.Module):
    def __init__(self, config: Cosmos3TransformerConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.blocks_compiled = False  # compile_blocks() has run
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.text_layers = nn.ModuleList(DecoderBlock(c, text_tower=True) for _ in range(c.num_hidden_layers))
        self.gen_layers = nn.ModuleList(DecoderBlock(c, text_tower=False) for _ in range(c.num_hidden_layers))
        self.gen_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, nemotron=c.hidden_act == "relu2")
        self.rotary = Cosmos3RotaryEmbedding(c)
        self.proj_in = nn.Linear(c.patch_latent_dim, c.hidden_size)
        self.proj_out = nn.Linear(c.hidden_size, c.patch_latent_dim)
        self.time_proj = Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=c.hidden_size)
        if c.action_gen:
            assert c.action_dim is not None  # validate(): action_gen needs action_dim
            self.action_proj_in = DomainAwareLinear(c.action_dim, c.hidden_size, c.num_embodiment_domains)
            self.action_proj_out = DomainAwareLinear(c.hidden_size, c.action_dim, c.num_embodiment_domains)
            self.action_modality_embed = nn.Parameter(torch.zeros(c.hidden_size))

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> Cosmos3Transformer:
        """Load ``transformer/`` of a diffusers Cosmos3 checkpoint (config.json + safetensors shards)."""
        from ..checkpoint import load_safetensors_state_dict

        path = Path(path)
        config_path = path / "config.json"
        try:
            config = Cosmos3TransformerConfig.from_dict(json.loads(config_path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{config_path}: cannot read transformer config ({e})") from e
        with torch.device("meta"):
            model = cls(config)
        model.load_diffusers_state_dict(load_safetensors_state_dict(path), device=device, dtype=dtype)
        return model

    def load_diffusers_state_dict(
        self, state_dict: dict[str, torch.Tensor], device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        """Load ``Cosmos3OmniTransformer``'s state dict unchanged (fusing QKV and gate/up on the way).

        The time embedder stays fp32 whatever ``dtype`` is, as diffusers keeps it (``_keep_in_fp32_modules``).
        Missing or unexpected keys are an error naming them.
        """
        ours = diffusers_to_native_state_dict(state_dict, self.config)
        expected = set(self.state_dict().keys())
        missing, unexpected = expected - ours.keys(), ours.keys() - expected
        if missing or unexpected:
            raise CheckpointError(
                f"transformer weights do not match the config: missing {sorted(missing)[:8]}, "
                f"unexpected {sorted(unexpected)[:8]}"
            )
        for name, tensor in ours.items():
            keep_fp32 = name.startswith("time_embedder.") or dtype is None
            ours[name] = tensor.to(device=device, dtype=tensor.dtype if keep_fp32 else dtype)
        self.load_state_dict(ours, assign=True)
        self.rotary = Cosmos3RotaryEmbedding(self.config).to(device)

    def compile_blocks(self) -> None:
        """Regional ``torch.compile`` of the decoder blocks (diffusers' ``compile_repeated_blocks`` idea): inductor
        fuses the fp32 RMSNorms, RoPE and the gated MLP's elementwise ops around the GEMMs. All blocks share one
        code object, so the graph compiles once per input shape, not once per layer. Calling it again does nothing."""
        if self.blocks_compiled:
            return
        self.blocks_compiled = True
        for block in [*self.text_layers, *self.gen_layers]:
            block.text_forward = torch.compile(block.text_forward)
            # A forward that a parallel plan swapped in may orchestrate streams itself and compile its own regions.
            if hasattr(block.gen_forward, "compile_regions"):
                block.gen_forward.compile_regions()
            else:
                block.gen_forward = torch.compile(block.gen_forward)

    # ------------------------------------------------------------------ text tower

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_in.weight.device

    def encode_text(self, input_ids: list[list[int]]) -> TextKV:
        """Run the UND tower once over a batch of prompts; returns the per-layer K/V the GEN tower attends to."""
        lengths = [len(ids) for ids in input_ids]
        max_len = max(lengths)
        ids = torch.zeros(len(input_ids), max_len, dtype=torch.long)
        for i, seq in enumerate(input_ids):
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        ids = ids.to(self.device)
        x = self.embed_tokens(ids)
        pos = torch.arange(max_len, dtype=torch.float32, device=self.device)
        positions = pos.view(1, 1, -1).expand(3, len(input_ids), -1)
        cos, sin = self.rotary(positions, x.dtype)
        keys, values = [], []
        last = len(self.text_layers) - 1
        for i, layer in enumerate(cast("Sequence[DecoderBlock]", self.text_layers)):
            # The last layer's output feeds only the (unused) LM head: its K/V are all the GEN tower needs.
            x, k, v = layer.text_forward(x, cos, sin, kv_only=i == last)
            keys.append(k)
            values.append(v)
        return TextKV(keys, values, lengths)

    # ------------------------------------------------------------------ GEN tower

    def gen_layout(
        self,
        text_lengths: list[int],
        latent_thw: tuple[int, int, int],
        chunk: int,
        fps: list[float] | float,
        action_start_offset: list[int] | int = 1,
    ) -> GenLayout:
        """Rotary tables and masks for a batch; computed once per denoising loop, not per step.

        ``action_start_offset`` (per row or one for all): the time index of the first action row, 1 in diffusers;
        ``1 - history`` when ``history`` state rows are prepended (PhyAI PR49, native ``0 if use_state else 1``)."""
        c, p = self.config, self.config.latent_patch_size
        t, h, w = latent_thw
        hp, wp = -(-h // p), -(-w // p)
        batch = len(text_lengths)
        fps_list = fps if isinstance(fps, (list, tuple)) else [fps] * batch
        offsets = (
            action_start_offset if isinstance(action_start_offset, (list, tuple)) else [action_start_offset] * batch
        )
        # Rows of one prompt length, fps and action offset share their positions: a vector env's batch of 128 slots
        # with one task builds one row, not 128 (20 ms of host time per call at 128 rows in the GRPO loop's profile,
        # benchmarks/results/rl/grpo_loop_profile_h200.json).
        distinct: dict[tuple, torch.Tensor] = {}
        rows = []
        for length, item_fps, action_offset in zip(text_lengths, fps_list, offsets):
            key = (length, item_fps, action_offset)
            if key not in distinct:
                # diffusers: text occupies positions [0, L); media start after a fixed margin.
                offset = length + c.unified_3d_mrope_temporal_modality_margin
                parts = [media_positions(t, hp, wp, offset, item_fps, c, c.temporal_compression)]
                if chunk and c.action_gen:
                    # One action per video frame; base rate is the video's (tcf 4), so action 4j aligns with latent j.
                    parts.append(media_positions(chunk, 1, 1, offset, item_fps, c, 1, start_frame_offset=action_offset))
                distinct[key] = torch.cat(parts, dim=1)
            rows.append(distinct[key])
        positions = torch.stack(rows, dim=1).to(self.device)  # [3, B, S]
        cos, sin = self.rotary(positions, self.dtype)
        length_groups = None
        if len(set(text_lengths)) > 1:
            length_groups = [
                (torch.tensor([i for i, n in enumerate(text_lengths) if n == length], device=self.device), length)
                for length in sorted(set(text_lengths))
            ]
        return GenLayout((t, h, w), (hp, wp), chunk if c.action_gen else 0, cos, sin, length_groups)

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, t, h, w] -> [B, t*hp*wp, p*p*C], zero-padding h, w to the patch size (diffusers' order)."""
        p = self.config.latent_patch_size
        b, c, t, h, w = latents.shape
        ph, pw = (-h) % p, (-w) % p
        if ph or pw:
            latents = F.pad(latents, (0, pw, 0, ph))
        hp, wp = (h + ph) // p, (w + pw) // p
        x = latents.reshape(b, c, t, hp, p, wp, p).permute(0, 2, 3, 5, 4, 6, 1)
        return x.reshape(b, t * hp * wp, p * p * c)

    def unpatchify(self, tokens: torch.Tensor, layout: GenLayout) -> torch.Tensor:
        p, c = self.config.latent_patch_size, self.config.latent_channel
        t, h, w = layout.latent_thw
        hp, wp = layout.patch_hw
        x = tokens.reshape(-1, t, hp, wp, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)
        return x.reshape(-1, c, t, hp * p, wp * p)[..., :h, :w]

    def timestep_embedding(self, timesteps: torch.Tensor) -> torch.Tensor:
        """[B] integer timesteps (sigma*1000, truncated) -> [B, hidden] in the model dtype; the MLP runs in fp32."""
        emb_dtype = self.time_embedder.linear_1.weight.dtype
        t = timesteps * self.config.timestep_scale
        return self.time_embedder(self.time_proj(t).to(emb_dtype)).to(self.dtype)

    def forward(
        self,
        text: TextKV,
        layout: GenLayout,
        video: torch.Tensor,
        video_noisy: torch.Tensor,
        timesteps: torch.Tensor,
        actions: torch.Tensor | None = None,
        action_noisy: torch.Tensor | None = None,
        domain_ids: torch.Tensor | None = None,
        context_timesteps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One GEN-tower pass.

        Args:
            text: UND K/V for the batch (``TextKV.stack`` of per-prompt caches).
            layout: from ``gen_layout`` for the same batch.
            video: [B, C, t, h, w] noisy/clean latents; video_noisy: [B, t] bool, True = noisy frame.
            timesteps: [B] model timesteps (int64 sigma*1000, as diffusers' scheduler hands them out).
            actions: [B, chunk, action_dim]; action_noisy: [B, chunk] bool; domain_ids: [B] long.
            context_timesteps: [B] model timesteps of the clean video frames (the context), or None. A sample's clean
                frames that carry noise of level sigma (context noise, as Diffusion Forcing feeds back its own frames)
                get the embedding of ``int(sigma * 1000)``; at 0 they get none, exactly as without it.
        Returns:
            video velocity [B, C, t, h, w] and action velocity [B, chunk, action_dim] (fp32), zero on clean entries.
        """
        dtype = self.dtype
        temb = self.timestep_embedding(timesteps)[:, None, :]  # [B, 1, hidden]
        hp, wp = layout.patch_hw
        video_tokens = self.proj_in(self.patchify(video.to(dtype)))
        video_token_noisy = video_noisy.repeat_interleave(hp * wp, dim=1)[..., None]
        # Clean tokens get no timestep embedding at all (not a t=0 one), as in diffusers' scatter_add; noised context
        # frames get their own level's (zeroed where the level is 0, so that those rows stay exact).
        clean_tokens = video_tokens
        if context_timesteps is not None:
            context_temb = self.timestep_embedding(context_timesteps) * (context_timesteps > 0).to(dtype)[:, None]
            clean_tokens = video_tokens + context_temb[:, None, :]
        tokens = [torch.where(video_token_noisy, video_tokens + temb, clean_tokens)]
        if layout.chunk:
            assert actions is not None and action_noisy is not None  # a layout with actions: they are given
            action_tokens = self.action_proj_in(actions.to(dtype), domain_ids) + self.action_modality_embed
            tokens.append(torch.where(action_noisy[..., None], action_tokens + temb, action_tokens))
        x = torch.cat(tokens, dim=1) if len(tokens) > 1 else tokens[0]

        for layer, k, v in zip(cast("Sequence[DecoderBlock]", self.gen_layers), text.keys, text.values):
            x = layer.gen_forward(x, layout.cos, layout.sin, k, v, layout.length_groups)
        x = self.gen_norm(x)

        n_video = layout.num_video_tokens
        video_velocity = self.unpatchify(self.proj_out(x[:, :n_video]), layout).float()
        video_velocity = video_velocity * video_noisy[:, None, :, None, None]
        action_velocity = None
        if layout.chunk:
            assert action_noisy is not None
            action_velocity = self.action_proj_out(x[:, n_video:], domain_ids).float()
            action_velocity = action_velocity * action_noisy[..., None]
        return video_velocity, action_velocity


# ----------------------------------------------------------------------------------------------------------------
# State-dict conversion
# ----------------------------------------------------------------------------------------------------------------

_IGNORED_DIFFUSERS_KEYS = ("lm_head.weight", "norm.weight")  # the text tower's LM head / final norm: never used


def module_name_map(cfg: Cosmos3TransformerConfig) -> list[tuple[str, list[tuple[str, int]]]]:
    """Every weight-bearing module of this model and the ``Cosmos3OmniTransformer`` modules it is made of, as
    ``(native name, [(diffusers name, output rows), ...])``: several parts are concatenated along the rows (fused
    q/k/v and gate/up). The one table that both conversion directions read."""
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    ffn = cfg.intermediate_size
    gated = cfg.hidden_act == "silu"
    table: list[tuple[str, list[tuple[str, int]]]] = []
    for i in range(cfg.num_hidden_layers):
        src = f"layers.{i}"
        for tower, q, k, v, o, qn, kn, mlp, suffix in (
            ("text_layers", "to_q", "to_k", "to_v", "to_out", "norm_q", "norm_k", "mlp", ""),
            (
                "gen_layers",
                "add_q_proj",
                "add_k_proj",
                "add_v_proj",
                "to_add_out",
                "norm_added_q",
                "norm_added_k",
                "mlp_moe_gen",
                "_moe_gen",
            ),
        ):
            dst, attn = f"{tower}.{i}", f"{src}.self_attn"
            gate_up = (
                [(f"{src}.{mlp}.gate_proj", ffn), (f"{src}.{mlp}.up_proj", ffn)]
                if gated
                else [(f"{src}.{mlp}.up_proj", ffn)]
            )
            table += [
                (f"{dst}.attn.qkv", [(f"{attn}.{q}", q_size), (f"{attn}.{k}", kv_size), (f"{attn}.{v}", kv_size)]),
                (f"{dst}.attn.out", [(f"{attn}.{o}", 0)]),
                (f"{dst}.attn.q_norm", [(f"{attn}.{qn}", 0)]),
                (f"{dst}.attn.k_norm", [(f"{attn}.{kn}", 0)]),
                (f"{dst}.mlp.gate_up", gate_up),
                (f"{dst}.mlp.down", [(f"{src}.{mlp}.down_proj", 0)]),
                (f"{dst}.input_norm", [(f"{src}.input_layernorm{suffix}", 0)]),
                (f"{dst}.post_attn_norm", [(f"{src}.post_attention_layernorm{suffix}", 0)]),
            ]
        table.append((f"text_layers.{i}.attn.k_norm_for_gen", [(f"{src}.self_attn.k_norm_und_for_gen", 0)]))
    names = ["embed_tokens", "proj_in", "proj_out", "time_embedder.linear_1", "time_embedder.linear_2"]
    if cfg.action_gen:
        names += ["action_proj_in.fc", "action_proj_in.bias", "action_proj_out.fc", "action_proj_out.bias"]
    table += [(name, [(name, 0)]) for name in names]
    table.append(("gen_norm", [("norm_moe_gen", 0)]))
    return table


def diffusers_to_native_state_dict(sd: dict[str, torch.Tensor], cfg: Cosmos3TransformerConfig) -> dict:
    """Map ``Cosmos3OmniTransformer`` keys to this module's, fusing q/k/v and gate/up (concatenated along rows)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set(k for k in _IGNORED_DIFFUSERS_KEYS if k in sd)

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise CheckpointError(f"transformer weights: missing key {key!r}")
        used.add(key)
        return sd[key]

    def take_optional(key: str):
        return take(key) if key in sd else None

    def fuse(dst: str, srcs: list[str]) -> None:
        out[f"{dst}.weight"] = torch.cat([take(f"{s}.weight") for s in srcs])
        biases = [take_optional(f"{s}.bias") for s in srcs]
        if any(b is not None for b in biases):
            out[f"{dst}.bias"] = torch.cat(biases)

    def copy(dst: str, src: str) -> None:
        for suffix in ("weight", "bias"):
            value = take_optional(f"{src}.{suffix}")
            if value is not None:
                out[f"{dst}.{suffix}"] = value

    for native, parts in module_name_map(cfg):
        if len(parts) == 1:
            copy(native, parts[0][0])
        else:
            fuse(native, [name for name, _ in parts])
    if cfg.action_gen:
        out["action_modality_embed"] = take("action_modality_embed")
    leftover = set(sd) - used
    if leftover:
        raise CheckpointError(f"transformer weights: unexpected keys {sorted(leftover)[:8]}")
    return out
