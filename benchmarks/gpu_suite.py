"""One-call benchmark suite: diffusers' Cosmos3OmniPipeline vs this engine on the SAME random Cosmos3-Nano weights.

    python benchmarks/gpu_suite.py --fp8 off --out $OUT  # on a lent GPU (H100/H200), ~6-8 minutes
    python benchmarks/gpu_suite.py --only-fp8 --out $OUT # the fp8 columns with their same-run baselines, ~4-5 minutes
    python benchmarks/gpu_suite.py --out $OUT            # both in one run (~8-10 minutes: more than one 9-minute call)
    python benchmarks/gpu_suite.py --tiny --out /tmp/x   # CPU dry run of every code path with tiny models

Reports (JSON with card, commit, command): bf16 GEMM peak; per-request latency per mode broken into
encode / text / denoise / decode against diffusers; GEN forward time and MFU at batch 1/4/16 for tiers 256 and 480;
forward-dynamics env throughput at 1/4/16/64 envs (tier 256) against diffusers called once per env; peak memory;
bf16 parity of our engine against diffusers on the Nano request and against an fp32 reference on a Nano-width model.

``optimised``: the same engine after ``Cosmos3Engine.optimize()`` (compiled blocks, CUDA-graphed GEN forward) with
the fastest bf16 VAE decode: the policy request, 1 and 16 envs, the GEN-forward table.

``fp8`` (``--fp8 auto``, the default: where FP8 runs, i.e. a CUDA GPU of compute capability >= 8.9 with torchao;
elsewhere recorded as skipped with the reason): the optimised variant with FP8 GEMMs in the GEN layers
(``cosmos3_gym.quantization.apply_fp8`` on ``DEFAULT_FP8_LAYERS``, on a twin of the transformer that shares its UND
tower: ``common.gen_twin``), optimised the same way and decoding with the optimised variant's VAE. It measures the
policy request without and with decode (speedups over, and time as a fraction of, the same-run diffusers request:
issue 23's "<= 0.40x diffusers"), its actions' and video latents' relative error against the optimised bf16 result
of the same request, the GEN forward at tier 480 batch 1 and 16 against the optimised bf16 forward, and the fd env
throughput at ``--env-counts`` against diffusers one env at a time; ``targets`` says which of issue 23's targets the
run meets. A failure inside it is recorded in its place; the rest of the results still writes. ``--only-fp8`` runs
only what it is compared with (diffusers' policy request and one-env step, the optimised variant with its GEN
forward at tier 480 batch 1 / 16 only) and the variant itself, into gpu_suite_fp8.json. Under ``--tiny`` (no FP8 on
a CPU) a bf16 stand-in twin runs the same path against the eager engine, at two env counts of at most 4.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import (  # noqa: E402
    SCHEDULER,
    add_output_arguments,
    build_nano_transformer,
    build_wan22_vae,
    check_results_target,
    fp8_unavailable_reason,
    free_memory,
    gemm_peak_tflops,
    gen_twin,
    provenance,
    sync,
    timed,
    write_results,
)

from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request  # noqa: E402
from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig  # noqa: E402
from cosmos3_gym.models.vae import Cosmos3VAE  # noqa: E402
from cosmos3_gym.quantization import DEFAULT_FP8_LAYERS, fp8_linear_names  # noqa: E402
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG, TINY_VAE_CONFIG  # noqa: E402
from cosmos3_gym.tokenizer import build_tiny_tokenizer  # noqa: E402


def gen_forward_flops(cfg: Cosmos3TransformerConfig, gen_tokens: int, text_tokens: int) -> float:
    """FLOPs of one GEN-tower forward (matmuls + attention), per sample."""
    d, ffn, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = 2 * d * (q_dim + 2 * kv_dim) + 2 * q_dim * d + 2 * d * ffn * (3 if cfg.hidden_act == "silu" else 2)
    attention = 4 * gen_tokens * (gen_tokens + text_tokens) * q_dim
    return layers * (per_token * gen_tokens + attention) + 2 * 2 * gen_tokens * d * cfg.patch_latent_dim


def make_models(tiny: bool, device: str):
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

    tokenizer = build_tiny_tokenizer()
    if tiny:
        from common import fill_random_
        from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer

        reference = Cosmos3OmniTransformer(**{**TINY_TRANSFORMER_CONFIG, "vocab_size": len(tokenizer)}).eval()
        fill_random_(reference)
        vae = AutoencoderKLWan(**TINY_VAE_CONFIG, latents_mean=[0.0] * 16, latents_std=[1.0] * 16).eval()
        dtype = torch.float32
    else:
        reference = build_nano_transformer(device)
        vae = build_wan22_vae(device)
        dtype = torch.bfloat16
    scheduler = UniPCMultistepScheduler(**SCHEDULER)
    pipe = Cosmos3OmniPipeline(reference, tokenizer, vae, scheduler, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    with torch.device("meta"):  # no host copy of 15 B parameters; weights are assigned from the reference
        ours = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict(dict(reference.config)))
    ours.load_diffusers_state_dict(reference.state_dict(), device=device, dtype=dtype)
    engine = Cosmos3Engine(ours, Cosmos3VAE(vae), tokenizer, scheduler.config, progress=False)
    return pipe, engine, dtype


def scene(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth synthetic frame (random images are an unrealistic worst case for nothing; any image times the same)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    frame = np.stack([np.sin(6 * x + rng.uniform(0, 6)), np.cos(5 * y + rng.uniform(0, 6)), x * y], -1)
    return ((frame - frame.min()) / (frame.max() - frame.min()) * 255).astype(np.uint8)


def diffusers_request(pipe, mode, image, chunk, steps, guidance, fps, tier, actions=None, output_type="latent"):
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    condition = CosmosActionCondition(
        mode=mode, chunk_size=chunk, domain_name="droid_lerobot", resolution_tier=tier,
        raw_actions=torch.as_tensor(actions) if actions is not None else None,
        image=Image.fromarray(image) if mode != "inverse_dynamics" else None,
        video=[Image.fromarray(image)] * (chunk + 1) if mode == "inverse_dynamics" else None,
    )
    return pipe(prompt="pick up the cup and put it in the bowl", action=condition, num_inference_steps=steps,
                guidance_scale=guidance, fps=fps, generator=torch.Generator().manual_seed(0),
                output_type=output_type, enable_safety_check=False)


def our_request(mode, image, chunk, steps, guidance, fps, tier, actions=None):
    return Cosmos3Request(
        mode=mode, observation=image if mode != "inverse_dynamics" else [image] * (chunk + 1),
        task="pick up the cup and put it in the bowl", action=actions, domain="droid_lerobot", chunk=chunk,
        num_inference_steps=steps, guidance_scale=guidance, fps=fps, seed=0, resolution_tier=tier,
    )


def rel(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a), dtype=torch.float64), torch.as_tensor(np.asarray(b), dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def count_forwards(model):
    """Time every diffusers transformer forward (synchronised) through a hook."""
    times = []

    def pre(*_):
        sync()
        times.append(-time.perf_counter())

    def post(*_):
        sync()
        times[-1] += time.perf_counter()

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)
    return times


def first_call_and_breakdown(engine, request) -> tuple[float, dict, object]:
    """Seconds of the request's first call (compiles and CUDA-graph captures of its shapes), then its
    ``latency_breakdown`` and result."""
    started = time.perf_counter()
    engine.step(request, decode=False)
    first_call_s = time.perf_counter() - started
    breakdown = latency_breakdown(engine, request)
    return first_call_s, breakdown, breakdown.pop("result")


def latency_breakdown(engine, request) -> dict:
    """encode (conditioning prep incl. VAE encode + tokenising) / text (UND tower, both prompts, cold cache) /
    denoise (GEN loop) / decode, for one request."""
    engine._text_cache.clear()
    t_prepare, _ = timed(lambda: engine.prepare(request), repeats=3)
    prepared = engine.prepare(request)

    def text():
        engine._text_cache.clear()
        engine.text_kvs([prepared.cond_ids, prepared.uncond_ids])

    t_text, _ = timed(text, repeats=3)
    t_step, _ = timed(lambda: engine.step(request, decode=False), repeats=3)  # text cache warm
    result = engine.step(request, decode=False)
    latents = result.video_latents[None].to(engine.device)
    t_decode, _ = timed(lambda: engine.vae.decode(latents), repeats=2)
    denoise = t_step - t_prepare
    return {"encode_s": t_prepare, "text_s": t_text, "denoise_s": denoise, "decode_s": t_decode,
            "total_no_decode_s": t_prepare + t_text + denoise, "total_with_decode_s": t_prepare + t_text + denoise
            + t_decode, "result": result}


def env_throughput(engine, counts, diffusers_step_s, chunk, steps, guidance, fps, actions) -> dict:
    table = {"diffusers_one_env_step_s": diffusers_step_s}
    for n in counts:
        requests = [our_request("forward_dynamics", scene(256, 256, seed=i), chunk, steps, guidance, fps, 256,
                                actions) for i in range(n)]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            t, _ = timed(lambda: engine.step(requests, decode=True), repeats=2)
        except torch.OutOfMemoryError as e:
            table[f"envs_{n}"] = {"error": f"OOM: {e}"[:200]}
            torch.cuda.empty_cache()
            continue
        table[f"envs_{n}"] = {
            "step_s": t, "env_steps_per_s": n / t, "actions_per_s": n * chunk / t,
            "diffusers_env_steps_per_s": 1 / diffusers_step_s,
            "speedup_vs_diffusers_one_at_a_time": (n / t) * diffusers_step_s,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
        }
        print("envs", n, table[f"envs_{n}"])
    return table


GEN_PROMPT = list(range(3, 153))  # 150 tokens, about the length of Nano's action prompt


def gen_forward_inputs(model, thw, batch: int, chunk: int, fps: float, device) -> tuple:
    """Arguments of one policy-mode GEN forward (frame 0 clean, the rest and the actions noisy) at latent ``thw``."""
    cfg = model.config
    text = model.encode_text([GEN_PROMPT] * batch)
    layout = model.gen_layout(text.lengths, thw, chunk, fps)
    video = torch.randn(batch, cfg.latent_channel, *thw, device=device)
    acts = torch.randn(batch, chunk, cfg.action_dim, device=device)
    noisy_v = torch.ones(batch, thw[0], dtype=torch.bool, device=device)
    noisy_v[:, 0] = False
    noisy_a = torch.ones(batch, chunk, dtype=torch.bool, device=device)
    ts = torch.full((batch,), 900, device=device)
    dom = torch.full((batch,), 8, device=device)
    return text, layout, video, noisy_v, ts, acts, noisy_a, dom


def gen_forward_table(model, chunk, fps, latent_shape_480, peak, device, batches=(1, 4, 16), forward=None,
                      tiers=("256", "480")) -> dict:
    """GEN forward time and MFU at the given batch sizes for ``tiers`` 256 (256x256 canvas) and 480 (480x832).

    ``forward`` runs the pass (default ``model`` itself; e.g. a ``GraphedGenForward`` of it)."""
    cfg = model.config
    forward = forward or model
    table = {}
    shapes = {"256": (chunk // 4 + 1, 16, 16), "480": latent_shape_480}
    for tier, thw in ((tier, shapes[tier]) for tier in tiers):
        for batch in batches:
            inputs = gen_forward_inputs(model, thw, batch, chunk, fps, device)
            _, layout, *_ = inputs
            try:
                with torch.inference_mode():
                    t, _ = timed(lambda: forward(*inputs), repeats=5)
            except torch.OutOfMemoryError:
                table[f"tier{tier}_b{batch}"] = {"error": "OOM"}
                torch.cuda.empty_cache()
                continue
            tokens = layout.num_video_tokens + chunk
            flops = batch * gen_forward_flops(cfg, tokens, len(GEN_PROMPT))
            table[f"tier{tier}_b{batch}"] = {"forward_s": t, "gen_tokens": tokens, "tflops": flops / t / 1e12,
                                             "mfu_vs_gemm_peak": flops / t / 1e12 / peak}
            print("gen", tier, batch, table[f"tier{tier}_b{batch}"])
    return table


def optimised_variant(engine, result, per_mode, image, counts, d_env, chunk, steps, guidance, fps, fd_actions,
                      latent_shape, peak, device, gen_shapes: tuple | None = ((1, 4, 16), ("256", "480"))) -> dict:
    """The same measurements with regional torch.compile of the decoder blocks and the fastest bf16 VAE decode.

    ``gen_shapes``: ``(batches, tiers)`` of the GEN-forward table, None for none. The policy request's result (what
    the fp8 variant's error is measured against) comes back under ``"_policy_result"``, for the caller to pop."""
    device = engine.device
    torch.backends.cudnn.benchmark = True
    vae_fp32 = engine.vae
    lat = result.video_latents[None].to(device)
    t32, _ = timed(lambda: vae_fp32.decode(lat), repeats=2)
    reference = vae_fp32.decode(lat)
    vae_result = {"fp32_cudnn_benchmark_s": t32}
    # The bf16 decode configurations (latent frames per decoder pass, channels-last weights); the fastest one at this
    # request's shape is used below. Chunk 1 is diffusers' frame-by-frame loop in bf16.
    bf16_weights = copy.deepcopy(vae_fp32.vae).to(torch.bfloat16)
    channels_last_weights = Cosmos3VAE(copy.deepcopy(bf16_weights)).use_channels_last().vae
    candidates = {"bf16_chunk1": Cosmos3VAE(bf16_weights, decode_chunk_frames=1),
                  "bf16_chunk4": Cosmos3VAE(bf16_weights, decode_chunk_frames=4),
                  "bf16_chunk4_channels_last": Cosmos3VAE(channels_last_weights, decode_chunk_frames=4),
                  "bf16_chunkall_channels_last": Cosmos3VAE(channels_last_weights, decode_chunk_frames=None),
                  "bf16_chunk4_fused_norms": Cosmos3VAE(copy.deepcopy(bf16_weights),
                                                        decode_chunk_frames=4).fuse_decoder_norms()}
    for name, candidate in candidates.items():
        seconds, _ = timed(lambda: candidate.decode(lat), repeats=2)
        err = (candidate.decode(lat) - reference).abs()
        vae_result[name] = {"seconds": seconds, "vs_fp32_max_abs": float(err.max()),
                            "vs_fp32_mean_abs": float(err.mean())}
    fastest = min(candidates, key=lambda name: vae_result[name]["seconds"])
    vae_result["used"] = fastest
    print("vae", vae_result)
    t0 = time.perf_counter()
    engine.optimize()
    engine.vae = candidates[fastest]
    optimised = {"compile_note": f"Cosmos3Engine.optimize(): regional torch.compile of decoder blocks, CUDA-graphed "
                                 f"GEN forward ({engine.gen_forward is not engine.transformer}); VAE decode {fastest}"}
    request = our_request("policy", image, chunk, steps, guidance, fps, 480)
    engine.step(request, decode=False)  # compile warm-up
    optimised["first_call_with_compile_s"] = time.perf_counter() - t0
    ours = latency_breakdown(engine, request)
    optimised["_policy_result"] = ours.pop("result")
    optimised["policy_request_tier480"] = ours
    optimised["speedup_no_decode_vs_diffusers"] = per_mode["policy"]["diffusers_no_decode_s"] / \
        ours["total_no_decode_s"]
    optimised["speedup_with_decode_vs_diffusers"] = per_mode["policy"]["diffusers_with_decode_s"] / \
        ours["total_with_decode_s"]
    print("optimised policy", optimised)
    # Fewer shapes than the eager tables: every new shape costs a compile.
    optimised["fd_env_throughput_tier256"] = env_throughput(engine, [1, 16], d_env, chunk, steps, guidance, fps,
                                                            fd_actions)
    if gen_shapes:
        batches, tiers = gen_shapes
        optimised["gen_forward"] = gen_forward_table(engine.transformer, chunk, fps, latent_shape, peak, device,
                                                     batches=batches, forward=engine.gen_forward, tiers=tiers)
    optimised["vae_decode_tier480"] = vae_result
    return optimised


