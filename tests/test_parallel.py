"""Multi-rank SPMD engine on CPU (gloo): every (dp, cfg, tp) layout gives the single-process result.

The ranks run in separate processes (``tests/dist_utils.py``); each world size is started once and runs every layout
and request batch of that size, since starting processes (imports) dominates the cost. References come from one
in-process engine on the same tiny checkpoint. fp32 throughout: the layouts only change summation order (split
GEMM reductions, batch composition), so results agree to ~1e-7 and the 1e-5 bound is tight; a wrong head slice,
gate/up layout, CFG row or gather order moves them by O(1e-2) or more. Every rank must also return bit-identical
results.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_utils import free_port, run_distributed
from PIL import Image
from reference import relative_error

from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import InputError
from cosmos3_gym.testing import build_tiny_checkpoint

TOL = 1e-5
BASE = dict(domain="pusht", chunk=4, num_inference_steps=2, fps=15.0, resolution_tier=256)


def image(seed: int, size=(200, 280)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def batches() -> dict[str, tuple[list[Cosmos3Request], bool]]:
    """name -> (requests, decode). Built identically in the parent and in every rank."""
    acts = np.random.default_rng(1).uniform(-1, 1, (4, 2)).astype(np.float32)
    video = [image(s) for s in range(5)]
    return {
        # The three modes, all guided: cond rows on cfg rank 0, uncond rows on cfg rank 1; decoded tile-parallel.
        "modes": ([
            Cosmos3Request("policy", image(1), "push the T", guidance_scale=2.5, seed=1, **BASE),
            Cosmos3Request("forward_dynamics", image(2), "push", action=acts, guidance_scale=3.0, seed=2, **BASE),
            Cosmos3Request("inverse_dynamics", video, "a much longer task text", guidance_scale=2.0, seed=3, **BASE),
        ], True),
        # Mixed guidance (cfg rows split unevenly, padded), a second latent shape (chunk 8) and a seed drawn on rank 0.
        "mixed": ([
            Cosmos3Request("policy", image(4), "push the T", guidance_scale=1.0, seed=4, **BASE),
            Cosmos3Request("forward_dynamics", image(5), "push", action=acts, guidance_scale=3.0, seed=5, **BASE),
            Cosmos3Request("policy", image(6), "reach", guidance_scale=1.5, seed=None, **BASE),
            Cosmos3Request("policy", image(7), "push the T", guidance_scale=2.0, seed=6, **{**BASE, "chunk": 8}),
            Cosmos3Request("inverse_dynamics", video, "a much longer task text", guidance_scale=1.0, seed=7, **BASE),
        ], False),
        # No guidance anywhere: cfg=2 splits the batch rows between the two cfg groups.
        "unguided": ([
            Cosmos3Request("policy", image(8), "push the T", guidance_scale=1.0, seed=8, **BASE),
            Cosmos3Request("forward_dynamics", image(9), "push", action=acts, guidance_scale=1.0, seed=9, **BASE),
            Cosmos3Request("inverse_dynamics", video, "push", guidance_scale=1.0, seed=10, **BASE),
        ], False),
        # One unguided row: cfg rank 1 (and dp replica 1) have nothing to compute but must still join.
        "single_unguided": ([Cosmos3Request("policy", image(10), "push", guidance_scale=1.0, seed=11, **BASE)], False),
    }


def summarize(results) -> list[dict]:
    return [dict(action=r.action, latents=r.video_latents, pixels=r.pixels, seed=r.seed) for r in results]


def run_batches(engine, names=None) -> dict[str, list[dict]]:
    return {name: summarize(engine.step(reqs, decode=decode))
            for name, (reqs, decode) in batches().items() if names is None or name in names}


def load(checkpoint, **parallel) -> Cosmos3Engine:
    return Cosmos3Engine.from_pretrained(checkpoint, device="cpu", dtype="fp32", progress=False, **parallel)


def error_of(fn) -> str:
    try:
        fn()
    except InputError as e:
        return f"InputError: {e}"
    return "no error"


# ------------------------------------------------------------------ rank programs (run in spawned processes)


class AcrossHeadsRMSNorm(torch.nn.Module):
    """A Wan-style q/k norm over all heads of a token ([..., heads, head_dim] normalised as one vector): under
    head sharding a rank would only see its own heads, so TP must then differ from the full model."""

    def __init__(self, per_head_norm):
        super().__init__()
        self.weight, self.eps = per_head_norm.weight, per_head_norm.eps

    def forward(self, x):
        flat = x.flatten(-2)
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
        return flat.view_as(x) * self.weight


def transformer_tp_check(checkpoint: str) -> dict:
    """One GEN forward and the text K/V of a sharded model against the full model, with the real per-head q/k norm
    and with an across-heads one swapped into both models."""
    import torch.distributed as dist

    from cosmos3_gym.models.transformer import Cosmos3Transformer, RMSNorm
    from cosmos3_gym.parallel.tensor_parallel import apply_tensor_parallel

    tp, rank = dist.get_world_size(), dist.get_rank()
    full = Cosmos3Transformer.from_pretrained(Path(checkpoint) / "transformer")
    sharded = apply_tensor_parallel(Cosmos3Transformer.from_pretrained(Path(checkpoint) / "transformer"),
                                    dist.group.WORLD)
    c = full.config
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 9, 33, 2, 17, 8], [40, 3, 3, 12]]  # different lengths: padded and masked
    thw, chunk = (2, 4, 6), 4
    inputs = (
        torch.randn(2, c.latent_channel, *thw, generator=g), torch.tensor([[False, True], [True, True]]),
        torch.tensor([700, 300]), torch.randn(2, chunk, c.action_dim, generator=g), torch.ones(2, chunk, dtype=bool),
        torch.tensor([3, 5]),
    )

    def run(model):
        with torch.inference_mode():
            text = model.encode_text(prompts)
            layout = model.gen_layout(text.lengths, thw, chunk, [15.0, 10.0])
            return text, model(text, layout, *inputs)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    text_full, (video_full, action_full) = run(full)
    text_tp, (video_tp, action_tp) = run(sharded)
    local_kv = c.num_key_value_heads // tp
    heads = slice(rank * local_kv, (rank + 1) * local_kv)
    kv_error = max(max(rel(a, b[:, heads]) for a, b in zip(text_tp.keys, text_full.keys)),
                   max(rel(a, b[:, heads]) for a, b in zip(text_tp.values, text_full.values)))
    for model in (full, sharded):
        for layer in list(model.text_layers) + list(model.gen_layers):
            if isinstance(layer.attn.q_norm, RMSNorm):  # (a checkpoint may have no text q/k norm)
                layer.attn.q_norm = AcrossHeadsRMSNorm(layer.attn.q_norm)
                layer.attn.k_norm = AcrossHeadsRMSNorm(layer.attn.k_norm)
    _, (video_full_x, _) = run(full)
    _, (video_tp_x, _) = run(sharded)
    return dict(
        local_kv_heads=text_tp.keys[0].shape[1], kv_error=kv_error,
        video_error=rel(video_tp, video_full), action_error=rel(action_tp, action_full),
        across_heads_error=rel(video_tp_x, video_full_x),
    )


def overlap_check(checkpoint: str, compile_too: bool) -> dict:
    """The GEN forward with overlapped all-reduces (parallel/overlap.py: 2 and 3 row blocks, eager and, with
    ``compile_too``, with the regions compiled) against the full model, for a batch of two prompt lengths. Compiling
    costs seconds per model on the CPU, so one checkpoint's layer variants run eager only."""
    import torch.distributed as dist
    from test_cuda_graphs import forward_inputs

    from cosmos3_gym.models.transformer import Cosmos3Transformer
    from cosmos3_gym.parallel.overlap import OverlappedGenForward, overlap_communication
    from cosmos3_gym.parallel.tensor_parallel import apply_tensor_parallel

    def load_model():
        # Frozen and in eval mode as the engine's transformer, so that the compiled check reuses the engines' graphs
        # (dynamo guards on requires_grad).
        return Cosmos3Transformer.from_pretrained(Path(checkpoint) / "transformer").eval().requires_grad_(False)

    full = load_model()
    with torch.inference_mode():
        video_want, action_want = full(*forward_inputs(full, [20, 31], 0))
    errors = {}
    for chunks in (2, 3):
        model = overlap_communication(apply_tensor_parallel(load_model(), dist.group.WORLD), chunks)
        assert all(isinstance(layer.gen_forward, OverlappedGenForward) for layer in model.gen_layers)
        for compiled in (False, True) if compile_too else (False,):
            if compiled:
                model.compile_blocks()
            with torch.inference_mode():
                video, action = model(*forward_inputs(model, [20, 31], 0))
            errors[f"chunks{chunks}_{'compiled' if compiled else 'eager'}"] = max(
                ((video - video_want).norm() / video_want.norm()).item(),
                ((action - action_want).norm() / action_want.norm()).item())
    errors["unsharded"] = error_of(lambda: overlap_communication(load_model(), 2))
    errors["one_chunk"] = error_of(lambda: overlap_communication(model, 1))
    return errors


