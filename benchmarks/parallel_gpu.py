"""Tensor- and CFG-parallel Cosmos3 engine on 1/2/4/8 GPUs: GEN-forward and policy-request times, and correctness.

Run one process per GPU under torchrun; the script measures every layout of that world size (``--layouts``,
default: tp=W, and cfg=2 x tp=W/2 when W is even):

    python -m torch.distributed.run --standalone --nproc_per_node=4 benchmarks/parallel_gpu.py --out $OUT

The model is the full Cosmos3-Nano transformer (15.2 B parameters) with random bf16 weights, built on the meta
device and filled on rank 0, then broadcast so that every rank holds the same weights (random weights do not change
speed; performance.md §8). The VAE is the Wan2.2 VAE with random weights, the tokenizer the tiny test tokenizer
(its action prompt is ~150 tokens, as Nano's). Per layout:

- ``gen_forward_ms``: one GEN-tower forward, batch 1, 480x832, chunk 32 (3510 video + 32 action tokens, one
  prompt's text K/V), CUDA events around each call after warm-up; median over repeats, per rank;
- ``request_ms``: ``engine.step`` of one policy request at guidance 3, 4 steps, no decode (VAE encode of the
  first frame, cached prompt K/V, 4 x [cond; uncond] forwards, sampler, copies to the host);
- errors against a tp=1, cfg=1 reference computed on rank 0 with the unsharded model: relative L2 of the forward's
  video/action velocities and of the request's action and video latents (bf16 tolerance ``--tolerance``), and
  whether every rank returned bit-identical results. ``request_noise_floor_tp1`` is how far the same request moves
  on one GPU with another attention kernel (bf16 rounding, amplified by guidance 3 over 4 steps): request errors
  of that size are bf16 noise, not a parallelism bug.

``--compile`` measures every layout, the tp=1 reference included, with regionally compiled blocks
(``Cosmos3Engine.optimize(cuda_graphs=False)``), each compiled after its tensor-parallel plan is applied. A layout
name takes options: ``tp4+graphs`` replays its GEN forward as CUDA graphs (``optimize(cuda_graphs=True)``, the
all-reduces captured too), ``tp4+symm`` runs the tp all-reduces on symmetric memory (``apply_tensor_parallel(...,
all_reduce="symm_mem")``), ``tp4+overlap2`` overlaps the GEN layers' all-reduces with compute over 2 row blocks
(``overlap_communication``); ``--reference-cuda-graphs`` adds the graphed tp=1 reference.

Rank 0 writes ``parallel_gpu_world{W}.json`` to ``--out DIR`` (default ``$OUT``, else benchmarks/results).
``--tiny`` runs the same code on the tiny test configuration (CPU + gloo unless CUDA is there) to check the script
itself.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
from diffusers import AutoencoderKLWan  # noqa: E402
from PIL import Image  # noqa: E402

from cosmos3_gym.checkpoint import (  # noqa: E402
    TINY_SCHEDULER_CONFIG,
    TINY_TRANSFORMER_CONFIG,
    TINY_VAE_CONFIG,
    build_tiny_tokenizer,
)
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request  # noqa: E402
from cosmos3_gym.models.transformer import (  # noqa: E402
    Cosmos3RotaryEmbedding,
    Cosmos3Transformer,
    Cosmos3TransformerConfig,
    RMSNorm,
    TextKV,
    build_on_meta,
)
from cosmos3_gym.models.vae import Cosmos3VAE  # noqa: E402
from cosmos3_gym.parallel.mesh import ParallelConfig, ParallelContext, init_parallel  # noqa: E402
from cosmos3_gym.parallel.overlap import overlap_communication  # noqa: E402
from cosmos3_gym.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402

# Identity latent statistics: the weights are random anyway.
WAN22_VAE = dict(common.WAN22_VAE, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
# The tiny test model, widened to 8 query / 4 KV heads so that --tiny runs tp=4 too.
TINY_TRANSFORMER = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=128)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=None, help="comma-separated, e.g. tp4,cfg2tp2 (default: per world size)")
    parser.add_argument("--tiny", action="store_true", help="tiny test configuration (checks the script on CPU)")
    parser.add_argument("--height", type=int, default=None, help="input image height (default 480; tiny 200)")
    parser.add_argument("--width", type=int, default=None, help="input image width (default 832; tiny 280)")
    parser.add_argument("--chunk", type=int, default=None, help="action chunk (default 32; tiny 4)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10, help="timed GEN forwards (requests: half as many)")
    parser.add_argument("--compile", action="store_true",
                        help="regional torch.compile of the blocks (Cosmos3Engine.optimize) in every layout, the tp=1 "
                             "reference included; compiled after tensor parallelism is applied")
    parser.add_argument("--reference-cuda-graphs", action="store_true",
                        help="also measure the tp=1 reference with its GEN forward as CUDA graphs (Cosmos3Engine."
                             "optimize's default on one GPU); speedups against it are reported as well")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one GEN forward per layout on rank 0 (GPU time by kernel class, overlap)")
    parser.add_argument("--tolerance", type=float, default=2e-2, help="max relative error vs the tp=1 reference")
    common.add_output_arguments(parser)  # writes parallel_gpu_world{W}.json there
    return parser.parse_args()


def parse_layout(name: str) -> tuple[ParallelConfig, set[str]]:
    """``cfg2tp2``, ``tp4+symm+graphs``, ...: the mesh, and options: ``symm`` = the tp all-reduces on symmetric
    memory (``apply_tensor_parallel(all_reduce="symm_mem")``), ``graphs`` = the GEN forward as CUDA graphs,
    ``overlapN`` = the GEN layers' all-reduces overlapped with compute over N row blocks (``overlap_communication``),
    ``optimize`` = ``Cosmos3Engine.optimize()``
    with its defaults (on GPUs: CUDA graphs, overlapped symmetric-memory all-reduces)."""
    mesh, *options = name.split("+")
    match = re.fullmatch(r"(?:cfg(\d+))?(?:tp(\d+))?", mesh)
    if not mesh or not match or not all(re.fullmatch(r"symm|graphs|overlap\d+|optimize", o) for o in options):
        raise SystemExit(f"--layouts: expected names like tp4, cfg2, cfg2tp2, tp4+symm+graphs+overlap2; got {name!r}")
    return ParallelConfig(cfg_parallel=int(match.group(1) or 1), tp=int(match.group(2) or 1)), set(options)


def default_layouts(world: int) -> list[str]:
    return [f"tp{world}"] + ([f"cfg2tp{world // 2}" if world > 2 else "cfg2"] if world % 2 == 0 else [])


# ------------------------------------------------------------------ models with identical random weights on all ranks


def broadcast_module_(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (robust against any per-device RNG difference)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


@torch.no_grad()
def build_transformer(config: Cosmos3TransformerConfig, device, dtype, seed: int = 0) -> Cosmos3Transformer:
    """Meta-device build, then ``to_empty`` and fill on rank 0 (variance-preserving random linears, unit norms), then
    broadcast. The time embedder is fp32 as when loading a checkpoint."""
    model = build_on_meta(Cosmos3Transformer, config, dtype=dtype)
    model.to_empty(device=device)
    model.time_embedder.float()
    model.rotary = Cosmos3RotaryEmbedding(config).to(device)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name, param in model.named_parameters():
            generator = torch.Generator(device).manual_seed(seed + zlib.crc32(name.encode()))
            if name == "embed_tokens.weight":
                param.normal_(0.0, 1.0, generator=generator)
            elif name == "action_proj_in.fc.weight":  # per-domain [in * out] tables
                param.normal_(0.0, config.action_dim**-0.5, generator=generator)
            elif name == "action_proj_out.fc.weight":
                param.normal_(0.0, config.hidden_size**-0.5, generator=generator)
            elif "bias" in name or name == "action_modality_embed":
                param.normal_(0.0, 0.02, generator=generator)
            else:  # [out, in] linears
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
    broadcast_module_(model)
    return model.eval().requires_grad_(False)


def build_vae(config: dict, device) -> Cosmos3VAE:
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLWan(**config)
    vae = Cosmos3VAE(vae.eval()).to(device)
    broadcast_module_(vae)
    return vae.eval().requires_grad_(False)


# ------------------------------------------------------------------ measurements


def synchronize(device: torch.device, all_ranks: bool = True) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if all_ranks and dist.is_initialized():
        dist.barrier()


def policy_request(args) -> Cosmos3Request:
    rng = np.random.default_rng(0)
    frame = Image.fromarray(rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8))
    task = "pick up the red cube and place it in the green bowl on the left side of the table"
    return Cosmos3Request(
        "policy", frame, task, domain="droid_lerobot" if not args.tiny else "pusht", chunk=args.chunk,
        num_inference_steps=args.steps, guidance_scale=args.guidance, seed=1234,
        resolution_tier=480 if not args.tiny else 256,
    )


def gen_forward(engine: Cosmos3Engine, request: Cosmos3Request):
    """A closure running one GEN forward on fixed inputs (batch 1, the request's shapes and prompt)."""
    model, forward = engine.transformer, engine.gen_forward
    with torch.inference_mode():
        p = engine.prepare(request)
        text = TextKV.stack([engine.text_kv(p.cond_ids)])
        layout = model.gen_layout(text.lengths, p.latent_thw, request.chunk, [request.fps])
    c = model.config
    generator = torch.Generator().manual_seed(0)
    device = engine.device
    video = torch.randn(1, c.latent_channel, *p.latent_thw, generator=generator).to(device)
    actions = torch.randn(1, request.chunk, c.action_dim, generator=generator).to(device)
    video_noisy = torch.ones(1, p.latent_thw[0], dtype=torch.bool, device=device)
    video_noisy[:, 0] = False  # the conditioning frame is clean
    action_noisy = torch.ones(1, request.chunk, dtype=torch.bool, device=device)
    timesteps = torch.tensor([900], device=device)
    domain_ids = torch.tensor([p.domain_id], device=device)
    tokens = layout.num_video_tokens + layout.chunk

    def run():
        with torch.inference_mode():
            return forward(text, layout, video, video_noisy, timesteps, actions, action_noisy, domain_ids)

    return run, tokens, text.lengths[0]


def relative_error(a, b) -> float:
    a = torch.as_tensor(np.asarray(a) if not isinstance(a, torch.Tensor) else a).double().cpu()
    b = torch.as_tensor(np.asarray(b) if not isinstance(b, torch.Tensor) else b).double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def profile_forward(forward, device, rank: int) -> dict | None:
    """Rank 0's profile of one GEN forward (``profile_gpu.summarise``: GPU time by kernel class, busy time with and
    without the NCCL kernels). Every rank runs the forward (its collectives need them all); None on CPU and on the
    other ranks."""
    from profile_gpu import summarise
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda" or rank != 0:
        forward()
        return None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        forward()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    return summarise(prof, wall, top=5)


def measure(engine: Cosmos3Engine, args, device, all_ranks: bool) -> dict:
    request = policy_request(args)
    forward, tokens, text_len = gen_forward(engine, request)
    (video_v, action_v), forward_ms = common.timed_ms(forward, args.repeats, args.warmup, barrier=all_ranks)
    rank = dist.get_rank() if all_ranks and dist.is_initialized() else 0
    profile = profile_forward(forward, device, rank) if args.profile else None
    result, request_ms = common.timed_ms(
        lambda: engine.step(request, decode=False), max(2, args.repeats // 2), 1, barrier=all_ranks
    )
    return dict(
        gen_tokens=tokens, text_tokens=text_len, gen_forward_profile=profile,
        gen_forward_ms=statistics.median(forward_ms), gen_forward_ms_all=forward_ms,
        request_ms=statistics.median(request_ms), request_ms_all=request_ms,
        outputs=dict(video_velocity=video_v.float().cpu(), action_velocity=action_v.float().cpu(),
                     action=result.action, video_latents=result.video_latents),
    )


def measure_decode(vae: Cosmos3VAE, args, device, rank: int, world: int) -> dict:
    """Tile-parallel decode over all ranks (exact and approximate, halo 2) of a 480x832, chunk-32 latent, timed and
    compared with the untiled decode on rank 0. At world size 1 this is the single-rank baseline."""
    from cosmos3_gym.parallel.vae_decode import decode_tile_parallel

    g = torch.Generator().manual_seed(0)
    shape = (1, vae.latent_channels, args.chunk // 4 + 1, args.height // 16, args.width // 16)
    latents = torch.randn(shape, generator=g).to(device)
    with torch.inference_mode():
        if world == 1:
            _, ms = common.timed_ms(lambda: vae.decode(latents), 2, 1)
            return dict(tiles=1, latent_shape=list(shape), untiled_ms=statistics.median(ms), untiled_ms_all=ms)
        untiled = vae.decode(latents) if rank == 0 else None
        synchronize(device)
        report = dict(tiles=world, latent_shape=list(shape))
        for name, exact in (("exact", True), ("approximate_halo2", False)):
            out, ms = common.timed_ms(
                lambda: decode_tile_parallel(vae, latents, dist.group.WORLD, halo=2, exact=exact), 2, 1, barrier=True
            )
            entry = dict(ms=statistics.median(ms), ms_all=ms)
            if rank == 0:
                error = (out - untiled).abs()
                entry.update(max_abs_error_vs_untiled=float(error.max()), mean_abs_error_vs_untiled=float(error.mean()))
            report[name] = entry
        return report


def gather_from_ranks(value):
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def write_report(report: dict, args, world: int, rank: int) -> None:
    if rank == 0:
        common.write_results(report, f"parallel_gpu_world{world}.json", args.out, args.overwrite)


def main() -> None:
    args = parse_args()
    args.height = args.height or (200 if args.tiny else 480)
    args.width = args.width or (280 if args.tiny else 832)
    args.chunk = args.chunk or (4 if args.tiny else 32)
    rank, world, device = common.init_distributed()
    if rank == 0:
        common.check_results_target(f"parallel_gpu_world{world}.json", args.out, args.overwrite)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = torch.bfloat16
    layouts = (args.layouts.split(",") if args.layouts else default_layouts(world))
    # Every layout recompiles the shared block code for its shapes and group: more than dynamo's default 8 graphs.
    torch._dynamo.config.recompile_limit = 64
    configs = {name: parse_layout(name) for name in layouts}
    for name, (config, _) in configs.items():
        if config.world_size != world:
            raise SystemExit(f"--layouts: {name} needs {config.world_size} ranks, torchrun started {world}")

    if args.tiny:
        transformer_config = Cosmos3TransformerConfig.from_dict(
            {**TINY_TRANSFORMER_CONFIG, **TINY_TRANSFORMER, "vocab_size": 512})
        vae_config = {**TINY_VAE_CONFIG, "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}
    else:
        transformer_config = Cosmos3TransformerConfig(**common.NANO_TRANSFORMER)
        vae_config = WAN22_VAE
    tokenizer = build_tiny_tokenizer()
    vae = build_vae(vae_config, device)
    single = ParallelContext(ParallelConfig(), None, device)

    def engine_for(model, context):
        return Cosmos3Engine(model, vae, tokenizer, TINY_SCHEDULER_CONFIG, progress=False, parallel=context)

    t0 = time.perf_counter()
    model = build_transformer(transformer_config, device, dtype)
    build_s = time.perf_counter() - t0
    reference = None
    request_noise_floor = None
    reference_graphs = None
    if rank == 0:  # the unsharded model on one GPU; the other ranks wait
        reference_engine = engine_for(model, single)
        if args.compile:
            reference_engine.optimize(cuda_graphs=False)
        reference = measure(reference_engine, args, device, all_ranks=False)
        # bf16 noise floor of the request: the same request on one GPU with another attention kernel (SDPA's math
        # backend). Layouts change kernels the same way (cfg=2 runs each branch unpadded and unmasked, which picks
        # another SDPA kernel than the padded [cond; uncond] batch), and guidance 3 amplifies the rounding.
        with sdpa_kernel(SDPBackend.MATH):
            other_kernel = reference_engine.step(policy_request(args), decode=False)
        request_noise_floor = {
            "action": relative_error(other_kernel.action, reference["outputs"]["action"]),
            "video_latents": relative_error(other_kernel.video_latents, reference["outputs"]["video_latents"]),
        }
        if args.reference_cuda_graphs:
            reference_graphs = measure(reference_engine.optimize(cuda_graphs=True), args, device, all_ranks=False)
            reference_graphs.pop("outputs")
        del reference_engine
    synchronize(device)

    report = dict(
        script="benchmarks/parallel_gpu.py", command=" ".join([sys.executable, *sys.argv]),
        torchrun_world_size=world, git_commit=common.provenance()["commit"], torch=torch.__version__,
        card=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        cards=gather_from_ranks(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        dtype=str(dtype), tiny=args.tiny, model_build_s=round(build_s, 2),
        setup=dict(height=args.height, width=args.width, chunk=args.chunk, steps=args.steps, guidance=args.guidance,
                   compile=args.compile,
                   warmup=args.warmup, repeats=args.repeats, tolerance=args.tolerance,
                   parameters=sum(p.numel() for p in model.parameters())),
        notes="random weights; prompt K/V cached across requests (the first request fills the cache, warm-up)",
        layouts={},
    )
    if rank == 0:
        report["reference_tp1"] = {k: v for k, v in reference.items() if k != "outputs"}
        report["request_noise_floor_tp1"] = request_noise_floor
        if reference_graphs:
            report["reference_tp1_cuda_graphs"] = reference_graphs

    for index, (name, (config, options)) in enumerate(configs.items()):
        if index > 0 or args.compile:  # resliced in place by the previous layout, or compiled: rebuild it
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = build_transformer(transformer_config, device, dtype)
        context = init_parallel(config, device)
        if config.tp > 1:
            apply_tensor_parallel(model, context.group("tp"), all_reduce="symm_mem" if "symm" in options else "nccl")
            for option in options:
                if option.startswith("overlap"):
                    overlap_communication(model, int(option[len("overlap"):]))
        engine = engine_for(model, context)
        if "optimize" in options:
            engine.optimize()  # its defaults for this device and layout
        elif args.compile or "graphs" in options:
            engine.optimize(cuda_graphs="graphs" in options, tp_overlap=False)  # the options spell out the rest
        numbers = measure(engine, args, device, all_ranks=True)
        del engine
        outputs = numbers.pop("outputs")
        per_rank = gather_from_ranks(dict(gen_forward_ms=numbers["gen_forward_ms"], request_ms=numbers["request_ms"],
                                  action=outputs["action"]))
        entry = dict(dp=config.dp, cfg=config.cfg_parallel, tp=config.tp, options=sorted(options), **numbers,
                     gen_forward_ms_per_rank=[r["gen_forward_ms"] for r in per_rank],
                     request_ms_per_rank=[r["request_ms"] for r in per_rank],
                     identical_across_ranks=all(np.array_equal(r["action"], per_rank[0]["action"]) for r in per_rank))
        if rank == 0:
            ref = reference["outputs"]
            errors = {key: relative_error(outputs[key], ref[key]) for key in ref}
            forward_ok = max(errors["video_velocity"], errors["action_velocity"]) < args.tolerance
            request_ok = max(errors["action"], errors["video_latents"]) < args.tolerance
            entry.update(errors_vs_tp1=errors, speedup_request_vs_tp1=reference["request_ms"] / numbers["request_ms"],
                         speedup_forward_vs_tp1=reference["gen_forward_ms"] / numbers["gen_forward_ms"],
                         **({"speedup_forward_vs_tp1_cuda_graphs":
                             reference_graphs["gen_forward_ms"] / numbers["gen_forward_ms"],
                             "speedup_request_vs_tp1_cuda_graphs":
                             reference_graphs["request_ms"] / numbers["request_ms"]} if reference_graphs else {}),
                         forward_within_tolerance=forward_ok, request_within_tolerance=request_ok,
                         passed=entry["identical_across_ranks"] and forward_ok and request_ok)
            print(f"[{name}] forward {numbers['gen_forward_ms']:.1f} ms (tp1 {reference['gen_forward_ms']:.1f}), "
                  f"request {numbers['request_ms']:.1f} ms (tp1 {reference['request_ms']:.1f}), "
                  f"max rel error {max(errors.values()):.2e}, identical across ranks {entry['identical_across_ranks']}",
                  flush=True)
        report["layouts"][name] = entry
        write_report(report, args, world, rank)  # so far: a later layout that fails leaves these behind
    del model
    gc.collect()
    report["decode"] = measure_decode(vae, args, device, rank, world)
    if rank == 0:
        print("decode", {k: v for k, v in report["decode"].items() if k != "latent_shape"}, flush=True)
    if device.type == "cuda":
        report["peak_memory_gb_per_rank"] = gather_from_ranks(round(torch.cuda.max_memory_allocated(device) / 2**30, 2))

    write_report(report, args, world, rank)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
