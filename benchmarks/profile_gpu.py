"""Where the time goes: torch.profiler over the optimised engine at the full Cosmos3-Nano config (random bf16 weights).

    python benchmarks/profile_gpu.py --out $OUT            # on a lent GPU, a few minutes (two compiles)
    python benchmarks/profile_gpu.py --tiny --out /tmp/x   # CPU check of the script with the tiny models

Profiles, after warm-up (compiles included there), with ``Cosmos3Engine.optimize()`` applied:

- ``policy_request_tier480``: one policy request, 480x832, chunk 32, 4 steps, guidance 3, no decode (the request of
  the issue-6 target, against diffusers' 1.39-1.57 s);
- ``gen_forward_tier256_b1``: one GEN forward at tier 256, batch 1 (608 GEN tokens, the case whose MFU varies most).

For each: wall time; GPU busy time (the union of kernel intervals) and idle time, i.e. how long the GPU waited on the
host (launches, Python, syncs); GPU time per kernel class (GEMM, attention, Triton kernels that inductor fused,
NCCL, memcpy/memset, other); the top kernels; the CPU ops with the largest self time. Writes
``profile_gpu.json`` (``profile_gpu_tiny.json``) and one gzipped Chrome trace per case (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_arguments, check_results_target, provenance, sync, write_results  # noqa: E402
from gpu_suite import gen_forward_inputs, make_models, our_request, scene  # noqa: E402

# Kernel classes by name, first match wins. GEMMs: cuBLAS / CUTLASS / nvjet (Hopper) kernels; attention: flash,
# cuDNN and memory-efficient SDPA kernels; triton_: what inductor generated (fused norms, RoPE, residual adds).
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "ampere_", "hopper_")),
    ("nccl", ("nccl",)),
    ("triton", ("triton_",)),
    ("memcpy_memset", ("memcpy", "memset")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(key in lowered for key in keys):
            return label
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def summarise(prof, wall_s: float, top: int = 15) -> dict:
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_class: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        length = event.time_range.end - event.time_range.start
        by_class[kernel_class(event.name)] = by_class.get(kernel_class(event.name), 0.0) + length
        by_name.setdefault(event.name, []).append(length)
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3 if kernels else None
    # Without the NCCL kernels: busy - compute_busy is the communication that no computation overlapped.
    compute_busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels
                            if kernel_class(e.name) != "nccl"]) / 1e3 if kernels else None
    cpu_ops = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                     key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "wall_ms": wall_s * 1e3,
        "gpu_busy_ms": busy,
        "compute_busy_ms": compute_busy,
        "gpu_idle_ms": wall_s * 1e3 - busy if kernels else None,  # None: no GPU (the --tiny check)
        "kernel_launches": len(kernels),
        "gpu_ms_by_class": {k: v / 1e3 for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": name[:160], "class": kernel_class(name), "calls": len(times), "total_ms": sum(times) / 1e3}
            for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        ],
        "top_cpu_ops_self": [
            {"name": e.key[:120], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in cpu_ops
        ],
    }


def profile_call(fn) -> tuple[profile, float]:
    """One call of ``fn`` under torch.profiler (CPU, and CUDA where there is a GPU), synchronised before and after:
    the profiler and the call's wall time in seconds."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - start
    return prof, wall


def profiled(fn, name: str, out: Path, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    prof, wall = profile_call(fn)
    trace = out / f"{name}.trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    summary = summarise(prof, wall)
    print(name, {k: v for k, v in summary.items() if not k.startswith("top")})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU check with the tiny models")
    add_output_arguments(parser)
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="compiled blocks only, without the CUDA-graphed GEN forward")
    args = parser.parse_args()
    name = "profile_gpu.json" if not args.tiny else "profile_gpu_tiny.json"
    out = check_results_target(name, args.out, args.overwrite).parent  # before measuring; traces go beside it
    device = "cpu" if args.tiny else "cuda"
    torch.backends.cudnn.benchmark = True

    pipe, engine, _ = make_models(args.tiny, device)
    del pipe  # only our engine is profiled; diffusers' weights would double the memory
    gc.collect()
    engine.optimize(cuda_graphs=not args.tiny and not args.no_cuda_graphs)
    chunk, steps, guidance, fps = (32, 4, 3.0, 15.0) if not args.tiny else (8, 2, 3.0, 15.0)
    image, tier = (scene(480, 832), 480) if not args.tiny else (scene(256, 256), 256)
    request = our_request("policy", image, chunk, steps, guidance, fps, tier)
    settings = {"tiny": args.tiny, "chunk": chunk, "steps": steps, "guidance": guidance, "optimize": True,
                "cuda_graphs": engine.gen_forward is not engine.transformer, "decode": False}
    results = {"provenance": provenance(), "settings": settings}
    results["policy_request_tier480"] = profiled(lambda: engine.step(request, decode=False),
                                                 "policy_request_tier480", out)
    inputs = gen_forward_inputs(engine.transformer, (chunk // 4 + 1, 16, 16), 1, chunk, fps, device)

    def forward():
        with torch.inference_mode():
            engine.gen_forward(*inputs)

    results["gen_forward_tier256_b1"] = profiled(forward, "gen_forward_tier256_b1", out)
    write_results(results, name, str(out))


if __name__ == "__main__":
    main()