def world2_program(checkpoint: str, variant_checkpoint: str) -> dict:
    out = {}
    for name, parallel in (("tp2", dict(tp=2)), ("cfg2", dict(cfg_parallel=2)), ("dp2", dict(dp=2))):
        engine = load(checkpoint, **parallel)
        out[name] = run_batches(engine)
        engine.close()
    # Regionally compiled blocks on sharded layers (the all-reduces inside the compiled graphs).
    engine = load(checkpoint, tp=2, optimize=True)
    out["tp2_optimized"] = run_batches(engine, ["modes"])
    engine.close()
    # The GEN layers' all-reduces overlapped with compute (parallel/overlap.py; async gloo collectives here).
    engine = load(checkpoint, tp=2).optimize(tp_overlap=True)
    out["tp2_overlap"] = run_batches(engine, ["modes", "mixed"])
    out["tp2_overlap_applied"] = all(type(layer.gen_forward).__name__ == "OverlappedGenForward"
                                     for layer in engine.transformer.gen_layers)
    engine.close()
    # After the engines: the compiled overlap check then starts from the engines' (shape-dynamic) graphs of the same
    # functions instead of compiling static ones that the engines' shapes would recompile (about 30 s less compile).
    out.update(transformer=transformer_tp_check(checkpoint), variant=transformer_tp_check(variant_checkpoint),
               overlap=overlap_check(checkpoint, compile_too=True),
               overlap_variant=overlap_check(variant_checkpoint, compile_too=False))
    out["mismatch"] = error_of(lambda: load(checkpoint, tp=2, cfg_parallel=2))
    return out


