"""One-call benchmark suite: diffusers' Cosmos3OmniPipeline vs this engine on the SAME random Cosmos3-Nano weights.

    python benchmarks/gpu_suite.py --out $OUT            # on a lent GPU (H100/H200), ~6-8 minutes
    python benchmarks/gpu_suite.py --tiny --out /tmp/x   # CPU dry run of every code path with tiny models

Reports (JSON with card, commit, command): bf16 GEMM peak; per-request latency per mode broken into
encode / text / denoise / decode against diffusers; GEN forward time and MFU at batch 1/4/16 for tiers 256 and 480;
forward-dynamics env throughput at 1/4/16/64 envs (tier 256) against diffusers called once per env; peak memory;
bf16 parity of our engine against diffusers on the Nano request and against an fp32 reference on a Nano-width model.
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
    SCHEDULER, add_output_arguments, build_nano_transformer, build_wan22_vae, gemm_peak_tflops, provenance, sync, timed,
    write_results,
)

from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG, TINY_VAE_CONFIG  # noqa: E402
from cosmos3_gym.tokenizer import build_tiny_tokenizer  # noqa: E402
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request  # noqa: E402
from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig  # noqa: E402
from cosmos3_gym.models.vae import Cosmos3VAE  # noqa: E402


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


def gen_forward_table(model, chunk, fps, latent_shape_480, peak, device, batches=(1, 4, 16), forward=None) -> dict:
    """GEN forward time and MFU at the given batch sizes for tiers 256 (256x256 canvas) and 480 (480x832).

    ``forward`` runs the pass (default ``model`` itself; e.g. a ``GraphedGenForward`` of it)."""
    cfg = model.config
    forward = forward or model
    table = {}
    for tier, thw in (("256", (chunk // 4 + 1, 16, 16)), ("480", latent_shape_480)):
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
                      latent_shape, peak, device, gen_tables: bool = True) -> dict:
    """The same measurements with regional torch.compile of the decoder blocks and the fastest bf16 VAE decode."""
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
    ours.pop("result")
    optimised["policy_request_tier480"] = ours
    optimised["speedup_no_decode_vs_diffusers"] = per_mode["policy"]["diffusers_no_decode_s"] / \
        ours["total_no_decode_s"]
    optimised["speedup_with_decode_vs_diffusers"] = per_mode["policy"]["diffusers_with_decode_s"] / \
        ours["total_with_decode_s"]
    print("optimised policy", optimised)
    # Fewer shapes than the eager tables: every new shape costs a compile.
    optimised["fd_env_throughput_tier256"] = env_throughput(engine, [1, 16], d_env, chunk, steps, guidance, fps,
                                                            fd_actions)
    if gen_tables:
        optimised["gen_forward"] = gen_forward_table(engine.transformer, chunk, fps, latent_shape, peak, device,
                                                     batches=(1, 4, 16), forward=engine.gen_forward)
    optimised["vae_decode_tier480"] = vae_result
    return optimised


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU dry run with tiny models")
    add_output_arguments(parser)
    parser.add_argument("--env-counts", default="1,4,16,64")
    parser.add_argument("--quick", action="store_true",
                        help="request latencies and env throughput only: no GEN-forward tables, no bf16 check")
    parser.add_argument("--compiled-gen-forward", default=None, metavar="BATCHES",
                        help="only the compiled GEN-forward table at these batch sizes (e.g. 4): no diffusers "
                             "pipeline, no requests (gpu_suite_gen_forward.json)")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
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
        return

    t0 = time.perf_counter()
    pipe, engine, dtype = make_models(args.tiny, device)
    results["build_s"] = time.perf_counter() - t0
    chunk, steps, guidance, fps = (32, 4, 3.0, 15.0) if not args.tiny else (8, 2, 3.0, 15.0)
    image = scene(480, 832) if not args.tiny else scene(256, 256)
    tier = 480 if not args.tiny else 256

    # ---- per-request latency, every mode, ours vs diffusers (tier 480, 4 steps, guidance 3) ----
    actions = np.random.default_rng(0).uniform(-1, 1, (chunk, 10)).astype(np.float32)
    per_mode = {}
    forward_times = count_forwards(pipe.transformer)
    for mode in ("policy", "forward_dynamics", "inverse_dynamics"):
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
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    counts = [int(x) for x in args.env_counts.split(",")]
    results["fd_env_throughput_tier256"] = env_throughput(engine, counts, d_env, chunk, steps, guidance, fps,
                                                          fd_actions)
    if not args.quick:
        results["gen_forward"] = gen_forward_table(engine.transformer, chunk, fps, latent_shape, peak, device)

    # ---- optimised variant: compiled decoder blocks + the fastest bf16 VAE decode ----
    if not args.tiny:
        # Keep what we have if the optimised run fails.
        write_results(results, "gpu_suite.json", args.out, args.overwrite)
        try:
            results["optimised"] = optimised_variant(engine, result, per_mode, image, counts, d_env, chunk, steps,
                                                     guidance, fps, fd_actions, latent_shape, peak, device,
                                                     gen_tables=not args.quick)
        except Exception as error:  # noqa: BLE001 - recorded in the results, the rest of the suite still runs
            results["optimised"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    results["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    # ---- bf16 vs fp32: our bf16 GEN forward against diffusers fp32 on a Nano-width, 4-layer model ----
    if not args.tiny and not args.quick:
        results["bf16_vs_fp32_nano_width_4_layers"] = bf16_versus_fp32(device, chunk, fps)
    write_results(results, "gpu_suite.json" if not args.tiny else "gpu_suite_tiny.json", args.out, args.overwrite)


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
