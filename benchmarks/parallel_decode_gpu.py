"""Tile-parallel VAE decode on W GPUs against the single-GPU decode, in the same run: the Wan2.2 VAE (random weights)
decoding a 480x832, chunk-32 latent (33 frames), for each VAE dtype and each ``decode_chunk_frames`` (1: diffusers'
frame-by-frame loop; 4: four latent frames per decoder pass, which also cuts the exact mode's halo exchanges per
frame by four).

    python -m torch.distributed.run --standalone --nproc_per_node=4 benchmarks/parallel_decode_gpu.py --out $OUT
    python -m torch.distributed.run --standalone --nproc_per_node=4 benchmarks/parallel_decode_gpu.py --tiny  # CPU

The untiled decode runs on rank 0 while the other ranks wait (the 1-GPU baseline); then every rank decodes its tile,
exact (halo exchange per convolution, gathered attention; the engine's mode) and approximate (halo 2, feathered).
The speed-ups and the errors against the untiled pixels are rank 0's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import (  # noqa: E402
    add_output_arguments,
    check_results_target,
    init_distributed,
    provenance,
    timed_ms,
    write_results,
)
from parallel_gpu import WAN22_VAE, build_vae, synchronize  # noqa: E402

from cosmos3_gym.models.vae import Cosmos3VAE  # noqa: E402
from cosmos3_gym.parallel.vae_decode import decode_tile_parallel  # noqa: E402
from cosmos3_gym.testing import TINY_VAE_CONFIG  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny VAE on the CPU with gloo (checks the script)")
    parser.add_argument("--chunk-frames", default="1,4", help="decode_chunk_frames values to measure")
    parser.add_argument("--repeats", type=int, default=3)
    add_output_arguments(parser)  # writes parallel_decode_world{W}.json there
    args = parser.parse_args()
    use_nccl = torch.cuda.is_available() and not args.tiny
    if use_nccl:
        torch.backends.cudnn.benchmark = True
    rank, world, device = init_distributed(use_cuda=use_nccl)
    if not dist.is_initialized():
        raise SystemExit("parallel_decode_gpu.py: launch it with torchrun (python -m torch.distributed.run ...)")
    results_name = f"parallel_decode_world{world}.json"
    if rank == 0:
        check_results_target(results_name, args.out, args.overwrite)
    if args.tiny:
        config = {**TINY_VAE_CONFIG, "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}
        height, width, chunk = 128, 192, 8
    else:
        config, height, width, chunk = WAN22_VAE, 480, 832, 32
    base = build_vae(config, device)
    shape = (1, base.latent_channels, chunk // 4 + 1, height // 16, width // 16)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    report = {"provenance": provenance(), "world_size": world, "latent_shape": list(shape), "results": {}}
    dtypes = (torch.float32,) if args.tiny else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        weights = base.vae.to(dtype)
        for chunk_frames in (int(c) for c in args.chunk_frames.split(",")):
            vae = Cosmos3VAE(weights, decode_chunk_frames=chunk_frames).to(device)
            entry = {}
            with torch.inference_mode():
                untiled, ms = timed_ms(lambda: vae.decode(latents), args.repeats, 1)
                if rank == 0:
                    entry["untiled_1_gpu_ms"] = statistics.median(ms)
                synchronize(device)
                for name, exact in (("exact", True), ("approximate_halo2", False)):
                    out, ms = timed_ms(
                        lambda: decode_tile_parallel(vae, latents, dist.group.WORLD, halo=2, exact=exact),
                        args.repeats, 1, barrier=True,
                    )
                    if rank == 0:
                        error = (out - untiled).abs()
                        entry[name] = {"ms": statistics.median(ms),
                                       "speedup_vs_1_gpu": entry["untiled_1_gpu_ms"] / statistics.median(ms),
                                       "max_abs_error_vs_untiled": float(error.max()),
                                       "mean_abs_error_vs_untiled": float(error.mean())}
            key = f"{str(dtype).removeprefix('torch.')}_chunk{chunk_frames}"
            report["results"][key] = entry
            if rank == 0:
                print(key, entry, flush=True)
    if rank == 0:
        write_results(report, results_name, args.out, args.overwrite)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