# The issue-23 targets (same run as diffusers): policy request time as a fraction of diffusers', GEN forward speedup
# over our bf16 forward (tier 480), 16 envs' throughput over diffusers stepping one env at a time (tier 256).
FP8_TARGETS = {"policy_no_decode_time_vs_diffusers_max": 0.40, "policy_with_decode_time_vs_diffusers_max": 0.45,
               "gen_forward_tier480_speedup_vs_bf16_min": 1.4, "envs_16_speedup_vs_diffusers_one_at_a_time_min": 4.0}


def fp8_variant(engine, twin, layers: str | None, baseline: dict, per_mode, image, tier, counts, d_env, chunk, steps,
                guidance, fps, fd_actions, latent_shape, peak, device, gen_batches, optimise_vae=None) -> dict:
    """The optimised variant's measurements on ``twin`` (``gen_twin``: the engine's UND tower, its own FP8 GEN
    layers by policy ``layers``; None: a bf16 stand-in, the CPU dry run's path), decoding with ``engine``'s VAE.

    ``baseline``: the bf16 numbers to compare with, ``{"name", "result"`` (the policy request's ``Cosmos3Result``),
    ``"gen_forward"`` (a ``gen_forward_table``)``}``. ``optimise_vae`` (GPU): an fp32 VAE whose decoder norms the bf16
    ``optimize()`` already fused, for the twin engine's own ``optimize()`` (CUDA graphs; the twin's blocks are
    compiled) to fuse again without effect before the engine's VAE (the decode the optimised variant chose) is
    swapped in. ``gen_batches``: the GEN-forward batch sizes at tier 480 (empty: none).

    Sections fail on their own: an error is recorded in its place and the next section runs."""
    entry: dict = {"layers": layers or "bf16 stand-in (no FP8 on this device)",
                   "fp8_linears": len(fp8_linear_names(twin, layers)) if layers else 0,
                   "fp8_linears_of_the_default_policy": len(fp8_linear_names(twin, DEFAULT_FP8_LAYERS)),
                   "bf16_baseline": baseline["name"]}
    variant = Cosmos3Engine(twin, optimise_vae or engine.vae, engine.tokenizer, engine.scheduler_config,
                            progress=False)
    if optimise_vae is not None:
        variant.optimize()
        variant.vae = engine.vae
    entry["compile_note"] = (f"as the optimised variant: twin GEN blocks compiled, CUDA-graphed GEN forward "
                             f"({variant.gen_forward is not variant.transformer}), the optimised variant's VAE decode"
                             if optimise_vae is not None else "not optimised (CPU): the eager twin, the engine's VAE")

    def section(name, measure):
        try:
            measure()
        except Exception as error:  # noqa: BLE001 - recorded; the variant's other sections still run
            entry[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            error = None  # drop the traceback's frames (and the tensors they hold) before freeing memory
            free_memory()

    def request_latency():
        request = our_request("policy", image, chunk, steps, guidance, fps, tier)
        entry["first_call_with_compile_s"], ours, result = first_call_and_breakdown(variant, request)
        entry["policy_request_tier480"] = ours
        d_no_decode = per_mode["policy"]["diffusers_no_decode_s"]
        d_with_decode = per_mode["policy"]["diffusers_with_decode_s"]
        entry["speedup_no_decode_vs_diffusers"] = d_no_decode / ours["total_no_decode_s"]
        entry["speedup_with_decode_vs_diffusers"] = d_with_decode / ours["total_with_decode_s"]
        entry["time_vs_diffusers_no_decode"] = ours["total_no_decode_s"] / d_no_decode  # the "0.40x"
        entry["time_vs_diffusers_with_decode"] = ours["total_with_decode_s"] / d_with_decode
        reference = baseline.get("result")
        if reference is not None:
            entry["action_rel_vs_bf16"] = rel(result.action, reference.action)
            entry["video_latents_rel_vs_bf16"] = rel(result.video_latents, reference.video_latents)
            bf16_request = baseline.get("policy_request_tier480") or {}
            for key in ("no_decode", "with_decode"):
                if f"total_{key}_s" in bf16_request:
                    entry[f"speedup_{key}_vs_bf16"] = bf16_request[f"total_{key}_s"] / ours[f"total_{key}_s"]
        print("fp8 policy", {k: v for k, v in entry.items() if k != "policy_request_tier480"}, ours)

    def gen_forward():
        table = gen_forward_table(variant.transformer, chunk, fps, latent_shape, peak, device, batches=gen_batches,
                                  forward=variant.gen_forward, tiers=("480",))
        for key, row in table.items():
            base = baseline.get("gen_forward", {}).get(key, {}).get("forward_s")
            if base and "forward_s" in row:
                row["speedup_vs_bf16"] = base / row["forward_s"]
        entry["gen_forward"] = table

    def env_table():
        entry["fd_env_throughput_tier256"] = env_throughput(variant, counts, d_env, chunk, steps, guidance, fps,
                                                            fd_actions)

    # Static shapes, one compile per shape, as benchmarks/fp8_gpu.py measured FP8 (the bf16 blocks' dynamic graphs
    # would otherwise decide how the FP8 blocks, a new entry of the same code object, compile).
    dynamic_before = torch._dynamo.config.automatic_dynamic_shapes
    torch._dynamo.config.automatic_dynamic_shapes = False
    if optimise_vae is not None:
        entry["dynamo_automatic_dynamic_shapes"] = False
    try:
        section("policy_request_tier480", request_latency)
        if gen_batches:
            section("gen_forward", gen_forward)
        section("fd_env_throughput_tier256", env_table)  # last: its largest env count is the likeliest to fail
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = dynamic_before
    entry["targets"] = fp8_targets(entry)
    try:
        graphed = variant.gen_forward
        if graphed is not variant.transformer:
            graphed.reset()  # the twin's CUDA graphs' memory
        variant.close()
    except Exception as error:  # noqa: BLE001 - what was measured stands
        entry["cleanup_error"] = f"{type(error).__name__}: {error}"[:500]
    return entry


def fp8_targets(entry: dict) -> dict:
    """Each of ``FP8_TARGETS`` met (True / False), or None where its number is missing."""

    def at_most(value, limit):
        return None if value is None else bool(value <= limit)

    def at_least(value, limit):
        return None if value is None else bool(value >= limit)

    gen = entry.get("gen_forward") or {}
    envs_16 = (entry.get("fd_env_throughput_tier256") or {}).get("envs_16") or {}
    targets = {
        "policy_no_decode_time_vs_diffusers_le_0.40": at_most(entry.get("time_vs_diffusers_no_decode"),
                                                              FP8_TARGETS["policy_no_decode_time_vs_diffusers_max"]),
        "policy_with_decode_time_vs_diffusers_le_0.45": at_most(
            entry.get("time_vs_diffusers_with_decode"), FP8_TARGETS["policy_with_decode_time_vs_diffusers_max"]),
        "envs_16_ge_4x_diffusers_one_at_a_time": at_least(
            envs_16.get("speedup_vs_diffusers_one_at_a_time"),
            FP8_TARGETS["envs_16_speedup_vs_diffusers_one_at_a_time_min"]),
    }
    for key in ("tier480_b1", "tier480_b16"):
        targets[f"gen_forward_{key}_ge_1.4x_bf16"] = at_least(
            (gen.get(key) or {}).get("speedup_vs_bf16"), FP8_TARGETS["gen_forward_tier480_speedup_vs_bf16_min"])
    targets["note"] = ("envs: batched engine.step (the suite's env table), not gym.make_vec; with decode: diffusers "
                       "with its fp32 VAE, its documented setting")
    return targets


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU dry run with tiny models")
    add_output_arguments(parser)
    parser.add_argument("--env-counts", default="1,4,16,64")
    parser.add_argument("--quick", action="store_true",
                        help="request latencies and env throughput only: no GEN-forward tables, no bf16 check")
    parser.add_argument("--fp8", choices=("auto", "on", "off"), default="auto",
                        help=f"the fp8 variant (FP8 GEMMs on policy {DEFAULT_FP8_LAYERS!r}, optimised as the "
                             f"optimised variant): auto measures it where FP8 runs (CUDA, compute capability >= 8.9, "
                             f"torchao) and records why not elsewhere; on fails at the start where it cannot run")
    parser.add_argument("--only-fp8", action="store_true",
                        help="only what the fp8 variant is compared with and the variant itself (gpu_suite_fp8.json):"
                             " diffusers' policy request and one-env step, the bf16 optimised variant (its GEN "
                             "forward at tier 480 only), the fp8 variant; ~4-5 min on an H200")
    parser.add_argument("--compiled-gen-forward", default=None, metavar="BATCHES",
                        help="only the compiled GEN-forward table at these batch sizes (e.g. 4): no diffusers "
                             "pipeline, no requests (gpu_suite_gen_forward.json)")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    fp8_reason = "--fp8 off" if args.fp8 == "off" else fp8_unavailable_reason()
    if args.fp8 == "on" and fp8_reason:
        parser.error(f"--fp8 on: {fp8_reason}")
    if args.only_fp8 and args.fp8 == "off":
        parser.error("--only-fp8 with --fp8 off measures nothing")
    torch.backends.cuda.matmul.allow_tf32 = False
    results: dict = {"provenance": provenance()}
    if not args.tiny:
        results["gemm_bf16_tflops"] = gemm_peak_tflops()
        print("GEMM peak", results["gemm_bf16_tflops"])
    peak = results.get("gemm_bf16_tflops", 1.0)

    if args.compiled_gen_forward:
        batches = tuple(int(b) for b in args.compiled_gen_forward.split(","))
        results["compiled_gen_forward"] = compiled_gen_forward(args.tiny, device, batches, peak)
        write_results(results, "gpu_suite_gen_forward.json" if not args.tiny else "gpu_suite_gen_forward_tiny.json",
                      args.out, args.overwrite)
        return results

    name = "_".join(["gpu_suite", *(["fp8"] if args.only_fp8 else []), *(["tiny"] if args.tiny else [])]) + ".json"
    check_results_target(name, args.out, args.overwrite)
    # The fp8 variant: measured where FP8 runs; under --tiny (no FP8 on a CPU) a bf16 stand-in takes the same path.
    measure_fp8 = not fp8_reason
    run_fp8_path = measure_fp8 or (args.tiny and args.fp8 != "off")
    if measure_fp8:
        # The twin's FP8 blocks compile as new entries of the bf16 blocks' code object: room for both, so that
        # neither falls back to eager at dynamo's default limit of 8.
        for option in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, option):
                setattr(torch._dynamo.config, option, 64)

    t0 = time.perf_counter()
    pipe, engine, dtype = make_models(args.tiny, device)
    results["build_s"] = time.perf_counter() - t0
    chunk, steps, guidance, fps = (32, 4, 3.0, 15.0) if not args.tiny else (8, 2, 3.0, 15.0)
    image = scene(480, 832) if not args.tiny else scene(256, 256)
    tier = 480 if not args.tiny else 256

    # ---- per-request latency, every mode (--only-fp8: the policy request), ours vs diffusers (tier 480) ----
    actions = np.random.default_rng(0).uniform(-1, 1, (chunk, 10)).astype(np.float32)
    per_mode = {}
    forward_times = count_forwards(pipe.transformer)
    modes = ("policy",) if args.only_fp8 else ("policy", "forward_dynamics", "inverse_dynamics")
    for mode in modes:
        acts = actions if mode == "forward_dynamics" else None
        forward_times.clear()
        ref_latent = diffusers_request(pipe, mode, image, chunk, steps, guidance, fps, tier, acts)  # warm-up
        forward_times.clear()
        d_latent, _ = timed(lambda: diffusers_request(pipe, mode, image, chunk, steps, guidance, fps, tier, acts),
                            repeats=2, warmup=0)
        forwards = sorted(forward_times)[len(forward_times) // 2] if forward_times else float("nan")
        d_decode, _ = timed(lambda: diffusers_request(pipe, mode, image, chunk, steps, guidance, fps, tier, acts,
                                                      output_type="np"), repeats=1, warmup=0)
        ours = latency_breakdown(engine, our_request(mode, image, chunk, steps, guidance, fps, tier, acts))
        result = ours.pop("result")
        if mode == "policy":
            policy_result = result
        entry = {"diffusers_no_decode_s": d_latent, "diffusers_with_decode_s": d_decode,
                 "diffusers_forward_s": forwards, "ours": ours,
                 "speedup_no_decode": d_latent / ours["total_no_decode_s"],
                 "speedup_with_decode": d_decode / ours["total_with_decode_s"],
                 "parity_video_rel": rel(result.video_latents, ref_latent.video[0].float().cpu())}
        if mode != "forward_dynamics":
            entry["parity_action_rel"] = rel(result.action, ref_latent.action[0].float())
        per_mode[mode] = entry
        print(mode, {k: v for k, v in entry.items() if k != "ours"}, ours)
    results["request_latency_tier480"] = per_mode
    latent_shape = tuple(result.video_latents.shape[1:])

    # ---- fd env throughput: N envs in one batched step vs diffusers once per env (tier 256, decode included) ----
    small = scene(256, 256, seed=1)
    fd_actions = np.random.default_rng(1).uniform(-1, 1, (chunk, 10)).astype(np.float32)
    d_env, _ = timed(lambda: diffusers_request(pipe, "forward_dynamics", small, chunk, steps, guidance, fps, 256,
                                               fd_actions, output_type="np"), repeats=2)
    pipe = None  # frees diffusers' weights for the env tables (a `del` would trip pyflakes on the lambdas above)
    free_memory()
    counts = [int(x) for x in args.env_counts.split(",")]
    if args.only_fp8:
        results["fd_env_throughput_tier256"] = {"diffusers_one_env_step_s": d_env}
    else:
        results["fd_env_throughput_tier256"] = env_throughput(engine, counts, d_env, chunk, steps, guidance, fps,
                                                              fd_actions)
    if not args.quick and not args.only_fp8:
        results["gen_forward"] = gen_forward_table(engine.transformer, chunk, fps, latent_shape, peak, device)

    # The fp8 variant's GEN layers are copied (and quantized) now, while the engine's blocks are not compiled yet.
    twin, twin_error = None, None
    if run_fp8_path:
        try:
            twin = gen_twin(engine.transformer, None if fp8_reason else DEFAULT_FP8_LAYERS,
                            compile_blocks=not args.tiny)
        except Exception as error:  # noqa: BLE001 - recorded in the results, the rest of the suite still runs
            twin_error = f"{type(error).__name__}: {error}"[:2000]
    gen_batches = () if args.quick else (1, 16)

    # ---- optimised variant: compiled decoder blocks + the fastest bf16 VAE decode ----
    baseline = None  # the bf16 numbers the fp8 variant is compared with
    fp32_vae = engine.vae  # its norms fused by the optimised engine.optimize(); the fp8 engine's optimize() reuses it
    if not args.tiny:
        # Keep what we have if the optimised run fails.
        write_results(results, name, args.out, args.overwrite)
        gen_shapes = None if args.quick else ((1, 16), ("480",)) if args.only_fp8 else ((1, 4, 16), ("256", "480"))
        try:
            results["optimised"] = optimised_variant(engine, result, per_mode, image, counts, d_env, chunk, steps,
                                                     guidance, fps, fd_actions, latent_shape, peak, device,
                                                     gen_shapes=gen_shapes)
            optimised = results["optimised"]
            baseline = {"name": "the optimised variant (bf16, same run)", "result": optimised.pop("_policy_result"),
                        "policy_request_tier480": optimised["policy_request_tier480"],
                        "gen_forward": optimised.get("gen_forward", {})}
        except Exception as error:  # noqa: BLE001 - recorded in the results, the rest of the suite still runs
            results["optimised"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    elif run_fp8_path:  # CPU: no optimised variant; the eager engine is the stand-in's baseline
        eager_gen = results.get("gen_forward") or (gen_forward_table(
            engine.transformer, chunk, fps, latent_shape, peak, device, batches=gen_batches, tiers=("480",))
            if gen_batches else {})
        baseline = {"name": "the eager bf16 engine (--tiny: no optimised variant on a CPU)", "result": policy_result,
                    "policy_request_tier480": per_mode["policy"]["ours"], "gen_forward": eager_gen}

    # ---- fp8 variant: the optimised variant with FP8 GEMMs (DEFAULT_FP8_LAYERS) in the GEN layers ----
    if fp8_reason and not (args.tiny and run_fp8_path):
        results["fp8"] = {"skipped": fp8_reason}
    elif twin is None:
        results["fp8"] = {"error": f"building the FP8 GEN layers: {twin_error}"}
    else:
        write_results(results, name, args.out, args.overwrite)
        graphed = engine.gen_forward
        if graphed is not engine.transformer:
            graphed.reset()  # the bf16 CUDA graphs' memory: the bf16 engine's last use is over
            free_memory()
        # --tiny: a bf16 stand-in and two env counts at most (64 tiny envs take minutes on a CPU).
        fp8_counts = counts if not args.tiny else [n for n in counts if n <= 4][:2]
        try:
            entry = fp8_variant(engine, twin, None if fp8_reason else DEFAULT_FP8_LAYERS,
                                baseline or {"name": "none: the optimised variant failed"}, per_mode, image, tier,
                                fp8_counts, d_env, chunk, steps, guidance, fps, fd_actions, latent_shape, peak,
                                device, gen_batches, optimise_vae=None if args.tiny else fp32_vae)
        except Exception as error:  # noqa: BLE001 - recorded in the results, the rest of the suite still runs
            entry = {"error": f"{type(error).__name__}: {error}"[:2000]}
        results["fp8"] = {"skipped": fp8_reason, "bf16_stand_in": entry} if fp8_reason else entry
        if not fp8_reason:
            results["fp8"]["dynamo_recompile_limit"] = getattr(torch._dynamo.config, "recompile_limit", None)
    twin = baseline = None
    results["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    del engine
    free_memory()

    # ---- bf16 vs fp32: our bf16 GEN forward against diffusers fp32 on a Nano-width, 4-layer model ----
    if not args.tiny and not args.quick and not args.only_fp8:
        write_results(results, name, args.out, args.overwrite)
        results["bf16_vs_fp32_nano_width_4_layers"] = bf16_versus_fp32(device, chunk, fps)
    write_results(results, name, args.out, args.overwrite)
    return results


def compiled_gen_forward(tiny: bool, device: str, batches: tuple[int, ...], peak: float) -> dict:
    """The GEN-forward table with regionally compiled blocks, then the same with the compiled forward replayed as a
    CUDA graph (both as ``Cosmos3Engine.optimize`` runs them), without diffusers' pipeline."""
    from cosmos3_gym import processor
    from cosmos3_gym.cuda_graphs import GraphedGenForward

    pipe, engine, _ = make_models(tiny, device)
    del pipe
    gc.collect()
    chunk, fps, tier = (32, 15.0, 480) if not tiny else (8, 15.0, 256)
    height, width = (480, 832) if not tiny else (256, 256)
    latent_hw = processor.prepare_conditioning(np.zeros((height, width, 3), np.uint8), tier, 1).latent_hw
    engine.transformer.compile_blocks()
    shape_480 = (chunk // 4 + 1, *latent_hw)
    t0 = time.perf_counter()
    results = {"compile_note": "regional torch.compile of the blocks (Cosmos3Engine.optimize)",
               "compiled": gen_forward_table(engine.transformer, chunk, fps, shape_480, peak, device, batches)}
    results["seconds_with_compiles"] = time.perf_counter() - t0
    if device == "cuda":
        graphed = GraphedGenForward(engine.transformer, max_graphs=1)  # one shape at a time: frees each graph's memory
        results["compiled_cuda_graph"] = gen_forward_table(engine.transformer, chunk, fps, shape_480, peak, device,
                                                           batches, forward=graphed)
        results["compiled_cuda_graph_vs_compiled_max_abs"] = graph_parity(engine.transformer, graphed, chunk, fps,
                                                                          device)
    return results


def graph_parity(model, graphed, chunk, fps, device) -> float:
    """Max abs difference of the graphed forward against the plain call on fresh inputs of an already-captured
    shape: the replay must read the new inputs, not the ones it was captured with."""
    first = gen_forward_inputs(model, (chunk // 4 + 1, 16, 16), 1, chunk, fps, device)
    with torch.inference_mode():
        graphed(*first)
        torch.manual_seed(1)
        second = gen_forward_inputs(model, (chunk // 4 + 1, 16, 16), 1, chunk, fps, device)
        v_graph, a_graph = graphed(*second)
        v_eager, a_eager = model(*second)
    return max(float((v_graph - v_eager).abs().max()), float((a_graph - a_eager).abs().max()))


def bf16_versus_fp32(device, chunk, fps) -> dict:
    """Our bf16 GEN forward and diffusers' bf16 forward, each against diffusers fp32, on a Nano-width 4-layer model
    (the full model does not fit in fp32 next to the rest). diffusers' own bf16 error is the yardstick."""
    from reference import reference_velocities  # tests/reference.py: diffusers packed exactly as its pipeline

    ref32 = build_nano_transformer(device, dtype=torch.float32, num_hidden_layers=4)
    with torch.device("meta"):
        ours16 = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict(dict(ref32.config)))
    ours16.load_diffusers_state_dict(ref32.state_dict(), device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 500, (150,), generator=g).tolist()
    lat = torch.randn(1, 48, 9, 30, 52, generator=g).to(device)
    act = torch.randn(1, chunk, 64, generator=g).to(device)
    with torch.inference_mode():
        ref_v, ref_a = reference_velocities(ref32, prompt, lat, act[0], [0], [], 900, 8, fps)
        text = ours16.encode_text([prompt])
        layout = ours16.gen_layout(text.lengths, (9, 30, 52), chunk, fps)
        noisy_v = torch.tensor([[False] + [True] * 8], device=device)
        v, a = ours16(text, layout, lat, noisy_v, torch.tensor([900], device=device), act,
                      torch.ones(1, chunk, dtype=torch.bool, device=device), torch.tensor([8], device=device))
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ref16.time_embedder.float()
    with torch.inference_mode():
        d16_v, d16_a = reference_velocities(ref16, prompt, lat.bfloat16(), act[0].bfloat16(), [0], [], 900, 8, fps)
    errors = {
        "ours_bf16_video_rel": rel(v.cpu(), ref_v.cpu()), "ours_bf16_action_rel": rel(a[0].cpu(), ref_a.cpu()),
        "diffusers_bf16_video_rel": rel(d16_v.cpu(), ref_v.cpu()),
        "diffusers_bf16_action_rel": rel(d16_a.cpu(), ref_a.cpu()),
        "ours_bf16_vs_diffusers_bf16_video_rel": rel(v.cpu(), d16_v.cpu()),
    }
    print("bf16 vs fp32", errors)
    return errors


if __name__ == "__main__":
    main()