def world4_program(checkpoint: str, wide_checkpoint: str) -> dict:
    out = {}
    for name, path, parallel, names in (
        ("tp2cfg2", checkpoint, dict(tp=2, cfg_parallel=2), ["modes", "mixed", "single_unguided"]),
        ("dp2tp2", checkpoint, dict(dp=2, tp=2), ["mixed"]),
        ("tp4", wide_checkpoint, dict(tp=4), ["modes"]),
    ):
        engine = load(path, **parallel)
        out[name] = run_batches(engine, names)
        engine.close()
    out["tp4_kv_heads"] = error_of(lambda: load(checkpoint, tp=4))
    return out


# ------------------------------------------------------------------ fixtures and checks


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """8 query / 4 KV heads, so that tp=4 is possible."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("wide"), num_attention_heads=8, num_key_value_heads=4,
                                 hidden_size=128)


@pytest.fixture(scope="module")
def variant_checkpoint(tmp_path_factory):
    """The other code paths of the layers: squared-ReLU MLP (no gate), attention biases (row-parallel bias added
    once), no text q/k norm but a separate UND key norm for the GEN tower."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("variant"), hidden_act="relu2", attention_bias=True,
                                 qk_norm_for_text=False, use_und_k_norm_for_gen=True)


@pytest.fixture(scope="module")
def world2(tiny_checkpoint, variant_checkpoint):
    return run_distributed(world2_program, 2, str(tiny_checkpoint), str(variant_checkpoint), timeout=240)


