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

Optional tiled decode uses diffusers' own spatial tiling (``enable_tiling`` / ``tiled_decode``). It is approximate:
each tile sees neither the pixels outside it through the convolutions nor the rest of the frame through the
mid-block attention, and overlapping tiles are linearly blended.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify
from diffusers.image_processor import VaeImageProcessor

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


# Latent frames per decoder pass after the first (None: all of them in one pass). Larger chunks are faster on a GPU
# up to a point and cost activation memory linearly; see benchmarks/vae_decode_gpu.py for the measurements.
DEFAULT_DECODE_CHUNK_FRAMES = 4


class Cosmos3VAE(torch.nn.Module):
    """``AutoencoderKLWan`` with Cosmos3's latent normalisation; see the module docstring for the exact math.

    ``decode_chunk_frames``: latent frames decoded per decoder pass after the first (None: all at once; 1: exactly
    diffusers' frame-by-frame loop).
    """

    def __init__(self, vae: AutoencoderKLWan, decode_chunk_frames: int | None = DEFAULT_DECODE_CHUNK_FRAMES) -> None:
        super().__init__()
        self.vae = vae
        self.decode_chunk_frames = decode_chunk_frames
        _check_latent_stats(vae.config)
        # Built in the VAE dtype straight from the config's Python floats, as the pipeline does: building them in
        # float32 and casting later can round differently in bf16 (and 1/std would be computed in float32).
        self.register_buffer(
            "latents_mean", torch.tensor(vae.config.latents_mean, dtype=vae.dtype), persistent=False
        )
        self.register_buffer(
            "latents_inv_std", 1.0 / torch.tensor(vae.config.latents_std, dtype=vae.dtype), persistent=False
        )

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "Cosmos3VAE":
        """Load the ``vae/`` folder of a diffusers checkpoint (``config.json`` plus weights)."""
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"vae: expected a folder with config.json and the VAE weights, got {str(path)!r}")
        try:
            vae = AutoencoderKLWan.from_pretrained(path, torch_dtype=dtype)
        except Exception as error:  # diffusers raises OSError/ValueError/RuntimeError/... depending on the damage
            raise CheckpointError(f"vae: could not load AutoencoderKLWan from {str(path)!r}: {error}") from error
        return cls(vae.eval()).to(device)

    def use_channels_last(self) -> "Cosmos3VAE":
        """Store the decoder's convolution weights channels-last (NDHWC / NHWC), the layout cuDNN's bf16 tensor-core
        kernels read natively; activations follow the weights' layout. Same math, different kernels."""
        for module in self.vae.decoder.modules():
            if isinstance(module, torch.nn.Conv3d):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last_3d)
            elif isinstance(module, torch.nn.Conv2d):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last)
        return self

    @property
    def decode_chunk_frames(self) -> int | None:
        return self._decode_chunk_frames

    @decode_chunk_frames.setter
    def decode_chunk_frames(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"decode_chunk_frames: expected an int >= 1 or None (all frames at once), got {value!r}")
        self._decode_chunk_frames = value

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.z_dim)

    @property
    def spatial_compression(self) -> int:
        return int(self.vae.config.scale_factor_spatial)

    @property
    def temporal_compression(self) -> int:
        return int(self.vae.config.scale_factor_temporal)

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
        self._check_pixel_shape(*pixels.shape[2:], field="pixels")
        vae_dtype = self.vae.dtype
        raw_mu = self.vae.encode(pixels.to(vae_dtype)).latent_dist.mode()
        mean = self.latents_mean.to(device=raw_mu.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        inv_std = self.latents_inv_std.to(device=raw_mu.device, dtype=vae_dtype).view(1, -1, 1, 1, 1)
        return ((raw_mu - mean) * inv_std).to(pixels.dtype).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, tile: TileConfig | None = None) -> torch.Tensor:
        """Normalised latents ``[B, z, t, h, w]`` -> pixels ``[B, 3, 1 + 4(t-1), 16h, 16w]`` in [0, 1], float32.

        Untiled, equal to ``Cosmos3OmniPipeline``'s decode followed by ``postprocess_video(..., "pt")`` (up to the
        layout: the pipeline returns ``[B, T, 3, H, W]``). ``tile`` decodes with diffusers' spatial tiling instead,
        which is approximate (see the module docstring).
        """
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
            decoded = self._decode_in_chunks(raw_latents)
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
        return VaeImageProcessor.denormalize(decoded.to(latents.dtype)).float()

    def _decode_in_chunks(self, raw_latents: torch.Tensor) -> torch.Tensor:
        """``AutoencoderKLWan._decode`` (diffusers 0.42) with the frames after the first in chunks, not one by one.

        The first latent frame goes alone because the decoder treats it specially (``first_chunk``: it is not
        upsampled in time); every later chunk continues the causal cache exactly as single frames would.
        """
        vae = self.vae
        x = vae.post_quant_conv(raw_latents)
        num_frames = x.shape[2]
        step = self.decode_chunk_frames or max(1, num_frames - 1)
        starts = [0, *range(1, num_frames, step)]
        ends = [*starts[1:], num_frames]
        vae.clear_cache()
        try:
            pieces = []
            for start, end in zip(starts, ends):
                vae._conv_idx = [0]
                pieces.append(vae.decoder(x[:, :, start:end], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                          first_chunk=start == 0))
        finally:
            vae.clear_cache()  # the cache holds activations of the last chunk: free them
        decoded = torch.cat(pieces, dim=2)
        if vae.config.patch_size is not None:
            decoded = unpatchify(decoded, patch_size=vae.config.patch_size)
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


def _check_latent_stats(config) -> None:
    for field in ("latents_mean", "latents_std"):
        values = getattr(config, field, None)
        if values is None or len(values) != config.z_dim:
            raise CheckpointError(
                f"vae/config.json {field}: expected {config.z_dim} values (z_dim), got {values!r}"
            )
    if any(not value > 0 for value in config.latents_std):
        raise CheckpointError(f"vae/config.json latents_std: expected positive values, got {config.latents_std}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)}"
    return type(value).__name__
