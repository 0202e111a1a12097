"""All-reduce of one row-parallel output across the GPUs of one host: NCCL against PyTorch's symmetric-memory kernels.

The tp=4 GEN forward spends ~15 of its 38 ms in 72 exposed all-reduces of one [tokens, hidden] bf16 activation
(benchmarks/results/parallel/parallel_gpu_world4_overlap.json). This measures that one collective on its own, so the
forward's communication floor is known per implementation:

- ``nccl_eager``: ``dist.all_reduce``, back to back (what the model runs today);
- ``nccl_graph``: the same, captured in one CUDA graph (no host launch or rank skew between them);
- ``symm_two_shot``: ``torch.ops.symm_mem.two_shot_all_reduce_out`` (reduce-scatter + all-gather by NVLink loads
  and stores from a symmetric-memory buffer), eager and graphed; ``symm_one_shot``: every rank reads every peer.
- ``gemm_with_*``: the down projection's GEMM alone and while the all-reduce runs on a second stream: how much each
  collective slows the compute it would overlap with; ``_carveoutN``: with N SMs kept out of the GEMM (cuBLAS' SM
  count target).

Every variant's result is checked against the exact sum. NCCL's own knobs (``NCCL_MIN_NCHANNELS``, ``NCCL_PROTO``,
``NCCL_ALGO``) are read at start-up: run the script once per setting, the JSON records them.

    python -m torch.distributed.run --standalone --nproc_per_node=4 benchmarks/allreduce_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from cosmos3_gym.cuda_graphs import capture  # noqa: E402

NCCL_KNOBS = ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_PROTO", "NCCL_ALGO", "NCCL_NVLS_ENABLE",
              "TORCH_SYMM_MEM_DISABLE_MULTICAST")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="3542,7084", help="comma-separated row counts (3542: Nano 480p chunk 32)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288, help="MLP width (the GEMM's K is this / world)")
    parser.add_argument("--ops", type=int, default=24, help="collectives per timed launch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--symm-mem", action=argparse.BooleanOptionalAction, default=True)
    common.add_output_arguments(parser)  # writes allreduce_gpu_world{W}.json there
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rank, world, device = common.init_distributed(use_cuda=True)
    if rank == 0:
        common.check_results_target(f"allreduce_gpu_world{world}.json", args.out, args.overwrite)
    group_name = dist.group.WORLD.group_name
    symm_mem = None
    if args.symm_mem:
        import torch.distributed._symmetric_memory as symm_mem
    report = dict(common.provenance(), world_size=world, nccl_version=".".join(map(str, torch.cuda.nccl.version())),
                  env={k: os.environ.get(k) for k in NCCL_KNOBS}, ops_per_launch=args.ops, sizes={})
    for tokens in map(int, args.tokens.split(",")):
        numel = tokens * args.hidden
        expected = float(sum(r + 1 for r in range(world)))
        entry = dict(tokens=tokens, hidden=args.hidden, megabytes=numel * 2 / 1e6)
        data = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device=device)
        out = torch.empty_like(data)

        def record(name, fn, all_reduced=True, graph=False):
            """``all_reduced``: ``fn`` leaves the all-reduce of ``data`` in ``out``, checked against the exact sum;
            ``graph``: time ``fn`` captured in a CUDA graph."""
            try:
                fn = capture(fn)[0].replay if graph else fn
                out.zero_()
                _, times = common.timed_ms(fn, args.repeats, warmup=1, barrier=True)
                per_op_us = statistics.median(times) / args.ops * 1e3
                entry[name] = dict(us_per_op=per_op_us, bus_gb_s=numel * 2 * 2 * (world - 1) / world / per_op_us / 1e3,
                                   times_ms=times)
                if all_reduced:
                    entry[name]["correct"] = bool((out.float() == expected).all())
            except Exception as error:  # noqa: BLE001 - one variant failing must not lose the others
                entry[name] = dict(error=f"{type(error).__name__}: {error}"[:500])
            if rank == 0:
                print(tokens, name, {k: v for k, v in entry[name].items() if k != "times_ms"}, flush=True)

        def nccl_ops():
            for _ in range(args.ops):
                out.copy_(data)  # an all-reduce of ``data`` each time, not a growing sum
                dist.all_reduce(out)

        copy_only = lambda: [out.copy_(data) for _ in range(args.ops)]  # noqa: E731
        record("copy_only", copy_only, all_reduced=False)
        record("nccl_eager", nccl_ops)
        record("nccl_graph", nccl_ops, graph=True)
        if symm_mem is not None:
            buffer = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
            symm_mem.rendezvous(buffer, group_name)

            def two_shot():
                for _ in range(args.ops):
                    buffer.copy_(data)
                    torch.ops.symm_mem.two_shot_all_reduce_out(buffer, "sum", group_name, out)

            def one_shot():
                for _ in range(args.ops):
                    buffer.copy_(data)
                    torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", group_name, out)

            record("symm_two_shot", two_shot)
            record("symm_two_shot_graph", two_shot, graph=True)
            record("symm_one_shot", one_shot)

        # The down projection's GEMM, [tokens, intermediate/world] @ [intermediate/world, hidden], alone and next to
        # the all-reduce of another buffer on a second stream (what overlapping would look like).
        a = torch.randn(tokens, args.intermediate // world, dtype=torch.bfloat16, device=device)
        b = torch.randn(args.intermediate // world, args.hidden, dtype=torch.bfloat16, device=device)
        gemm_out = torch.empty(tokens, args.hidden, dtype=torch.bfloat16, device=device)
        gemms = lambda: [torch.mm(a, b, out=gemm_out) for _ in range(args.ops)]  # noqa: E731
        record("gemm_alone", gemms, all_reduced=False)
        side = torch.cuda.Stream(priority=-1)
        collectives = {"nccl": nccl_ops}
        if symm_mem is not None:
            collectives["symm_two_shot"] = two_shot
        for (name, collective), carveout in itertools.product(collectives.items(), (None, 24, 32)):
            def both(collective=collective, carveout=carveout):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    collective()
                torch._C._set_sm_carveout_experimental(carveout)
                gemms()
                torch._C._set_sm_carveout_experimental(None)
                torch.cuda.current_stream().wait_stream(side)
            record(f"gemm_with_{name}" + (f"_carveout{carveout}" if carveout else ""), both)
        report["sizes"][str(tokens)] = entry
    if rank == 0:
        common.write_results(report, f"allreduce_gpu_world{world}.json", args.out, args.overwrite)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