@pytest.fixture(scope="module")
def world4(tiny_checkpoint, wide_checkpoint):
    return run_distributed(world4_program, 4, str(tiny_checkpoint), str(wide_checkpoint), timeout=300)


@functools.cache
def reference_batch(checkpoint, name: str, seeds: tuple[int, ...]) -> list[dict]:
    """The single-process results of one batch, with the seeds the ranks drew for its seed=None requests."""
    reqs, decode = batches()[name]
    reqs = [dataclasses.replace(r, seed=seed) for r, seed in zip(reqs, seeds)]
    return summarize(reference_engine(checkpoint).step(reqs, decode=decode))


@functools.cache
def reference_engine(checkpoint) -> Cosmos3Engine:
    return load(checkpoint)


def check_layout(checkpoint, ranks: list[dict], layout: str) -> None:
    results = [rank_out[layout] for rank_out in ranks]
    for other in results[1:]:  # bit-identical on every rank
        for name, items in results[0].items():
            for a, b in zip(items, other[name]):
                assert np.array_equal(a["action"], b["action"]) and torch.equal(a["latents"], b["latents"])
                assert (a["pixels"] is None) == (b["pixels"] is None)
                assert a["pixels"] is None or torch.equal(a["pixels"], b["pixels"])
    for name, items in results[0].items():
        expected = reference_batch(checkpoint, name, tuple(item["seed"] for item in items))
        assert len(items) == len(expected)
        for i, (got, want) in enumerate(zip(items, expected)):
            where = f"{layout} {name}[{i}]"
            assert relative_error(got["latents"], want["latents"]) < TOL, where
            assert relative_error(got["action"], want["action"]) < TOL, where
            if want["pixels"] is not None:
                assert relative_error(got["pixels"], want["pixels"]) < TOL, where


@pytest.mark.parametrize("layout", ["tp2", "cfg2", "dp2", "tp2_optimized", "tp2_overlap"])
def test_two_rank_layouts_match_single_process(tiny_checkpoint, world2, layout):
    check_layout(tiny_checkpoint, world2, layout)
    if layout == "tp2_overlap":
        assert all(rank_out["tp2_overlap_applied"] for rank_out in world2)


@pytest.mark.parametrize("layout", ["tp2cfg2", "dp2tp2"])
def test_four_rank_layouts_match_single_process(tiny_checkpoint, world4, layout):
    check_layout(tiny_checkpoint, world4, layout)


def test_tp4_on_a_checkpoint_with_more_heads(wide_checkpoint, world4):
    check_layout(wide_checkpoint, world4, "tp4")


@pytest.mark.parametrize("checkpoint", ["transformer", "variant"])
def test_tensor_parallel_transformer_matches_full_model(world2, checkpoint):
    for rank_out in world2:
        check = rank_out[checkpoint]
        assert check["local_kv_heads"] == 1  # 2 KV heads over 2 ranks
        assert check["kv_error"] < TOL  # each rank encodes exactly its KV-head shard of the text K/V
        assert check["video_error"] < TOL and check["action_error"] < TOL
        # The same check would catch a q/k norm taken across heads (it would need a cross-rank reduction).
        assert check["across_heads_error"] > 1e-3


@pytest.mark.parametrize(("checkpoint", "modes"), [("overlap", ("eager", "compiled")), ("overlap_variant", ("eager",))])
def test_overlapped_all_reduces_match_full_model(world2, checkpoint, modes):
    for rank_out in world2:
        errors = rank_out[checkpoint]
        names = [f"chunks{chunks}_{mode}" for chunks in (2, 3) for mode in modes]
        assert sorted(errors) == sorted([*names, "unsharded", "one_chunk"])
        for name in names:
            assert errors[name] < TOL, (name, errors[name])
        assert "not tensor-parallel" in errors["unsharded"]
        assert "overlap chunks: expected an integer >= 2, got 1" in errors["one_chunk"]


