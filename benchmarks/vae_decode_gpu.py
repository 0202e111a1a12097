"""Wan2.2 VAE decode speed: diffusers' frame-by-frame loop against chunked decoding, channels-last weights, fused
RMS-norm + SiLU kernels (``Cosmos3VAE.fuse_decoder_norms``, torch.compile), on one GPU, in bf16, with the error of
each variant against diffusers' own decode.

    python benchmarks/vae_decode_gpu.py --out $OUT          # full Wan2.2 VAE, random weights, one GPU
    python benchmarks/vae_decode_gpu.py --tiny              # the script itself, tiny VAE on the CPU
    python benchmarks/vae_decode_gpu.py --shapes tier256_b16 \
        --variants diffusers,auto_fused_norms,auto_fused_norms_streams2,auto_fused_norms_streams4 \
        --out $OUT                                          # issue 23: parallel streams

Shapes: a 33-frame chunk at tier 480 (480x832, batch 1: a policy request) and at tier 256 (256x256, batch 1 and 16:
the vector env). Every variant decodes the same normalised latents; ``max_abs`` / ``mean_abs`` compare its pixels in
[0, 1] with diffusers' ``AutoencoderKLWan.decode`` in the same dtype. ``conv_tflop`` counts the decoder's
convolutions (2 x MACs, from the layer shapes), so ``conv_tflops_per_s / gemm_peak`` says how far the decode is from
the card's bf16 matmul ceiling. The first variant ("diffusers") is the reference for the errors and the speed-ups;
if it fails, the others are still timed and say that there was no reference.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    add_output_arguments,
    build_wan22_vae,
    check_results_target,
    gemm_peak_tflops,
    provenance,
    timed,
    write_results,
)

from cosmos3_gym.models.vae import Cosmos3VAE  # noqa: E402

SHAPES = {"tier480_b1": (1, 9, 30, 52), "tier256_b1": (1, 9, 16, 16), "tier256_b16": (16, 9, 16, 16)}
TINY_SHAPES = {"tiny_b1": (1, 5, 4, 6), "tiny_b4": (4, 5, 4, 4)}


def conv_flops(vae: Cosmos3VAE, latents: torch.Tensor) -> float:
    """2 x multiply-accumulates of every decoder convolution for one decode of ``latents``."""
    total = [0]

    def count(module, _inputs, output):
        kernel = module.weight[0, 0].numel()
        total[0] += 2 * output.numel() * module.in_channels // module.groups * kernel

    hooks = [m.register_forward_hook(count) for m in vae.vae.decoder.modules()
             if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    try:
        vae.decode(latents)
    finally:
        for hook in hooks:
            hook.remove()
    return float(total[0])


def diffusers_decode(vae: Cosmos3VAE):
    """diffusers' own decode loop (one latent frame per decoder call) with our (de)normalisation around it."""

    def decode(latents):
        dtype = vae.vae.dtype
        # The wrapper's statistics buffers stay where they were built (the CPU): moved per call, as decode() does.
        inv_std = vae.latents_inv_std.to(device=latents.device, dtype=dtype).view(1, -1, 1, 1, 1)
        mean = vae.latents_mean.to(device=latents.device, dtype=dtype).view(1, -1, 1, 1, 1)
        return (vae.vae.decode(latents.to(dtype) / inv_std + mean).sample.float() / 2 + 0.5).clamp(0, 1)

    return decode


def on_streams(decode, num_streams: int):
    """``decode`` of the batch split into ``num_streams`` parts, each issued on its own CUDA stream so that the GPU
    can run them concurrently (issue 23's "decode in parallel streams"). Only requests split this way: one request's
    latent frames cannot, as the causal decoder needs frame t-1's cached features to decode frame t (the frames-per-
    pass chunking is the exact way to put several of its frames into one kernel)."""
    streams = [torch.cuda.Stream() for _ in range(num_streams)]

    def decode_on_streams(latents):
        main = torch.cuda.current_stream()
        parts = []
        for stream, part in zip(streams, latents.chunk(num_streams)):
            stream.wait_stream(main)  # the latents are ready
            with torch.cuda.stream(stream):
                parts.append(decode(part))
        for stream, pixels in zip(streams, parts):
            main.wait_stream(stream)
            pixels.record_stream(main)  # allocated on the side stream, read on the main one
        return torch.cat(parts)

    return decode_on_streams


