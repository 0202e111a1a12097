"""Tile-parallel VAE decode on W GPUs against the single-GPU decode, in the same run: the Wan2.2 VAE (random weights)
decoding a 480x832, chunk-32 latent (33 frames), for each VAE dtype and each ``decode_chunk_frames`` (1: diffusers'
frame-by-frame loop; 4: four latent frames per decoder pass, which also cuts the exact mode's halo exchanges per
frame by four).

    python -m torch.distributed.run --standalone --nproc_per_node=4 benchmarks/parallel_decode_gpu.py --out $OUT/x.json
    python -m torch.distributed.run --standalone --nproc_per_node=4 benchmarks/parallel_decode_gpu.py --tiny  # CPU

The untiled decode runs on rank 0 while the other ranks wait (the 1-GPU baseline); then every rank decodes its tile,
exact (halo exchange per convolution, gathered attention; the engine's mode) and approximate (halo 2, feathered).
The speed-ups and the errors against the untiled pixels are rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import provenance  # noqa: E402
from parallel_gpu import WAN22_VAE, build_vae, synchronize, timed  # noqa: E402

from cosmos3_gym.checkpoint import TINY_VAE_CONFIG  # noqa: E402
from cosmos3_gym.models.vae import Cosmos3VAE  # noqa: E402
from cosmos3_gym.parallel.vae_decode import decode_tile_parallel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny VAE on the CPU with gloo (checks the script)")
    parser.add_argument("--chunk-frames", default="1,4", help="decode_chunk_frames values to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/parallel_decode_world{W}.json)")
    args = parser.parse_args()
    use_nccl = torch.cuda.is_available() and not args.tiny
    if use_nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cudnn.benchmark = True
    dist.init_process_group("nccl" if use_nccl else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_nccl else torch.device("cpu")
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
                untiled, ms = timed(lambda: vae.decode(latents), device, 1, args.repeats, all_ranks=False)
                if rank == 0:
                    entry["untiled_1_gpu_ms"] = statistics.median(ms)
                synchronize(device)
                for name, exact in (("exact", True), ("approximate_halo2", False)):
                    out, ms = timed(lambda: decode_tile_parallel(vae, latents, dist.group.WORLD, halo=2, exact=exact),
                                    device, 1, args.repeats, all_ranks=True)
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
        out = Path(args.out or Path(os.environ.get("OUT", "benchmarks/results")) / f"parallel_decode_world{world}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"wrote {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