def test_diffusers_qk_norm_is_per_head(tiny_checkpoint):
    """Why head sharding is exact: diffusers' q/k norms (both towers) have head_dim weights and normalise each head
    on its own, so scaling one head leaves the others' normalised values unchanged."""
    from diffusers import Cosmos3OmniTransformer

    model = Cosmos3OmniTransformer.from_pretrained(tiny_checkpoint, subfolder="transformer")
    attn = model.layers[0].self_attn
    head_dim = model.config.head_dim
    x = torch.randn(5, model.config.num_attention_heads, head_dim)
    scaled = x.clone()
    scaled[:, 0] *= 10
    for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        assert norm.weight.shape == (head_dim,)
        with torch.no_grad():
            assert torch.allclose(norm(x)[:, 1:], norm(scaled)[:, 1:], atol=1e-6)


def test_bad_layouts_raise_clear_errors(world2, world4):
    assert "InputError" in world2[0]["mismatch"] and "number of processes (2)" in world2[0]["mismatch"]
    for rank_out in world4:  # every rank raises the same error, before loading any weights
        assert "InputError" in rank_out["tp4_kv_heads"] and "num_key_value_heads (2)" in rank_out["tp4_kv_heads"]


def test_parallel_shorthands_and_launcher_dispatch(tiny_checkpoint, monkeypatch):
    """Outside a process group a multi-rank config goes to the worker processes (parallel/client.py) with the engine
    kwargs; bad layouts fail before any worker starts. (The deprecated from_pretrained path: test_engine_protocol.)"""
    from cosmos3_gym import launcher
    from cosmos3_gym.parallel.mesh import ParallelConfig

    calls = []
    monkeypatch.setattr(launcher, "Cosmos3EngineClient",
                        lambda path, config, kwargs: calls.append((path, config, kwargs)) or "client")
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert launcher.load_engine(tiny_checkpoint, tp=2, cfg_parallel=2, dtype="fp32") == "client"
    assert calls[0][1] == ParallelConfig(dp=1, cfg_parallel=2, tp=2) and calls[0][2]["dtype"] == "fp32"
    with pytest.raises(InputError, match="num_key_value_heads"):  # checked before any worker starts
        launcher.load_engine(tiny_checkpoint, tp=4)
    assert len(calls) == 1
    with pytest.raises(InputError, match="tp: 4 contradicts"):
        launcher.load_engine(tiny_checkpoint, parallel=ParallelConfig(tp=2), tp=4)
    with pytest.raises(InputError, match="cfg_parallel"):
        launcher.load_engine(tiny_checkpoint, cfg_parallel=3)
    with pytest.raises(InputError, match="needs 2 processes"):  # in-process asked for, but no process group
        launcher.load_engine(tiny_checkpoint, tp=2, backend="inprocess")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(InputError, match="WORLD_SIZE=4"):
        launcher.load_engine(tiny_checkpoint, tp=2)  # "auto" under torchrun: this process is one rank


def test_cli_under_torchrun_matches_single_process(tiny_checkpoint, tmp_path):
    """``torchrun --nproc_per_node=4 -m cosmos3_gym.cli infer --tp 2 --cfg-parallel 2``: rank 0 alone writes the files,
    and the actions equal a single-process run of the same command."""
    from cosmos3_gym.cli import main

    image(3).save(tmp_path / "obs.png")
    args = ["infer", "--checkpoint", str(tiny_checkpoint), "--image", str(tmp_path / "obs.png"), "--prompt", "push",
            "--domain-name", "pusht", "--chunk", "4", "--num-steps", "2", "--resolution-tier", "256", "--seed", "3",
            "--guidance-scale", "2.5"]
    assert main([*args, "--no-decode", "--out", str(tmp_path / "single")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "-m", "cosmos3_gym.cli", *args, "--tp", "2", "--cfg-parallel", "2",
               "--out", str(tmp_path / "parallel")]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and json.loads(printed[0])["action_shape"] == [4, 2]  # rank 0 only
    assert (tmp_path / "parallel.mp4").is_file()
    single = json.loads((tmp_path / "single_action.json").read_text())
    parallel = json.loads((tmp_path / "parallel_action.json").read_text())
    assert parallel["shape"] == single["shape"] == [4, 2]
    assert relative_error(parallel["data"], single["data"]) < TOL