def variants(vae: Cosmos3VAE, streams: bool = False):
    """name -> decode function; each variant owns its copy of the weights where it changes them."""
    table = {"diffusers": diffusers_decode(vae)}
    for chunk in (1, 2, 4, None):
        table[f"chunk{chunk or 'all'}"] = Cosmos3VAE(vae.vae, decode_chunk_frames=chunk).decode
    channels_last = Cosmos3VAE(copy.deepcopy(vae.vae)).use_channels_last()
    for chunk in (4, None):
        table[f"chunk{chunk or 'all'}_channels_last"] = Cosmos3VAE(channels_last.vae, decode_chunk_frames=chunk).decode
    # Fused norm + SiLU kernels on the default (contiguous) weights: channels-last measured slower than chunk4.
    table["chunk4_fused_norms"] = Cosmos3VAE(copy.deepcopy(vae.vae), decode_chunk_frames=4).fuse_decoder_norms().decode
    # The env's default: "auto" frames per pass with the fused norms; then the same, the batch split over CUDA streams.
    default = Cosmos3VAE(copy.deepcopy(vae.vae)).fuse_decoder_norms()
    table["auto_fused_norms"] = default.decode
    if streams:
        for count in (2, 4):
            table[f"auto_fused_norms_streams{count}"] = on_streams(default.decode, count)
    # torch.compile of the whole decoder was tried on an H200 (commit a93506e): dynamo hit its recompile limit on the
    # cache-passing block forwards (one graph per width x frame count) and fell back to eager.
    return table


def subset(parser: argparse.ArgumentParser, flag: str, names: str | None, table: dict) -> dict:
    """The entries of ``table`` that the comma-separated ``names`` pick, in that order (all when None)."""
    if not names:
        return table
    unknown = sorted(set(names.split(",")) - set(table))
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; expected names from {list(table)}")
    return {name: table[name] for name in names.split(",")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny VAE on the CPU (checks the script)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=None, help=f"comma-separated subset of {list(SHAPES)} (default: all)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the variants (default: all; the "
                        "first one run is the reference of the errors and speed-ups)")
    add_output_arguments(parser)
    args = parser.parse_args()
    check_results_target("vae_decode_tiny_cpu.json" if args.tiny else "vae_decode_gpu.json", args.out, args.overwrite)
    device = "cpu" if args.tiny else "cuda"
    results: dict = {"provenance": provenance()}
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
        from test_vae import build_tiny_wan22_vae

        vae = Cosmos3VAE(build_tiny_wan22_vae().eval())
        shapes, peak = TINY_SHAPES, None
    else:
        torch.backends.cudnn.benchmark = True
        vae = Cosmos3VAE(build_wan22_vae(device, dtype=torch.bfloat16))
        shapes, peak = SHAPES, gemm_peak_tflops()
        results["gemm_bf16_tflops"] = peak
    results["dtype"] = str(vae.vae.dtype)
    table = variants(vae, streams=device == "cuda")
    table = subset(parser, "--variants", args.variants, table)
    shapes = subset(parser, "--shapes", args.shapes, shapes)
    generator = torch.Generator().manual_seed(0)
    for shape_name, (batch, t, h, w) in shapes.items():
        latents = torch.randn(batch, vae.latent_channels, t, h, w, generator=generator).to(device)
        flops = conv_flops(Cosmos3VAE(vae.vae, decode_chunk_frames=1), latents)
        entry: dict = {"latent_shape": [batch, vae.latent_channels, t, h, w], "conv_tflop": flops / 1e12}
        reference_name, reference, reference_seconds = next(iter(table)), None, None
        for name, decode in table.items():
            try:
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                with torch.no_grad():
                    pixels = decode(latents)  # also the warm-up (and the compile, for the fused norms)
                    seconds, _ = timed(lambda: decode(latents), repeats=args.repeats, warmup=0)
                result = {
                    "seconds": seconds, "conv_tflops_per_s": flops / seconds / 1e12,
                    "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
                }
                if peak:
                    result["fraction_of_gemm_peak"] = flops / seconds / 1e12 / peak
                if name == reference_name:
                    reference, reference_seconds = pixels, seconds
                if reference is not None:
                    error = (pixels - reference).abs()
                    result.update(max_abs=float(error.max()), mean_abs=float(error.mean()))
                    result[f"speedup_vs_{reference_name}"] = reference_seconds / seconds
                else:
                    result["error"] = f"no reference: {reference_name} failed, so no max_abs / mean_abs / speed-up"
                del pixels
                entry[name] = result
            except Exception as error:  # noqa: BLE001 - an OOM or compile failure is a result, not the end
                entry[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            print(shape_name, name, entry[name], flush=True)
        results[shape_name] = entry
    write_results(results, "vae_decode_tiny_cpu.json" if args.tiny else "vae_decode_gpu.json", args.out, args.overwrite)


if __name__ == "__main__":
    main()
