"""Cosmos3VAE against the numerics of diffusers' Cosmos3OmniPipeline, on a tiny random Wan2.2-shaped VAE."""

import copy
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock, WanRMS_norm
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline
from diffusers.video_processor import VideoProcessor

from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.models.vae import Cosmos3VAE, TileConfig

Z_DIM = 16
FRAMES, HEIGHT, WIDTH = 5, 64, 96  # latent (2, 4, 6)


def build_tiny_wan22_vae(seed: int = 0) -> AutoencoderKLWan:
    """The Wan2.2 VAE layout (residual, patch 2, 16x spatial / 4x temporal) with small widths and random weights."""
    generator = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=12,
        z_dim=Z_DIM,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=torch.randn(Z_DIM, generator=generator).tolist(),
        latents_std=(0.5 + torch.rand(Z_DIM, generator=generator)).tolist(),
    )
    # Re-draw every weight so that no layer is an identity or zero map (fan-in scaling keeps activations O(1)).
    with torch.no_grad():
        for name, param in vae.named_parameters():
            if param.ndim > 1:
                param.copy_(torch.randn(param.shape, generator=generator) / param[0].numel() ** 0.5)
            elif name.endswith("gamma"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return vae


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoint") / "vae"
    build_tiny_wan22_vae().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vae(vae_dir):
    torch.set_num_threads(1)
    return Cosmos3VAE.from_pretrained(vae_dir)


@pytest.fixture(scope="module")
def vae_bf16(vae_dir):
    return Cosmos3VAE.from_pretrained(vae_dir, dtype=torch.bfloat16)


def random_pixels(batch: int = 1, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, FRAMES, HEIGHT, WIDTH, generator=generator) * 2 - 1


def random_latents(batch: int = 1, seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, Z_DIM, 2, HEIGHT // 16, WIDTH // 16, generator=generator)


def pipeline_stand_in(vae: AutoencoderKLWan) -> SimpleNamespace:
    """The attributes that Cosmos3OmniPipeline's VAE code reads, built as in Cosmos3OmniPipeline.__init__."""
    return SimpleNamespace(
        vae=vae,
        _vae_latents_mean=torch.tensor(vae.config.latents_mean, dtype=vae.dtype),
        _vae_latents_inv_std=1.0 / torch.tensor(vae.config.latents_std, dtype=vae.dtype),
    )


def pipeline_encode(vae: AutoencoderKLWan, pixels: torch.Tensor) -> torch.Tensor:
    """diffusers' own Cosmos3OmniPipeline._encode_video, then `.contiguous().float()` as its __call__ does."""
    with torch.no_grad():
        return Cosmos3OmniPipeline._encode_video(pipeline_stand_in(vae), pixels).contiguous().float()


def pipeline_decode(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """The decode at the end of Cosmos3OmniPipeline.__call__ (copied), with postprocess_video's "pt" output."""
    stand_in = pipeline_stand_in(vae)
    with torch.no_grad():
        in_dtype = latents.dtype
        dtype = vae.dtype
        mean = stand_in._vae_latents_mean.to(device=latents.device, dtype=dtype)
        inv_std = stand_in._vae_latents_inv_std.to(device=latents.device, dtype=dtype)
        z_raw = latents.to(dtype) / inv_std.view(1, -1, 1, 1, 1) + mean.view(1, -1, 1, 1, 1)
        decoded = vae.decode(z_raw).sample.to(in_dtype)
        video = VideoProcessor(vae_scale_factor=16).postprocess_video(decoded, output_type="pt")
    return video.permute(0, 2, 1, 3, 4).float()  # postprocess_video gives [B, T, 3, H, W]


def test_loads_with_config_geometry_and_pipeline_statistics(vae, vae_bf16, vae_dir):
    assert isinstance(vae.vae, AutoencoderKLWan)
    assert (vae.latent_channels, vae.spatial_compression, vae.temporal_compression) == (Z_DIM, 16, 4)
    assert vae.latent_shape(FRAMES, HEIGHT, WIDTH) == (2, 4, 6)
    assert vae.latent_shape(33, 544, 736) == (9, 34, 46)
    for wrapper in (vae, vae_bf16):
        reference = pipeline_stand_in(wrapper.vae)
        assert wrapper.latents_mean.dtype == wrapper.latents_inv_std.dtype == wrapper.vae.dtype
        assert torch.equal(wrapper.latents_mean, reference._vae_latents_mean)
        assert torch.equal(wrapper.latents_inv_std, reference._vae_latents_inv_std)
    # Saved weights come back unchanged.
    original = build_tiny_wan22_vae().state_dict()
    assert all(torch.equal(original[key], value) for key, value in vae.vae.state_dict().items())


@pytest.mark.parametrize("pixel_dtype", [torch.float32, torch.bfloat16])
def test_encode_equals_pipeline_encode(vae, pixel_dtype):
    pixels = random_pixels().to(pixel_dtype)
    latents = vae.encode(pixels)
    assert latents.dtype == torch.float32 and latents.shape == (1, Z_DIM, 2, 4, 6)
    assert torch.equal(latents, pipeline_encode(vae.vae, pixels))


def test_encode_equals_pipeline_encode_bf16_vae(vae_bf16):
    pixels = random_pixels()
    assert torch.equal(vae_bf16.encode(pixels), pipeline_encode(vae_bf16.vae, pixels))


def test_encode_normalises_the_posterior_mean(vae):
    pixels = random_pixels()
    latents = vae.encode(pixels).double()
    with torch.no_grad():
        raw_mu = vae.vae.encode(pixels).latent_dist.mode().double()
    mean = torch.tensor(vae.vae.config.latents_mean, dtype=torch.float64).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.vae.config.latents_std, dtype=torch.float64).view(1, -1, 1, 1, 1)
    assert torch.allclose(latents, (raw_mu - mean) / std, rtol=1e-5, atol=1e-5)
    # Each wrong handling is far off: raw latents, mean only, multiplying by std instead of dividing.
    for wrong in (raw_mu, raw_mu - mean, (raw_mu - mean) * std):
        assert (latents - wrong).abs().max() > 0.1


def test_first_frame_alone_encodes_to_the_clips_first_latent_frame(vae):
    """The Wan VAE is causal in time, so the engine may encode only the clean first frame."""
    pixels = random_pixels()
    clip_latents = vae.encode(pixels)
    first_frame_latents = vae.encode(pixels[:, :, :1])
    assert first_frame_latents.shape == (1, Z_DIM, 1, 4, 6)
    relative_error = (first_frame_latents - clip_latents[:, :, :1]).abs().max() / clip_latents.abs().max()
    assert relative_error < 1e-6, relative_error  # bit-exact on CPU (float32, torch 2.13)
    # The later latent frames do depend on the later pixels (the check above is not vacuous).
    changed = pixels.clone()
    changed[:, :, 1:] = -changed[:, :, 1:]
    assert (vae.encode(changed)[:, :, 1] - clip_latents[:, :, 1]).abs().max() > 0.1


def test_decode_equals_pipeline_decode(vae):
    latents = random_latents()
    pixels = vae.decode(latents)
    assert pixels.dtype == torch.float32 and pixels.shape == (1, 3, FRAMES, HEIGHT, WIDTH)
    assert 0 <= pixels.min() and pixels.max() <= 1 and pixels.std() > 0.05
    assert torch.equal(pixels, pipeline_decode(vae.vae, latents))


@pytest.mark.parametrize("latent_dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_pipeline_decode_bf16_vae(vae_bf16, latent_dtype):
    # A 2x3 latent (32x48 pixels): CPU bf16 convolutions are slow; the same untiled decode, compared bit for bit.
    latents = random_latents()[..., :2, :3].contiguous().to(latent_dtype)
    assert torch.equal(vae_bf16.decode(latents), pipeline_decode(vae_bf16.vae, latents))


@pytest.mark.parametrize("chunk_frames", [1, 2, 3, None, "auto"])
def test_chunked_decode_equals_pipeline_frame_by_frame_decode(vae, chunk_frames):
    """Decoding several latent frames per pass continues diffusers' causal cache exactly (6 latent frames: chunks of
    2 and 3 leave a partial last chunk, None decodes frames 1-5 in one pass)."""
    latents = torch.randn(2, Z_DIM, 6, 4, 6, generator=torch.Generator().manual_seed(3))
    reference = pipeline_decode(vae.vae, latents)
    default = vae.decode_chunk_frames
    vae.decode_chunk_frames = chunk_frames
    try:
        pixels = vae.decode(latents)
    finally:
        vae.decode_chunk_frames = default
    assert pixels.shape == reference.shape == (2, 3, 21, 64, 96)
    # The last frames depend on the whole history through the cache: a chunk boundary handled wrongly shows here.
    assert (reference[:, :, 5:] - reference[:, :, 5:].mean()).abs().mean() > 0.05
    if chunk_frames == 1:
        assert torch.equal(pixels, reference)
    else:
        assert (pixels - reference).abs().max() < 1e-5


@pytest.mark.parametrize("batch,passes", [(1, 3), (2, 4), (4, 6)])
def test_auto_chunks_hold_four_latent_frames_per_pass_over_the_batch(vae, batch, passes):
    # 6 latent frames: the first alone, then 4 // batch frames per pass (batch 1: 1 + 4 + 1 frames; 4: one by one).
    calls = []
    hook = vae.vae.decoder.register_forward_pre_hook(lambda module, args, kwargs: calls.append(args[0].shape[2]),
                                                     with_kwargs=True)
    try:
        vae.decode(torch.randn(batch, Z_DIM, 6, 1, 1))
    finally:
        hook.remove()
    assert vae.decode_chunk_frames == "auto" and len(calls) == passes and sum(calls) == 6


def test_decode_chunk_frames_is_validated(vae):
    for bad in (0, -1, 2.0, True, "4", "all"):
        with pytest.raises(InputError, match="decode_chunk_frames"):
            vae.decode_chunk_frames = bad


def test_decode_inverts_the_normalisation(vae):
    """Decoding encode(x) is the VAE's own reconstruction of x, so the (de)normalisation round-trips."""
    pixels = random_pixels()
    with torch.no_grad():
        reconstruction = vae.vae.decode(vae.vae.encode(pixels).latent_dist.mode()).sample / 2 + 0.5
    assert torch.allclose(vae.decode(vae.encode(pixels)), reconstruction, atol=1e-5)


def test_batch_equals_each_item_alone(vae):
    pixels = random_pixels(batch=3)
    latents = vae.encode(pixels)
    decoded = vae.decode(latents)
    for item in range(3):
        assert torch.allclose(latents[item : item + 1], vae.encode(pixels[item : item + 1]), rtol=0, atol=1e-5)
        assert torch.allclose(decoded[item : item + 1], vae.decode(latents[item : item + 1]), rtol=0, atol=1e-5)


def test_tiled_decode_is_diffusers_tiling_within_its_blend_bound(vae):
    """Tiled decode is approximate; its error is bounded by the worst single tile.

    diffusers decodes each tile alone (values c_k after the clamp) and writes, at every pixel, a convex combination
    of the tiles covering it (linear blend weights in [0, 1], summing to 1), clamped. A clamp of a convex combination
    lies between the smallest and largest c_k at that pixel, so |tiled - untiled| is at most the largest
    |c_k - untiled| over the tiles that cover the pixel; the [0, 1] rescale scales both sides alike. The test builds
    that per-pixel bound from the tiles decoded one by one and checks it, up to float rounding.
    """
    latents = random_latents()  # 4 x 6 latent pixels
    tile = TileConfig(tile_latent_h=3, tile_latent_w=4, overlap_latent=1)
    tiled = vae.decode(latents, tile=tile)
    untiled = vae.decode(latents)
    assert not vae.vae.use_tiling  # tiling was only for that call

    # It is diffusers' tiling with the tile and stride converted to pixels.
    vae.vae.enable_tiling(
        tile_sample_min_height=48, tile_sample_min_width=64, tile_sample_stride_height=32, tile_sample_stride_width=48
    )
    try:
        assert torch.equal(tiled, pipeline_decode(vae.vae, latents))
    finally:
        vae.vae.disable_tiling()

    stride_h, stride_w = tile.tile_latent_h - tile.overlap_latent, tile.tile_latent_w - tile.overlap_latent
    bound = torch.zeros_like(untiled)
    for top in range(0, latents.shape[3], stride_h):
        for left in range(0, latents.shape[4], stride_w):
            tile_pixels = vae.decode(latents[..., top : top + tile.tile_latent_h, left : left + tile.tile_latent_w])
            rows = slice(16 * top, 16 * top + tile_pixels.shape[3])
            cols = slice(16 * left, 16 * left + tile_pixels.shape[4])
            bound[..., rows, cols] = torch.maximum(bound[..., rows, cols],
                                                   (tile_pixels - untiled[..., rows, cols]).abs())
    error = (tiled - untiled).abs()
    print(f"tiled vs untiled decode: max abs error {error.max():.4f} (per-pixel bound max {bound.max():.4f})")
    assert error.max() > 1e-3  # the tiles really were decoded apart
    assert (error <= bound + 1e-5).all(), (error - bound).max()


def test_tile_covering_the_latent_is_the_untiled_decode(vae):
    latents = random_latents()
    assert torch.equal(vae.decode(latents, tile=TileConfig(4, 6, 2)), vae.decode(latents))


def test_bad_input_is_rejected_naming_the_field(vae, vae_dir, tmp_path):
    with pytest.raises(InputError, match="pixels"):
        vae.encode(torch.zeros(1, 3, 4, HEIGHT, WIDTH))  # 4 frames is not 1 + 4k
    with pytest.raises(InputError, match="pixels"):
        vae.encode(torch.zeros(1, 3, 1, 40, WIDTH))  # 40 is not a multiple of 16
    with pytest.raises(InputError, match="pixels"):
        vae.encode(torch.zeros(3, 1, HEIGHT, WIDTH))
    with pytest.raises(InputError, match="pixels"):
        vae.encode(torch.zeros(1, 3, 1, HEIGHT, WIDTH, dtype=torch.uint8))
    with pytest.raises(InputError, match="num_frames"):
        vae.latent_shape(2, HEIGHT, WIDTH)
    with pytest.raises(InputError, match="latents"):
        vae.decode(torch.zeros(1, Z_DIM + 1, 1, 4, 6))
    with pytest.raises(InputError, match="overlap_latent"):
        TileConfig(2, 4, 2)
    with pytest.raises(InputError, match="tile_latent_w"):
        TileConfig(2, 0, 0)

    with pytest.raises(CheckpointError, match="missing"):
        Cosmos3VAE.from_pretrained(tmp_path / "missing")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((vae_dir / "config.json").read_text())
    (broken / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="broken"):
        Cosmos3VAE.from_pretrained(broken)
    with pytest.raises(CheckpointError, match="latents_std"):
        Cosmos3VAE(AutoencoderKLWan(base_dim=8, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0, 1.0, 0.0, 1.0]))


# ---- fuse_decoder_norms: one compiled kernel per RMS norm (+ the SiLU after it) in the decoder -----------------------


def fused_and_plain(wrapper: Cosmos3VAE, chunk_frames: int | None = 4, channels_last: bool = False):
    """A fused-norm copy of the (shared, module-scoped) VAE and an unfused copy with the same layout."""
    plain = Cosmos3VAE(copy.deepcopy(wrapper.vae), decode_chunk_frames=chunk_frames)
    if channels_last:
        plain.use_channels_last()
    fused = Cosmos3VAE(copy.deepcopy(plain.vae), decode_chunk_frames=chunk_frames).fuse_decoder_norms()
    return fused, plain


def multi_frame_latents(batch: int = 2, frames: int = 6, seed: int = 4,
                        size: tuple[int, int] = (4, 6)) -> torch.Tensor:
    return torch.randn(batch, Z_DIM, frames, *size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk_frames, channels_last", [(1, False), (4, False), (None, False), (4, True)])
def test_fused_decoder_norms_equal_unfused_decode(vae, chunk_frames, channels_last):
    fused, plain = fused_and_plain(vae, chunk_frames, channels_last)
    latents = multi_frame_latents()
    pixels, reference = fused.decode(latents), plain.decode(latents)
    assert pixels.shape == reference.shape == (2, 3, 21, 64, 96)
    error = (pixels - reference).abs().max()
    print(f"fused norms, float32, chunk {chunk_frames}, channels_last {channels_last}: max abs {error:.2e}")
    assert error < 1e-5  # measured <= 2.1e-6 on CPU (torch 2.13): float32 summation order only


@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_decoder_norms_bf16_within_rounding(vae, vae_bf16, channels_last):
    fused, plain = fused_and_plain(vae_bf16, 4, channels_last)
    # A 2x3 latent (32x48 pixels): CPU bf16 convolutions are slow (17 s a decode at 4x6); the same norms, layouts,
    # batch 2 and two chunks (4 + 2 latent frames).
    latents = multi_frame_latents(size=(2, 3))
    pixels, reference = fused.decode(latents), plain.decode(latents)
    error = (pixels - reference).abs()
    print(f"fused norms, bfloat16, channels_last {channels_last}: max abs {error.max():.4f} mean {error.mean():.1e}")
    if not channels_last:
        # Measured on CPU (torch 2.13): 0, bit-exact, thanks to emulate_precision_casts (without it: max 0.03).
        assert error.max() < 2e-2
    else:
        # Measured: max 0.024, mean 1.0e-3 (0 on torch 2.13 CPU). The float32 channel sum runs in another order than
        # eager's channels-last reduction and may flip a few bf16 roundings, which the decoder then carries on; eager
        # bf16 channels-last vs contiguous differs as much on these inputs (max 0.013, mean 3.3e-4).
        assert error.max() < 4e-2 and error.mean() < 3e-3
    # Either way the fused bf16 decode is as close to the float32 decode as diffusers' own bf16 decode is
    # (mean abs 2.8e-3 for both).
    exact = vae.decode(latents)
    assert (pixels - exact).abs().mean() < 1.2 * (reference - exact).abs().mean()


def test_fused_decode_has_every_silu_once(vae):
    """Each norm -> SiLU site of the decoder is fused once; and on these inputs a dropped or doubled SiLU shows, so
    the equality tests above would catch one."""
    fused, plain = fused_and_plain(vae)
    decoder = fused.vae.decoder
    residual_blocks = [m for m in decoder.modules() if isinstance(m, WanResidualBlock)]
    assert not any(isinstance(m, torch.nn.SiLU) for m in decoder.modules())
    assert isinstance(decoder.nonlinearity, torch.nn.Identity)
    assert all(isinstance(block.nonlinearity, torch.nn.Identity) for block in residual_blocks)
    norms = [m for m in decoder.modules() if isinstance(m, WanRMS_norm)]
    assert len(norms) == 2 * len(residual_blocks) + 2 and all("forward" in vars(norm) for norm in norms)

    latents = multi_frame_latents(batch=1, frames=3)
    reference = plain.decode(latents)
    assert (fused.decode(latents) - reference).abs().max() < 1e-5
    block = residual_blocks[len(residual_blocks) // 2]
    block.nonlinearity = torch.nn.SiLU()  # SiLU twice after this block's norms
    assert (fused.decode(latents) - reference).abs().max() > 0.02
    block.nonlinearity = torch.nn.Identity()
    decoder.nonlinearity = torch.nn.SiLU()  # twice in the head
    assert (fused.decode(latents) - reference).abs().max() > 0.02
    plain.vae.decoder.nonlinearity = torch.nn.Identity()  # dropped in the head
    assert (plain.decode(latents) - reference).abs().max() > 0.02


def test_fuse_decoder_norms_twice_is_harmless_and_leaves_the_encoder(vae):
    wrapper = Cosmos3VAE(copy.deepcopy(vae.vae))
    pixels, latents = random_pixels(), multi_frame_latents(batch=1, frames=2)
    encoded = wrapper.encode(pixels)
    state = {key: value.clone() for key, value in wrapper.vae.state_dict().items()}
    assert wrapper.fuse_decoder_norms() is wrapper
    norm_forwards = [m.forward for m in wrapper.vae.decoder.modules() if isinstance(m, WanRMS_norm)]
    once = wrapper.decode(latents)
    assert wrapper.fuse_decoder_norms() is wrapper
    assert norm_forwards == [m.forward for m in wrapper.vae.decoder.modules() if isinstance(m, WanRMS_norm)]
    assert torch.equal(wrapper.decode(latents), once)
    # A deep copy keeps the fusion bound to its own modules (the benchmark copies VAEs).
    assert torch.equal(Cosmos3VAE(copy.deepcopy(wrapper.vae)).decode(latents), once)
    # The encoder and the weights are untouched.
    assert torch.equal(wrapper.encode(pixels), encoded)
    for module in wrapper.vae.encoder.modules():
        assert "forward" not in vars(module)
        if isinstance(module, WanResidualBlock):
            assert type(module.nonlinearity) is torch.nn.SiLU
    assert type(wrapper.vae.encoder.nonlinearity) is torch.nn.SiLU
    new_state = wrapper.vae.state_dict()
    assert new_state.keys() == state.keys() and all(torch.equal(new_state[k], v) for k, v in state.items())


def test_fused_norms_share_graphs_across_shapes(vae, vae_bf16):
    """Widths, frame counts, batch sizes and chunk sizes must not blow dynamo's recompile limit (defaults)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def decode_many(wrapper, shapes):
        for batch, frames, chunk in shapes:
            wrapper.decode_chunk_frames = chunk
            wrapper.decode(torch.randn(batch, Z_DIM, frames, 2, 3, generator=torch.Generator().manual_seed(batch)))

    shapes = [(1, 1, 4), (1, 3, 1), (3, 6, 4), (2, 2, None)]
    for wrapper, channels_last in ((vae, False), (vae, True), (vae_bf16, False)):
        decode_many(fused_and_plain(wrapper, channels_last=channels_last)[0], shapes)
    graphs = counters["stats"]["unique_graphs"]
    print(f"fused norms: {graphs} graphs compiled for float32 (contiguous and channels-last) and bfloat16")
    # Measured 11 (torch 2.13 CPU): at most, per dtype and function one graph for each size-1 pattern of
    # [outer, C, inner]: outer == 1 (batch 1), neither, inner == 1 (channels-last).
    assert 0 < graphs <= 12
    decode_many(fused_and_plain(vae)[0], [(5, 7, 2), (1, 9, 3)])  # new shapes reuse the graphs
    assert counters["stats"]["unique_graphs"] == graphs
    assert not [key for key in counters["unimplemented"] if "recompile" in key.lower()]


# ---- the fast paths of the env: last-frame decode, direct convolutions, eager fused norms, optimize() ---------------


@pytest.mark.parametrize("chunk_frames", [1, 2, None, "auto"])
def test_last_frame_decode_is_the_full_decodes_last_frame(vae, chunk_frames):
    """The head runs only for the last frame (and not at all in the earlier passes); the causal cache still carries
    every latent frame, so the last frame must match the full decode's, which depends on all of them."""
    latents = torch.randn(2, Z_DIM, 4, 4, 6, generator=torch.Generator().manual_seed(5))
    wrapper = Cosmos3VAE(copy.deepcopy(vae.vae), decode_chunk_frames=chunk_frames)
    full = wrapper.decode(latents)
    last = wrapper.decode(latents, frames="last")
    assert last.shape == (2, 3, 1, 64, 96)
    assert (last - full[:, :, -1:]).abs().max() < 1e-5
    # The other frames differ from the last one: selecting the wrong frame would show.
    assert (full[:, :, -2:-1] - full[:, :, -1:]).abs().max() > 0.05
    # A changed first latent frame changes the last frame (through the cache), in both decodes alike.
    changed = latents.clone()
    changed[:, :, 0] += 1.0
    assert (wrapper.decode(changed, frames="last") - last).abs().max() > 1e-3
    # One latent frame: decoded whole (the single pass has no earlier frames for conv_out's cache).
    single = latents[:, :, :1]
    assert torch.equal(wrapper.decode(single, frames="last"), wrapper.decode(single))
    with pytest.raises(InputError, match="frames"):
        wrapper.decode(latents, frames="first")


def test_last_frame_decode_runs_the_head_once(vae):
    calls = []
    wrapper = Cosmos3VAE(copy.deepcopy(vae.vae), decode_chunk_frames=1)
    hook = wrapper.vae.decoder.conv_out.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[2]))
    try:
        wrapper.decode(multi_frame_latents(frames=3), frames="last")
    finally:
        hook.remove()
    assert calls == [1]  # one frame in, with the two cached frames beside it


@pytest.mark.parametrize("chunk_frames", [1, 4])
def test_direct_convolutions_and_eager_norms_equal_diffusers(vae, chunk_frames):
    plain = Cosmos3VAE(copy.deepcopy(vae.vae), decode_chunk_frames=chunk_frames)
    fast = Cosmos3VAE(copy.deepcopy(vae.vae), decode_chunk_frames=chunk_frames).use_direct_convolutions()
    fast.use_channels_last().fuse_decoder_norms(compile=False)
    for batch in (1, 3):  # batch 1: the convolutions PyTorch would send to slow_conv3d
        latents = multi_frame_latents(batch=batch)
        reference = plain.decode(latents)
        assert (fast.decode(latents) - reference).abs().max() < 1e-5
        assert (fast.decode(latents, frames="last") - reference[:, :, -1:]).abs().max() < 1e-5
    # The eager norms are diffusers' float32 ops in diffusers' order: bit-identical on one input.
    norm = next(m for m in plain.vae.decoder.modules() if isinstance(m, WanRMS_norm) and m.gamma.ndim == 4)
    x = torch.randn(2, norm.gamma.shape[0], 3, 4, 5).contiguous(memory_format=torch.channels_last_3d)
    from cosmos3_gym.models.vae import _eager_norm_forward

    with torch.no_grad():
        expected = torch.nn.functional.silu(WanRMS_norm.forward(norm, x))
        assert torch.equal(_eager_norm_forward(norm, x, silu=True), expected)
    # The encoder is untouched; a second call changes nothing.
    assert all(type(m).__name__ != "_DirectCausalConv3d" for m in fast.vae.encoder.modules())
    latents = multi_frame_latents()
    once = fast.decode(latents)
    fast.use_direct_convolutions().fuse_decoder_norms(compile=False)
    assert torch.equal(fast.decode(latents), once)


def test_optimize_on_cpu_is_the_eager_fast_path(vae):
    fast = Cosmos3VAE(copy.deepcopy(vae.vae)).optimize()
    assert fast.decode_chunk_frames == 1
    conv = fast.vae.decoder.conv_in
    assert type(conv).__name__ == "_DirectCausalConv3d"
    assert conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert isinstance(fast.vae.decoder.nonlinearity, torch.nn.Identity)  # fused into norm_out
    latents = multi_frame_latents()
    assert (fast.decode(latents) - vae.decode(latents)).abs().max() < 1e-5


def test_optimized_encoder_equals_diffusers(vae):
    fast = Cosmos3VAE(copy.deepcopy(vae.vae)).optimize_encoder()
    for batch in (1, 2):
        pixels = random_pixels(batch)
        assert (fast.encode(pixels) - vae.encode(pixels)).abs().max() < 1e-5
        assert (fast.encode(pixels[:, :, :1]) - vae.encode(pixels[:, :, :1])).abs().max() < 1e-5
