"""The Cosmos3 latent space: diffusers' ``AutoencoderKLWan`` (the Wan2.2 VAE) plus the latent normalisation.

The numerics copy ``Cosmos3OmniPipeline`` (diffusers 0.42) line for line:

* normalisation statistics are built once from ``vae.config`` in the VAE dtype
  (``torch.tensor(latents_mean, dtype=vae.dtype)``, ``1.0 / torch.tensor(latents_std, dtype=vae.dtype)``);
* encode is ``_encode_video``: posterior mean (``sample_mode="argmax"``) in the VAE dtype,
  ``(mu - mean) * inv_std``, cast back to the pixels' dtype (the pipeline then calls ``.float()``);
* decode is the end of ``__call__``: ``z = latents.to(vae_dtype) / inv_std + mean``, ``vae.decode(z).sample``
  cast back to the latents' dtype, then ``VideoProcessor.postprocess_video``'s denormalisation to [0, 1].

The untiled decode runs diffusers' decoder with its own causal feature cache, but decodes the latent frames after the
first in chunks of ``decode_chunk_frames`` instead of one at a time (``AutoencoderKLWan._decode``'s loop). The
decoder is causal in time (every temporal convolution sees the previous two frames through the cache, the mid-block
attention is per frame), so the result is the same up to float summation order; the chunks turn the small per-frame
convolutions into large ones, which is what makes the decode fast on a GPU (see ``benchmarks/vae_decode_gpu.py``).

``Cosmos3VAE.fuse_decoder_norms()`` (opt-in) computes each decoder RMS norm and the SiLU after it in one compiled
kernel with diffusers' exact math (see ``_fuse_decoder_norms``).

Optional tiled decode uses diffusers' own spatial tiling (``enable_tiling`` / ``tiled_decode``). It is approximate:
each tile sees neither the pixels outside it through the convolutions nor the rest of the frame through the
mid-block attention, and overlapping tiles are linearly blended.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    CACHE_T,
    AutoencoderKLWan,
    WanAttentionBlock,
    WanCausalConv3d,
    WanDecoder3d,
    WanResidualBlock,
    WanRMS_norm,
    unpatchify,
)

from cosmos3_gym.checkpoint import check_no_pickle_weights
from cosmos3_gym.errors import CheckpointError, InputError

# The parts of the Wan2.2 VAE layout that Cosmos3 fixes (16x spatial / 4x temporal compression, the residual
# variant with a 2x2 pixel patchify); the widths (base_dim, decoder_base_dim, z_dim, ...) vary by model size.
WAN22_FIXED_CONFIG = {
    "temperal_downsample": [False, True, True],
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "dropout": 0.0,
}


@dataclass(frozen=True)
class TileConfig:
    """Spatial tiling of the decode, in latent pixels (one latent pixel is ``spatial_compression`` pixels).

    Tiles of ``tile_latent_h x tile_latent_w`` latent pixels are decoded one at a time, neighbours sharing
    ``overlap_latent`` latent pixels that are linearly blended. A latent no larger than one tile is decoded whole.
    """

    tile_latent_h: int
    tile_latent_w: int
    overlap_latent: int

    def __post_init__(self) -> None:
        for field in ("tile_latent_h", "tile_latent_w"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"TileConfig.{field}: expected an int >= 1, got {value!r}")
        smallest_side = min(self.tile_latent_h, self.tile_latent_w)
        if not isinstance(self.overlap_latent, int) or not 0 <= self.overlap_latent < smallest_side:
            raise InputError(
                f"TileConfig.overlap_latent: expected an int in [0, {smallest_side}) (smaller than the tile), "
                f"got {self.overlap_latent!r}"
            )


# The default ("auto") decodes this many latent frames per decoder pass, summed over the batch: 4 frames of one
# sample, 2 of each of two, one frame at a time from 4 samples on. Measured on an H200 (benchmarks/results/
# vae_decode_h200.json), 4 frames per pass decode 1.08x (480x832) to 1.42x (256x256) faster than one at a time at
# batch 1 but only 1.04x at batch 16, where they cost 20 GB more activation memory (37.9 vs 17.4 GB).
DECODE_FRAMES_PER_PASS = 4


class Cosmos3VAE(torch.nn.Module):
    """``AutoencoderKLWan`` with Cosmos3's latent normalisation; see the module docstring for the exact math.

    ``decode_chunk_frames``: latent frames of each sample decoded per decoder pass after the first: an int (1: exactly
    diffusers' frame-by-frame loop), None (all at once) or "auto" (``DECODE_FRAMES_PER_PASS`` over the batch).
    """

    latents_mean: torch.Tensor
    latents_inv_std: torch.Tensor

    def __init__(self, vae: AutoencoderKLWan, decode_chunk_frames: int | str | None = "auto") -> None:
        super().__init__()
        self.vae = vae
        self.decode_chunk_frames = decode_chunk_frames
        config = self._vae_config
        _check_latent_stats(config)
        # Built in the VAE dtype straight from the config's Python floats, as the pipeline does: building them in
        # float32 and casting later can round differently in bf16 (and 1/std would be computed in float32).
        self.register_buffer("latents_mean", torch.tensor(config.latents_mean, dtype=vae.dtype), persistent=False)
        self.register_buffer(
            "latents_inv_std", 1.0 / torch.tensor(config.latents_std, dtype=vae.dtype), persistent=False
        )

    @property
    def _vae_config(self) -> Any:
        # diffusers' FrozenDict, which also reads its keys as attributes (typed as a plain dict).
        return self.vae.config

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> Cosmos3VAE:
        """Load the ``vae/`` folder of a diffusers checkpoint (``config.json`` plus safetensors weights; pickled
        weights in the folder are refused, never loaded)."""
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"vae: expected a folder with config.json and the VAE weights, got {str(path)!r}")
        check_no_pickle_weights(path)
        try:
            vae = AutoencoderKLWan.from_pretrained(path, torch_dtype=dtype, use_safetensors=True)
        except Exception as error:  # diffusers raises OSError/ValueError/RuntimeError/... depending on the damage
            raise CheckpointError(f"vae: could not load AutoencoderKLWan from {str(path)!r}: {error}") from error
        return cls(vae.eval()).to(device)

    def use_channels_last(self) -> Cosmos3VAE:
        """Store the decoder's convolution weights channels-last (NDHWC / NHWC), the layout cuDNN's bf16 tensor-core
        kernels read natively; activations follow the weights' layout. Same math, different kernels."""
        for module in self.vae.decoder.modules():
            if isinstance(module, torch.nn.Conv3d):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last_3d)
            elif isinstance(module, torch.nn.Conv2d):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last)
        return self

    def fuse_decoder_norms(self, compile: bool = True) -> Cosmos3VAE:
        """Compute every decoder ``WanRMS_norm`` together with the SiLU that follows it in one ``torch.compile``d
        kernel (the mid-block attention's norm, which has no SiLU after it, alone). Same math and casts as diffusers;
        the encoder and the weights are untouched; works with ``use_channels_last``, any ``decode_chunk_frames`` and
        tiling. For inference: with autograd on, the norms run diffusers' eager math. Calling it again does nothing.
        See ``_fuse_decoder_norms``.

        ``compile=False`` (for CPUs, where a compile costs seconds of start-up): the same ops in eager PyTorch, in
        place after the first one (4 passes over the activation instead of 7, no compile), float32 only (other
        dtypes run diffusers' forward); bit-identical to diffusers' float32 math on the same memory layout."""
        _fuse_decoder_norms(self.vae.decoder, compiled=compile)
        return self

    def use_direct_convolutions(self) -> Cosmos3VAE:
        """Run every decoder causal convolution with its spatial zero padding inside the convolution (diffusers pads a
        copy of the activation first) and, for float32 on a CPU, through oneDNN in channels-last layout: PyTorch's
        heuristic sends small batch-1 3D convolutions (every single-frame pass of the decoder) to its native
        ``slow_conv3d``, 4-13x slower on this decoder, and its RMS norms reduce over channels 80x faster when the
        channels are the innermost dim. Same math; float summation order only (see tests/test_vae.py). The module
        class changes to a subclass of ``WanCausalConv3d`` (instance-level forwards, as the tile-parallel decode
        installs, still shadow it). Calling it again does nothing."""
        for module in self.vae.decoder.modules():
            if type(module) is WanCausalConv3d:
                module.__class__ = _DirectCausalConv3d
        return self

    def optimize_encoder(self) -> Cosmos3VAE:
        """The encoder's share of ``optimize`` (it encodes each conditioning frame): direct convolutions and, for
        float32, every RMS norm in eager in-place ops (not fused with its SiLU: the encoder's layout is not
        planned); on a CPU also channels-last weights. Same math up to float summation order."""
        on_cpu = self.latents_mean.device.type == "cpu"
        for module in self.vae.encoder.modules():
            if type(module) is WanCausalConv3d:
                module.__class__ = _DirectCausalConv3d
            elif isinstance(module, WanRMS_norm) and module.channel_first and "forward" not in vars(module):
                # An instance-level forward on purpose (diffusers' class stays untouched), as _fuse_decoder_norms.
                module.forward = functools.partial(_eager_norm_forward, module, silu=False)  # type: ignore[method-assign]
            if on_cpu and isinstance(module, torch.nn.Conv3d):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last_3d)
            elif on_cpu and isinstance(module, torch.nn.Conv2d):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last)
        return self

    def optimize(self, *, compile: bool | None = None) -> Cosmos3VAE:
        """The fast path for the VAE's device: ``optimize_encoder``; in the decoder direct convolutions and fused
        norms; on a CPU also
        channels-last weights, eager (uncompiled) fused norms and one latent frame per decoder pass (measured fastest
        there, the env profile in benchmarks/RESULTS.md). ``compile`` (default: on a GPU) compiles the fused norms."""
        on_cpu = self.latents_mean.device.type == "cpu"
        compile = not on_cpu if compile is None else compile
        self.use_direct_convolutions().optimize_encoder()
        if on_cpu:
            self.use_channels_last()
            if self.decode_chunk_frames == "auto":
                self.decode_chunk_frames = 1
        return self.fuse_decoder_norms(compile=compile)

    @property
    def decode_chunk_frames(self) -> int | str | None:
        return self._decode_chunk_frames

    @decode_chunk_frames.setter
    def decode_chunk_frames(self, value: int | str | None) -> None:
        if value not in (None, "auto") and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(
                f"decode_chunk_frames: expected an int >= 1, None (all frames at once) or 'auto', got {value!r}"
            )
        self._decode_chunk_frames = value

    @property
    def latent_channels(self) -> int:
        return int(self._vae_config.z_dim)

    @property
    def spatial_compression(self) -> int:
        return int(self._vae_config.scale_factor_spatial)

    @property
    def temporal_compression(self) -> int:
        return int(self._vae_config.scale_factor_temporal)

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The latent ``(t, h, w)`` that ``encode`` gives for ``num_frames`` pixel frames of ``height x width``."""
        self._check_pixel_shape(num_frames, height, width, field="num_frames, height, width")
        return (
            (num_frames - 1) // self.temporal_compression + 1,
            height // self.spatial_compression,
            width // self.spatial_compression,
        )

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels ``[B, 3, T, H, W]`` in [-1, 1] -> normalised latents ``[B, z, (T-1)//4+1, H//16, W//16]``, float32.

        Equal to ``Cosmos3OmniPipeline._encode_video(pixels).float()``, including its cast of the result to the
        pixels' dtype (so bfloat16 pixels give bfloat16-rounded latents). The Wan VAE is causal in time: latent
        frame 0 depends on pixel frame 0 only, so encoding just the clean first frame gives the same latent frame.
        """
        if not isinstance(pixels, torch.Tensor) or pixels.ndim != 5 or pixels.shape[1] != 3:
            raise InputError(f"pixels: expected a tensor [B, 3, T, H, W], got {_describe(pixels)}")
        if not pixels.is_floating_point():
            raise InputError(f"pixels: expected a floating-point tensor in [-1, 1], got dtype {pixels.dtype}")
        num_frames, height, width = pixels.shape[2:]
        self._check_pixel_shape(num_frames, height, width, field="pixels")
        vae_dtype = self.vae.dtype
        raw_mu = self.vae.encode(pixels.to(vae_dtype)).latent_dist.mode()
        mean = self.latents_mean.to(device=raw_mu.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        inv_std = self.latents_inv_std.to(device=raw_mu.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        return ((raw_mu - mean) * inv_std).to(pixels.dtype).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, tile: TileConfig | None = None, frames: str = "all") -> torch.Tensor:
        """Normalised latents ``[B, z, t, h, w]`` -> pixels ``[B, 3, 1 + 4(t-1), 16h, 16w]`` in [0, 1], float32.

        Untiled, equal to ``Cosmos3OmniPipeline``'s decode followed by ``postprocess_video(..., "pt")`` (up to the
        layout: the pipeline returns ``[B, T, 3, H, W]``). ``tile`` decodes with diffusers' spatial tiling instead,
        which is approximate (see the module docstring).

        ``frames="last"`` returns only the last frame ``[B, 3, 1, 16h, 16w]``, the same values as the full decode's
        last frame (float summation order only): every latent frame still runs through the decoder (the causal cache
        carries them), but the output head (norm, SiLU, the last causal convolution) runs for the one frame instead of
        ``1 + 4(t-1)``, and so do the unpatchify, clamp and conversion (see ``_decode_in_chunks``).
        """
        if frames not in ("all", "last"):
            raise InputError(f"frames: expected 'all' or 'last', got {frames!r}")
        if not isinstance(latents, torch.Tensor) or latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise InputError(
                f"latents: expected a tensor [B, {self.latent_channels}, t, h, w], got {_describe(latents)}"
            )
        if not latents.is_floating_point():
            raise InputError(f"latents: expected a floating-point tensor, got dtype {latents.dtype}")
        vae_dtype = self.vae.dtype
        mean = self.latents_mean.to(device=latents.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        inv_std = self.latents_inv_std.to(device=latents.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        raw_latents = latents.to(vae_dtype) / inv_std + mean
        if tile is None:
            decoded = self._decode_in_chunks(raw_latents, last_frame_only=frames == "last")
        else:
            # The tiling knobs are attributes of the VAE; set them for this call only so that encode and untiled
            # decodes stay untiled. diffusers counts them in (unpatchified) pixels.
            pixels_per_latent = self.spatial_compression
            self.vae.enable_tiling(
                tile_sample_min_height=tile.tile_latent_h * pixels_per_latent,
                tile_sample_min_width=tile.tile_latent_w * pixels_per_latent,
                tile_sample_stride_height=(tile.tile_latent_h - tile.overlap_latent) * pixels_per_latent,
                tile_sample_stride_width=(tile.tile_latent_w - tile.overlap_latent) * pixels_per_latent,
            )
            try:
                decoded = self.vae.decode(raw_latents).sample
            finally:
                self.vae.disable_tiling()
            if frames == "last":
                decoded = decoded[:, :, -1:]
        return VaeImageProcessor.denormalize(decoded.to(latents.dtype)).float()

    def _decode_in_chunks(self, raw_latents: torch.Tensor, last_frame_only: bool = False) -> torch.Tensor:
        """``AutoencoderKLWan._decode`` (diffusers 0.42) with the frames after the first in chunks, not one by one.

        The first latent frame goes alone because the decoder treats it specially (``first_chunk``: it is not
        upsampled in time); every later chunk continues the causal cache exactly as single frames would.

        ``last_frame_only``: the head (``norm_out`` -> SiLU -> causal ``conv_out``, kernel 3 in time) of the last pass
        runs on the last 3 frames only, as ``conv_out``'s 2 cached frames plus the last one, which gives exactly its
        last output frame; the earlier passes skip the head (its outputs and its cache feed only frames that are not
        returned). Needs a last pass of >= 3 frames (any pass after the first: 4 frames per latent frame); a
        single-latent-frame clip decodes whole.
        """
        vae = self.vae
        x = vae.post_quant_conv(raw_latents)
        num_frames = x.shape[2]
        chunk_frames = self.decode_chunk_frames
        if isinstance(chunk_frames, int):
            step = chunk_frames
        elif chunk_frames is None:
            step = max(1, num_frames - 1)
        else:  # "auto", the only string the setter accepts
            step = max(1, DECODE_FRAMES_PER_PASS // x.shape[0])
        starts = [0, *range(1, num_frames, step)]
        ends = [*starts[1:], num_frames]
        vae.clear_cache()
        try:
            pieces = []
            for start, end in zip(starts, ends):
                vae._conv_idx = [0]
                head = "all"
                if last_frame_only and num_frames > 1:
                    head = "last" if end == num_frames else "none"
                if head == "all":  # diffusers' own forward (module hooks fire)
                    piece = vae.decoder(
                        x[:, :, start:end], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=start == 0
                    )
                else:
                    piece = _decoder_forward(
                        vae.decoder, x[:, :, start:end], vae._feat_map, vae._conv_idx, first_chunk=start == 0, head=head
                    )
                if piece is not None:
                    pieces.append(piece)
        finally:
            vae.clear_cache()  # the cache holds activations of the last chunk: free them
        decoded = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
        if last_frame_only:
            decoded = decoded[:, :, -1:]
        patch_size = self._vae_config.patch_size
        if patch_size is not None:
            decoded = unpatchify(decoded, patch_size=patch_size)
        return torch.clamp(decoded, min=-1.0, max=1.0)

    def _check_pixel_shape(self, num_frames: int, height: int, width: int, field: str) -> None:
        # The encoder reads frames in chunks of 1, 4, 4, ... and would silently drop a trailing partial chunk.
        if num_frames < 1 or (num_frames - 1) % self.temporal_compression != 0:
            raise InputError(
                f"{field}: expected 1 + {self.temporal_compression}k frames (1, 5, 9, ...), got {num_frames}"
            )
        if height % self.spatial_compression != 0 or width % self.spatial_compression != 0 or height * width == 0:
            raise InputError(
                f"{field}: expected height and width that are positive multiples of {self.spatial_compression}, "
                f"got {height}x{width}"
            )


def _decoder_forward(decoder: WanDecoder3d, x, feat_cache, feat_idx, first_chunk: bool, head: str):
    """``WanDecoder3d.forward`` (diffusers 0.42.1, copied) with a choice of output head: "all" (diffusers'), "none"
    (skip it: None) or "last" (only the pass's last output frame, from the last 3 frames; see ``_decode_in_chunks``)."""
    x = _cached_causal_conv(decoder.conv_in, x, feat_cache, feat_idx)
    x = decoder.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    for up_block in decoder.up_blocks:
        x = up_block(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
    if head == "none":
        return None
    if head == "last":
        if x.shape[2] < 3:
            raise RuntimeError("last-frame decode: the last decoder pass has fewer than 3 frames")
        # The norm and SiLU are per position; conv_out sees frames -3 and -2 as its cache, so it pads nothing.
        x = decoder.nonlinearity(decoder.norm_out(x[:, :, -3:]))
        return decoder.conv_out(x[:, :, -1:], x[:, :, :-1])
    x = decoder.nonlinearity(decoder.norm_out(x))
    return _cached_causal_conv(decoder.conv_out, x, feat_cache, feat_idx)


def _cached_causal_conv(conv, x, feat_cache, feat_idx):
    """diffusers' step around one causal convolution of a chunked decode: convolve with the previous pass's cached
    frames, then cache this input's last ``CACHE_T`` frames (with one frame of the old cache when it is shorter)."""
    idx = feat_idx[0]
    cache_x = x[:, :, -CACHE_T:, :, :].clone()
    if cache_x.shape[2] < 2 and feat_cache[idx] is not None:
        cache_x = torch.cat([feat_cache[idx][:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
    x = conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return x


class _DirectCausalConv3d(WanCausalConv3d):
    """``WanCausalConv3d`` whose forward pads in space inside the convolution; see
    ``Cosmos3VAE.use_direct_convolutions``. The causal (front) time padding and the cache are diffusers'."""

    def forward(self, x, cache_x=None) -> torch.Tensor:
        # ints (diffusers builds them from the int padding of its convolutions; nn.Conv3d types padding as str too)
        pad_w, _, pad_h, _, time_pad, _ = cast("tuple[int, int, int, int, int, int]", self._padding)
        if cache_x is not None and time_pad > 0:
            cache_x = cache_x.to(x.device)
            x = torch.cat([cache_x, x], dim=2)
            time_pad -= cache_x.shape[2]
        if time_pad > 0:
            x = F.pad(x, (0, 0, 0, 0, time_pad, 0))
        padding = (0, pad_h, pad_w)
        if x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            x = x.contiguous(memory_format=torch.channels_last_3d)
            return torch.mkldnn_convolution(x, self.weight, self.bias, padding, self.stride, self.dilation, self.groups)
        return F.conv3d(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


# ---- fused RMS norm + SiLU in the decoder -------------------------------------------------------------------------
#
# Why: memory traffic. diffusers' WanRMS_norm.forward runs ~6 separate kernels, each a full pass over the activation,
# several of them in float32 (upcast, the norm reduction and the divide of F.normalize, the cast back, * scale,
# * gamma, + bias, which is the Python float 0.0 here), and the SiLU after it is one more pass; the activations are
# large (up to ~0.8 GB each for a 4-latent-frame chunk at 480x832 in bf16). Compiled together they are one pass
# (read x, write the result). The speed-up is measured on a GPU in benchmarks/vae_decode_gpu.py (variant
# "chunk4_fused_norms" against "chunk4").
#
# How: a plan applied to the plain diffusers model, no forked classes. On the decoder's module instances only, each
# WanRMS_norm that is followed by the SiLU (norm1 and norm2 of every WanResidualBlock -- one SiLU module serves
# both, so both are fused and it becomes an identity -- and WanDecoder3d.norm_out) gets a forward that computes
# silu(norm(x)), and the owner's `nonlinearity` becomes nn.Identity; the mid-block WanAttentionBlock's norm gets the
# compiled norm alone. In diffusers 0.42.1 those are the only SiLU call sites of the decoder: WanMidBlock,
# WanResidualUpBlock (the Wan2.2 is_residual layout), WanResample and DupUp3D apply none of their own. The plan checks
# that it covers every norm of the decoder and that each owner's nonlinearity is diffusers' nn.SiLU.
#
# Recompiles: the compiled functions always see one contiguous [outer, C, inner] view of the activation (no copy:
# the dims before the channels in memory, the channels, the dims after them), whatever its layout (contiguous
# NCDHW, channels-last, or the [B, T, C, H, W] memory order that WanResample leaves behind), and are compiled with
# dynamic shapes; the scale sqrt(C) goes in as an unspecialised float and gamma as a plain tensor (parameters would
# get static shapes). So widths, frame counts and batch sizes share graphs: one per dtype and per size-1 pattern of
# outer / inner (outer == 1 at batch 1, inner == 1 for channels-last), at most 3 per dtype and function.


def _wan_rms_norm(x: torch.Tensor, gamma: torch.Tensor, bias, scale: float) -> torch.Tensor:
    """``WanRMS_norm.forward`` (diffusers 0.42.1, ``channel_first``) on ``x [outer, C, inner]``: the same ops, casts
    and order (normalise in float32 for reduced-precision x, cast back to x's dtype, then the affine)."""
    needs_fp32_normalize = x.dtype in (torch.float16, torch.bfloat16) or any(
        t in str(x.dtype) for t in ("float4_", "float8_")
    )
    normalized = F.normalize(x.float() if needs_fp32_normalize else x, dim=1).to(x.dtype)
    return normalized * scale * gamma + bias


def _wan_rms_norm_silu(x: torch.Tensor, gamma: torch.Tensor, bias, scale: float) -> torch.Tensor:
    return F.silu(_wan_rms_norm(x, gamma, bias, scale))


@functools.cache
def _compiled(fn):
    # emulate_precision_casts: round every bf16/fp16 intermediate as eager PyTorch does (Inductor otherwise keeps
    # them in float32 inside the fused kernel), so the fused norm matches diffusers' rounding, not just its formula.
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


def _as_outer_channels_inner(x: torch.Tensor):
    """``x`` (channels at dim 1) as a contiguous ``[outer, C, inner]`` view, and the function that puts a result of
    that shape back in x's shape and strides; None when x's memory is not dense in any dim order."""
    strides = x.stride()
    order = sorted(range(x.ndim), key=lambda dim: (-strides[dim], dim))  # outermost in memory first
    permuted = x.permute(order)
    if not permuted.is_contiguous():
        return None
    channels_at = order.index(1)
    outer = math.prod(permuted.shape[:channels_at])
    inner = math.prod(permuted.shape[channels_at + 1 :])
    inverse = [order.index(dim) for dim in range(x.ndim)]
    # detach(): an alias that is not a view, so that dynamo does not also guard on the strides of x.
    rows = permuted.view(outer, x.shape[1], inner).detach()
    return rows, lambda result: result.view(permuted.shape).permute(inverse)


def _fused_norm_forward(norm: WanRMS_norm, x: torch.Tensor, silu: bool) -> torch.Tensor:
    # The fused path is for inference (Cosmos3VAE.decode runs under no_grad): it passes gamma detached. With autograd
    # on, and for a layout the decoder never produces, it is diffusers' eager math, unfused.
    rows = None if torch.is_grad_enabled() else _as_outer_channels_inner(x)
    if rows is None:
        out = WanRMS_norm.forward(norm, x)
        return F.silu(out) if silu else out
    rows, restore = rows
    channels = x.shape[1]
    gamma = norm.gamma.detach().view(channels, 1)
    bias = norm.bias.detach().view(channels, 1) if isinstance(norm.bias, torch.Tensor) else norm.bias
    fn = _compiled(_wan_rms_norm_silu if silu else _wan_rms_norm)
    return restore(fn(rows, gamma, bias, norm.scale))


def _eager_norm_forward(norm: WanRMS_norm, x: torch.Tensor, silu: bool) -> torch.Tensor:
    # WanRMS_norm.forward's float32 ops in their order (F.normalize is x / max(||x||, eps)), each after the division
    # in place on the fresh result; the "+ bias" with diffusers' float bias 0.0 adds nothing and is skipped.
    if torch.is_grad_enabled() or x.dtype != torch.float32:
        out = WanRMS_norm.forward(norm, x)
        return F.silu(out) if silu else out
    out = x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min_(1e-12)
    out.mul_(norm.scale).mul_(norm.gamma)
    if isinstance(norm.bias, torch.Tensor):
        out.add_(norm.bias)
    return F.silu(out, inplace=True) if silu else out


def _fuse_decoder_norms(decoder: WanDecoder3d, compiled: bool = True) -> None:
    if getattr(decoder, "_cosmos3_fused_norms", False):
        return
    # The layout this plan is written for (diffusers 0.42.1, pinned; tests/test_vae.py compares fused and unfused
    # decodes): the SiLU follows norm1 and norm2 in every residual block and norm_out in the decoder head, nowhere
    # else; the attention block's norm has none.
    silu_norms, plain_norms, silu_owners = [], [], []
    for module in decoder.modules():
        if isinstance(module, (WanResidualBlock, WanDecoder3d)):
            names = ["norm1", "norm2"] if isinstance(module, WanResidualBlock) else ["norm_out"]
            if type(module.nonlinearity) is not torch.nn.SiLU or "forward" in vars(module):
                raise NotImplementedError(
                    f"fuse_decoder_norms: expected {type(module).__name__} with diffusers' own forward and an "
                    f"nn.SiLU nonlinearity, got nonlinearity {type(module.nonlinearity).__name__}"
                    + (" and a replaced forward" if "forward" in vars(module) else "")
                )
            silu_norms += [getattr(module, name) for name in names]
            silu_owners.append(module)
        elif isinstance(module, WanAttentionBlock):
            plain_norms.append(module.norm)
    planned = {id(norm) for norm in silu_norms + plain_norms}
    all_norms = [module for module in decoder.modules() if isinstance(module, WanRMS_norm)]
    if len(planned) != len(silu_norms) + len(plain_norms) or planned != {id(norm) for norm in all_norms}:
        raise NotImplementedError("fuse_decoder_norms: the decoder has RMS norms outside the known Wan layout")
    for norm in all_norms:
        if not norm.channel_first or "forward" in vars(norm):
            raise NotImplementedError("fuse_decoder_norms: expected diffusers' channel-first WanRMS_norm")
    forward = _fused_norm_forward if compiled else _eager_norm_forward
    for norms, silu in ((silu_norms, True), (plain_norms, False)):
        for norm in norms:
            norm.forward = functools.partial(forward, norm, silu=silu)
    for owner in silu_owners:
        owner.nonlinearity = torch.nn.Identity()  # its SiLU is now inside the fused norm(s) before it
    # nn.Module.__setattr__ is typed for tensors and modules only; any other value is stored as a plain attribute.
    decoder._cosmos3_fused_norms = True  # type: ignore[assignment]


def _check_latent_stats(config) -> None:
    for field in ("latents_mean", "latents_std"):
        values = getattr(config, field, None)
        if values is None or len(values) != config.z_dim:
            raise CheckpointError(f"vae/config.json {field}: expected {config.z_dim} values (z_dim), got {values!r}")
    if any(not value > 0 for value in config.latents_std):
        raise CheckpointError(f"vae/config.json latents_std: expected positive values, got {config.latents_std}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)}"
    return type(value).__name__
