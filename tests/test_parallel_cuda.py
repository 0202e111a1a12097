"""Tensor parallelism on several GPUs (NCCL): the symmetric-memory all-reduce and CUDA graphs with captured
all-reduces, against the unsharded model on one GPU. Skipped without two GPUs (run on the lent machines); the
CPU/gloo equivalence of every layout is in test_parallel.py. fp32: the sharded forwards only change summation order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from dist_utils import run_distributed
from test_cuda_graphs import forward_inputs

from cosmos3_gym.errors import InputError
from cosmos3_gym.models.transformer import Cosmos3Transformer
from cosmos3_gym.parallel.overlap import overlap_communication
from cosmos3_gym.parallel.tensor_parallel import apply_tensor_parallel

TOL = 1e-5
def needs_two_gpus(test):
    """GPU tests carry the ``gpu`` marker (``pytest -m "not gpu"`` leaves them out) and skip without 2 GPUs."""
    return pytest.mark.gpu(pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")(test))


def test_symm_mem_all_reduce_needs_cuda_and_bad_names_are_named(tiny_checkpoint):
    model = Cosmos3Transformer.from_pretrained(Path(tiny_checkpoint) / "transformer")
    with pytest.raises(InputError, match="all_reduce: 'symm_mem' needs the model on a CUDA device"):
        apply_tensor_parallel(model, None, all_reduce="symm_mem")
    with pytest.raises(InputError, match=r"all_reduce: expected one of \('nccl', 'symm_mem'\), got 'mpi'"):
        apply_tensor_parallel(model, None, all_reduce="mpi")


def tp_cuda_check(checkpoint: str) -> dict:
    """Per all-reduce, with and without overlapped all-reduces: the sharded forward (plain, then compiled and
    CUDA-graphed: a capture, then a replay with new inputs) against the full model on this rank's GPU, for a batch
    of two prompt lengths."""
    import torch.distributed as dist

    from cosmos3_gym.cuda_graphs import GraphedGenForward

    device = torch.device("cuda", dist.get_rank())
    full = Cosmos3Transformer.from_pretrained(Path(checkpoint) / "transformer").to(device)
    out = {}
    for all_reduce, overlap in (("nccl", False), ("symm_mem", False), ("nccl", True), ("symm_mem", True)):
        sharded = Cosmos3Transformer.from_pretrained(Path(checkpoint) / "transformer").to(device)
        apply_tensor_parallel(sharded, dist.group.WORLD, all_reduce=all_reduce)
        if overlap:
            overlap_communication(sharded, chunks=2)
        sharded.compile_blocks()
        graphed = GraphedGenForward(sharded)
        errors = []
        for seed in (0, 1):
            with torch.inference_mode():
                video_want, action_want = full(*forward_inputs(full, [20, 31], seed))
                inputs = forward_inputs(sharded, [20, 31], seed)
                for video, action in (sharded(*inputs), graphed(*inputs)):
                    errors.append(max(((video - video_want).norm() / video_want.norm()).item(),
                                      ((action - action_want).norm() / action_want.norm()).item()))
        out[all_reduce + ("_overlap" if overlap else "")] = dict(errors=errors, num_graphs=graphed.num_graphs,
                                                                  video=video.cpu())
    return out


@needs_two_gpus
def test_tensor_parallel_on_gpus_with_symm_mem_overlap_and_cuda_graphs(tiny_checkpoint):
    ranks = run_distributed(tp_cuda_check, 2, str(tiny_checkpoint), timeout=600, backend="nccl")
    for name in ("nccl", "symm_mem", "nccl_overlap", "symm_mem_overlap"):
        for rank_out in ranks:
            check = rank_out[name]
            assert len(check["errors"]) == 4 and max(check["errors"]) < TOL, (name, check["errors"])
            assert check["num_graphs"] == 1  # the second seed replayed the first capture
        assert torch.equal(ranks[0][name]["video"], ranks[1][name]["video"])  # replicated outputs


def engine_cuda_check(checkpoint: str) -> list[dict]:
    """A tp=2 SPMD engine with ``optimize()``'s defaults on GPUs: CUDA graphs, symmetric-memory all-reduces overlapped
    with compute. A guided batch of two requests, twice (the second replays the captured graphs)."""
    from test_parallel import BASE, image

    from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
    from cosmos3_gym.parallel.overlap import OverlappedGenForward
    from cosmos3_gym.parallel.tensor_parallel import RowParallelLinear

    engine = Cosmos3Engine.from_pretrained(checkpoint, device="cuda", dtype="fp32", progress=False, tp=2).optimize()
    layer = engine.transformer.gen_layers[0]
    assert isinstance(layer.gen_forward, OverlappedGenForward) and engine.gen_forward is not engine.transformer
    assert all(m.all_reduce == "symm_mem" for m in engine.transformer.modules() if isinstance(m, RowParallelLinear))
    results = []
    for seed in (1, 2):
        requests = [Cosmos3Request("policy", image(seed), "push the T", guidance_scale=2.5, seed=seed, **BASE),
                    Cosmos3Request("policy", image(seed + 10), "reach", guidance_scale=1.0, seed=seed + 10, **BASE)]
        results += [dict(action=r.action, latents=r.video_latents.cpu()) for r in engine.step(requests, decode=False)]
    engine.close()
    return results


@needs_two_gpus
def test_optimized_tp_engine_on_gpus_matches_one_gpu(tiny_checkpoint):
    from test_parallel import BASE, image, relative_error

    from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request

    ranks = run_distributed(engine_cuda_check, 2, str(tiny_checkpoint), timeout=600, backend="nccl")
    single = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False)
    expected = []
    for seed in (1, 2):
        requests = [Cosmos3Request("policy", image(seed), "push the T", guidance_scale=2.5, seed=seed, **BASE),
                    Cosmos3Request("policy", image(seed + 10), "reach", guidance_scale=1.0, seed=seed + 10, **BASE)]
        expected += single.step(requests, decode=False)
    assert len(ranks[0]) == len(expected) == 4
    for got, other, want in zip(ranks[0], ranks[1], expected):
        assert np.array_equal(got["action"], other["action"]) and torch.equal(got["latents"], other["latents"])
        assert relative_error(got["action"], want.action) < 1e-4
        assert relative_error(got["latents"], want.video_latents.cpu()) < 1e-4
