"""FP8 GEMMs for the GEN tower (issue 23): speed and accuracy per layer policy, against bf16 and diffusers, in one run.

    python benchmarks/fp8_gpu.py --skip pusht,decode_compiled --out $OUT   # call 1: Nano speed, ~6 min (H200)
    python benchmarks/fp8_gpu.py --only pusht,decode_compiled --out $OUT   # call 2: PushT accuracy, decoder compile
    python benchmarks/fp8_gpu.py --tiny --out /tmp/x   # CPU dry run of the plumbing with tiny models, FP8 skipped

Without ``--skip`` / ``--only`` every section runs in one call, as far as ``--budget-s`` lets it (about 12 minutes
in all on an H200: two calls of under 9 minutes each are the way to get all of it).

Sections, in this order (each writes the results JSON when it ends, so a cut-short run keeps what it measured; one
that would start past ``--budget-s`` is skipped and says so):

b. ``velocity_error``: a Nano-width model (random weights, ``--error-layers`` layers; GEN tier 480, batch 1): the GEN
   velocities of bf16 and of FP8 per layer policy against an fp32 reference of the same weights (eager; the reference
   alone runs with TF32 off, everything else with PyTorch's defaults, as diffusers' docs run).
c. ``diffusers``: diffusers' ``Cosmos3OmniPipeline`` policy request on the same random full-Nano weights (tier 480,
   chunk 32, 4 steps, guidance 3, fp32 VAE as diffusers' docs load it), without and with decode; and one env step
   as diffusers gives it, one env at a time: a forward-dynamics request at tier 256, decoded.
a+c. ``variants``: per variant (bf16, then FP8 per ``--speed-policies``) a twin of the engine's transformer that
   shares the UND tower and has its own GEN layers, its blocks compiled and the forward CUDA-graphed as
   ``Cosmos3Engine.optimize`` runs them: the GEN forward at tier 480 batch 1 / 16 and tier 256 batch 1 / 16, then the
   policy request (``gpu_suite.latency_breakdown``) without and with decode, its speedup over diffusers, and its
   actions against bf16's next to the spread of two bf16 seeds. For ``--vector-env-variants``, ``vector_env``:
   ``gym.make_vec("cosmos3_gym/WorldModel-v0", num_envs=16, engine=...)`` at tier 256, env steps/s with the fp32 VAE
   (gym.make_vec's default) and a bf16 one, against diffusers stepping one env at a time.
d. ``pusht``: the trained PushT model loaded through ``Cosmos3Engine.from_pretrained(precision=...)``: action-following
   PSNR / SSIM / block position error (``fidelity_pusht.action_following``) for bf16 with two seeds and FP8 per
   policy, and the policy ranking (``compare_with_simulator``) for bf16 (two seeds) and FP8 per
   ``--pusht-ranking-policies``; without gym-pusht, the PSNR between FP8 and bf16 rollouts from the shipped start
   frames instead. Written after every run.
e. ``decode``: the VAE decode of the request's latents: the engine's current decode (fused norms) against cuDNN
   benchmark mode, channels-last-3d weights and bf16; ``decode_compiled``: ``torch.compile`` of the whole decoder
   (public calls only; minutes of compiling, so last). With ``--only``, on random latents of the same shape.

Shapes are compiled statically (``automatic_dynamic_shapes`` off, a larger recompile limit) so that bf16 and FP8
compile alike; each (variant, shape) pays its compile and capture once, outside the timings. The table at the end
sums it up.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import math
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "recipes"))  # fidelity_pusht*

from common import (  # noqa: E402
    add_output_arguments,
    check_results_target,
    fp8_available,
    free_memory,
    gemm_peak_tflops,
    gen_twin,
    provenance,
    timed,
    write_results,
)
from gpu_suite import (  # noqa: E402
    GEN_PROMPT,
    diffusers_request,
    first_call_and_breakdown,
    gen_forward_flops,
    gen_forward_inputs,
    make_models,
    our_request,
    rel,
    scene,
)

from cosmos3_gym.engine import Cosmos3Engine  # noqa: E402
from cosmos3_gym.models.transformer import (  # noqa: E402
    Cosmos3RotaryEmbedding,
    Cosmos3Transformer,
    Cosmos3TransformerConfig,
)
from cosmos3_gym.models.vae import Cosmos3VAE  # noqa: E402
from cosmos3_gym.quantization import (  # noqa: E402
    DEFAULT_FP8_LAYERS,
    FP8_LAYER_POLICIES,
    apply_fp8,
    fp8_linear_names,
)
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG  # noqa: E402

BF16 = "bf16"
ENV_TIER = 256  # the vector-env target's resolution tier
ENV_TASK = "pick up the cup and put it in the bowl"


class Budget:
    """Wall-clock budget of the run: a section starts only if its estimate still fits."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def run_section(results: dict, name: str, budget: Budget, estimate_s: float, fn, save) -> None:
    """``results[name] = fn()`` unless less than ``estimate_s`` of the budget is left; an exception is recorded (the
    rest of the run goes on); the results are written after every section."""
    if budget.left() < estimate_s:
        results[name] = {"skipped": f"time budget: {budget.left():.0f} s left, the section needs ~{estimate_s:.0f} s"}
    else:
        started = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as error:  # noqa: BLE001 - recorded next to what the section wrote so far; later ones run
            traceback.print_exc()
            partial = results.get(name) if isinstance(results.get(name), dict) else {}
            results[name] = {**partial, "error": f"{type(error).__name__}: {error}"[:2000]}
            error = None  # drop the traceback's frames (and the tensors they hold) before freeing memory
            free_memory()
        if isinstance(results[name], dict):
            results[name]["section_s"] = time.perf_counter() - started
        print(f"[{name}] {time.perf_counter() - started:.0f} s, {budget.left():.0f} s of budget left", flush=True)
    save()


@contextlib.contextmanager
def tf32_off():
    """TF32 off for matmuls and cuDNN inside, the previous settings back after (also on an error): the fp32
    reference of ``velocity_error`` only. Everything timed runs with PyTorch's defaults, which is how diffusers'
    docs run the pipeline (TF32 off for matmuls, on for cuDNN convolutions: the fp32 VAE); the first run of this
    script turned both off for the whole run, which slowed every fp32 part, diffusers' baseline included."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def tf32_settings() -> dict:
    return {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}


def velocity(model: Cosmos3Transformer, thw, chunk: int, fps: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One GEN forward at batch 1 on inputs drawn from seed 0 (the same for every model), as float32 on the CPU."""
    torch.manual_seed(0)
    inputs = gen_forward_inputs(model, thw, 1, chunk, fps, device)
    with torch.inference_mode():
        video, action = model(*inputs)
    return video.float().cpu(), action.float().cpu()


def cast_model(model: Cosmos3Transformer, dtype: torch.dtype) -> Cosmos3Transformer:
    """A copy in ``dtype`` as ``load_diffusers_state_dict`` would load it (fp32 time embedder, fp32 rotary table)."""
    twin = copy.deepcopy(model).to(dtype)
    twin.time_embedder.float()
    twin.rotary = Cosmos3RotaryEmbedding(twin.config).to(twin.device)
    return twin


def velocity_error(tiny: bool, device: str, policies: list[str], num_layers: int, chunk: int, fps: float) -> dict:
    """bf16 and FP8 (per policy) GEN velocities against fp32 on the same random weights."""
    from common import fill_random_

    config = dict(TINY_TRANSFORMER_CONFIG) if tiny else {"action_gen": True, "action_dim": 64}
    config["num_hidden_layers"] = num_layers
    with torch.device("meta"):
        reference = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict(config))
    reference = reference.to_empty(device=device)
    fill_random_(reference)
    reference.rotary = Cosmos3RotaryEmbedding(reference.config).to(device)
    thw = (chunk // 4 + 1, 8, 8) if tiny else (chunk // 4 + 1, 30, 52)  # tier 480: 480x832 -> 30x52 latents
    with tf32_off():
        ref_video, ref_action = velocity(reference, thw, chunk, fps, device)
    bf16 = cast_model(reference, torch.bfloat16)
    del reference
    free_memory()
    video16, action16 = velocity(bf16, thw, chunk, fps, device)
    table = {"model": f"Nano width, {num_layers} layers, random weights" if not tiny else "tiny config",
             "latent_thw": thw, "reference": "the same model in fp32 (TF32 off)",
             BF16: {"video_rel": rel(video16, ref_video), "action_rel": rel(action16, ref_action)}}
    for policy in policies:
        if not fp8_available():
            table[f"fp8:{policy}"] = {"skipped": "needs a CUDA GPU with compute capability >= 8.9",
                                      "would_quantize": len(fp8_linear_names(bf16, policy))}
            continue
        fp8 = apply_fp8(copy.deepcopy(bf16), layers=policy)
        video8, action8 = velocity(fp8, thw, chunk, fps, device)
        table[f"fp8:{policy}"] = {
            "video_rel": rel(video8, ref_video), "action_rel": rel(action8, ref_action),
            "video_rel_vs_bf16": rel(video8, video16), "action_rel_vs_bf16": rel(action8, action16),
            "fp8_linears": len(fp8_linear_names(bf16, policy)),
        }
        del fp8
        free_memory()
    print("velocity error", table, flush=True)
    return table


def diffusers_baseline(pipe, image, settings: dict) -> dict:
    chunk, steps, guidance, fps, tier = (settings[k] for k in ("chunk", "steps", "guidance", "fps", "tier"))
    diffusers_request(pipe, "policy", image, chunk, steps, guidance, fps, tier)  # warm-up
    no_decode, _ = timed(lambda: diffusers_request(pipe, "policy", image, chunk, steps, guidance, fps, tier),
                         repeats=2, warmup=0)
    with_decode, _ = timed(lambda: diffusers_request(pipe, "policy", image, chunk, steps, guidance, fps, tier,
                                                     output_type="np"), repeats=1, warmup=0)
    # One env step as diffusers gives it, one env at a time: a forward-dynamics request at tier 256, decoded.
    env_image, env_actions = settings["env_image"], settings["env_raw_actions"]
    env_step, _ = timed(lambda: diffusers_request(pipe, "forward_dynamics", env_image, chunk, steps, guidance, fps,
                                                  ENV_TIER, env_actions, output_type="np"), repeats=2)
    result = {"policy_request_no_decode_s": no_decode, "policy_request_with_decode_s": with_decode,
              "env_step_tier256_s": env_step, "vae": "AutoencoderKLWan in fp32 (diffusers' documented setting)",
              "tf32": tf32_settings()}
    print("diffusers", result, flush=True)
    return result


def vector_env_throughput(engine: Cosmos3Engine, vaes: dict, num_envs: int, settings: dict,
                          diffusers_step_s: float | None) -> dict:
    """Env steps/s of ``gym.make_vec("cosmos3_gym/WorldModel-v0", num_envs, engine=engine)`` at tier 256 (chunk,
    steps, guidance as the policy request), once per VAE of ``vaes`` (name -> ``Cosmos3VAE``, swapped into the
    engine), against diffusers stepping one env at a time (``diffusers_step_s`` per env step). One env step = one
    forward-dynamics chunk for every env and the decode the env asks for (its observation: the chunk's last frame)."""
    import gymnasium as gym

    from cosmos3_gym.registration import ENV_ID

    own_vae = engine.vae
    table: dict = {"num_envs": num_envs, "resolution_tier": ENV_TIER, "image_hw": list(settings["env_image"].shape[:2]),
                   "diffusers_one_env_step_s": diffusers_step_s}
    for name, vae in vaes.items():
        engine.vae, envs = vae, None
        try:
            envs = gym.make_vec(ENV_ID, num_envs=num_envs, engine=engine, task=ENV_TASK, domain="droid_lerobot",
                                initial_states=[scene(*settings["env_image"].shape[:2], seed=i)
                                                for i in range(num_envs)],
                                chunk=settings["chunk"], num_steps=settings["steps"],
                                guidance_scale=settings["guidance"], fps=settings["fps"], resolution_tier=ENV_TIER)
            envs.reset(seed=0)
            actions = np.random.default_rng(0).uniform(-1, 1, envs.action_space.shape).astype(np.float32)
            started = time.perf_counter()
            envs.step(actions)  # compile + capture of this batch's shapes
            first = time.perf_counter() - started
            seconds, _ = timed(lambda: envs.step(actions), repeats=2, warmup=0)
        except torch.OutOfMemoryError:
            table[name] = {"error": "OOM"}
            continue
        finally:
            if envs is not None:
                envs.close()
            engine.vae = own_vae
            free_memory()
        entry = {"step_s": seconds, "first_step_s": first, "env_steps_per_s": num_envs / seconds}
        if diffusers_step_s:
            entry["speedup_vs_diffusers_one_env_at_a_time"] = num_envs * diffusers_step_s / seconds
        table[name] = entry
        print("vector env", name, entry, flush=True)
    return table


def measure_variant(master, engine, policy, settings, shapes, peak, device, tiny, baseline_actions, diffusers,
                    env_vaes: dict | None) -> dict:
    """GEN-forward table, policy request and (``env_vaes`` given) vector-env throughput of one variant (see the
    module docstring)."""
    from cosmos3_gym.cuda_graphs import GraphedGenForward

    chunk, fps = settings["chunk"], settings["fps"]
    cuda = device == "cuda"
    twin = gen_twin(master, policy, compile_blocks=not tiny)
    entry: dict = {"fp8_linears": 0 if policy is None else len(fp8_linear_names(master, policy)),
                   "gen_forward": {}}
    forward = GraphedGenForward(twin, max_graphs=1) if cuda else twin  # one shape at a time: frees each graph
    for tier, batch, thw in shapes:
        key = f"tier{tier}_b{batch}"
        torch.manual_seed(0)
        inputs = gen_forward_inputs(twin, thw, batch, chunk, fps, device)
        try:
            with torch.inference_mode():
                started = time.perf_counter()
                forward(*inputs)  # compile + capture
                first = time.perf_counter() - started
                seconds, _ = timed(functools.partial(forward, *inputs), repeats=3, warmup=0)
        except torch.OutOfMemoryError:
            entry["gen_forward"][key] = {"error": "OOM"}
            free_memory()
            continue
        tokens = thw[0] * math.ceil(thw[1] / 2) * math.ceil(thw[2] / 2) + chunk
        flops = batch * gen_forward_flops(twin.config, tokens, len(GEN_PROMPT))
        entry["gen_forward"][key] = {"forward_s": seconds, "first_call_s": first, "gen_tokens": tokens,
                                     "tflops": flops / seconds / 1e12, "vs_bf16_gemm_peak": flops / seconds / 1e12
                                     / peak}
        print(policy or BF16, key, entry["gen_forward"][key], flush=True)
    del forward
    free_memory()

    variant_engine = Cosmos3Engine(twin, engine.vae, engine.tokenizer, engine.scheduler_config, progress=False)
    if cuda:
        variant_engine.optimize()  # CUDA graphs (the blocks are compiled already; the VAE norms fused once)
    request = our_request("policy", settings["image"], chunk, settings["steps"], settings["guidance"], fps,
                          settings["tier"])
    entry["request_first_call_s"], breakdown, result = first_call_and_breakdown(variant_engine, request)
    entry["policy_request"] = breakdown
    if diffusers and "policy_request_no_decode_s" in diffusers:
        entry["speedup_no_decode_vs_diffusers"] = diffusers["policy_request_no_decode_s"] / \
            breakdown["total_no_decode_s"]
        entry["speedup_with_decode_vs_diffusers"] = diffusers["policy_request_with_decode_s"] / \
            breakdown["total_with_decode_s"]
    if baseline_actions is None:  # bf16: the spread two seeds give is the yardstick of the FP8 action error
        other_seed = variant_engine.step(dataclasses.replace(request, seed=1), decode=False)
        entry["action_rel_seed0_vs_seed1"] = rel(other_seed.action, result.action)
    else:
        entry["action_rel_vs_bf16"] = rel(result.action, baseline_actions[0])
        entry["video_latents_rel_vs_bf16"] = rel(result.video_latents, baseline_actions[1])
    print(policy or BF16, "request", {k: v for k, v in entry.items() if k != "gen_forward"}, flush=True)
    if env_vaes:
        try:
            entry["vector_env"] = vector_env_throughput(variant_engine, env_vaes, settings["num_envs"], settings,
                                                        (diffusers or {}).get("env_step_tier256_s"))
        except Exception as error:  # noqa: BLE001 - recorded; the variant's other numbers stand
            traceback.print_exc()
            entry["vector_env"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    entry["_outputs"] = (result.action, result.video_latents)
    variant_engine.close()
    del variant_engine, twin
    free_memory()
    return entry


def pusht_accuracy(results: dict, save, device: str, policies: list[str], ranking_policies: list[str], episodes: int,
                   chunks: int, ranking_starts: int, ranking_chunks: int, budget: Budget) -> dict:
    """The trained PushT model in bf16 (seeds 0 and 1) and FP8 per policy: see the module docstring. Fills
    ``results`` and calls ``save()`` after every run, so a run cut short keeps what it measured; a run that would
    start with less than ``PUSHT_RUN_S`` of the budget left is skipped and says so."""
    import importlib.util

    from fidelity_pusht import action_following
    from fidelity_pusht_chunks import load_episodes

    from cosmos3_gym.processor import ActionStats
    from cosmos3_gym.tasks.pusht import episodes as pusht
    from cosmos3_gym.tasks.pusht.compare import compare_with_simulator
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets, pusht_env_defaults

    assets = load_pusht_assets(None)
    defaults = pusht_env_defaults(assets)
    stats = ActionStats.from_json(defaults["action_stats"], mode=assets.meta.get("action_normalization", "minmax"))
    chunk = defaults["chunk"]
    fp8_runs = [(f"fp8:{policy}", policy, 0) for policy in policies] if fp8_available() else []
    runs = [(BF16, None, 0), (f"{BF16}_seed1", None, 1)] + fp8_runs

    def load(policy):
        if policy == DEFAULT_FP8_LAYERS:  # the engine's own path
            return Cosmos3Engine.from_pretrained(assets.checkpoint, device=device, precision="fp8", progress=False)
        engine = Cosmos3Engine.from_pretrained(assets.checkpoint, device=device, progress=False)
        if policy is not None:
            apply_fp8(engine.transformer, layers=policy)
        return engine

    def out_of_time() -> dict | None:
        left = budget.left()
        return {"skipped": f"time budget: {left:.0f} s left, a run needs ~{PUSHT_RUN_S:.0f} s"} \
            if left < PUSHT_RUN_S else None

    has_simulator = importlib.util.find_spec("gym_pusht") is not None
    results.update({"checkpoint": str(assets.checkpoint), "has_gym_pusht": has_simulator,
                    "fp8": "measured" if fp8_available() else "skipped: needs a GPU with compute capability >= 8.9"})
    if not has_simulator:
        return pusht_rollout_psnr(results, runs, load, assets, defaults, episodes, chunks)
    heldout = pusht.generate_pusht_dataset(
        Path(tempfile.mkdtemp()) / "heldout", episodes, steps_per_episode=chunks * chunk,
        image_size=tuple(assets.meta["image_size"]), seed=10_000,
    )
    held = load_episodes(heldout, episodes)
    following = results["action_following"] = {"episodes": episodes, "chunks": chunks}
    for name, policy, seed in runs:
        following[name] = out_of_time()
        if following[name] is None:
            started = time.perf_counter()
            engine = load(policy)
            try:
                rollout = action_following(engine, assets.root, held, stats, chunks, seed)["rollout"]
            finally:
                engine.close()
            following[name] = {
                "psnr_db_per_chunk": rollout["psnr_db"], "ssim_per_chunk": rollout["ssim"],
                "block_error_px_per_chunk": rollout["block_error_px"],
                "psnr_db_mean": float(np.mean([c["mean"] for c in rollout["psnr_db"]])),
                "block_error_px_mean": float(np.nanmean([c["mean"] for c in rollout["block_error_px"]])),
                "seconds": time.perf_counter() - started,
            }
            summary = {k: v for k, v in following[name].items() if k.endswith("_mean") or k == "seconds"}
            print("pusht following", name, summary, flush=True)
        save()

    # The ranking (each run's "agreement": world-model against simulator scores): bf16 seed 0, the first FP8 policy,
    # bf16 seed 1 (the agreement's spread between seeds; seed 1 also draws other random / agent actions), the rest.
    ranking = results["policy_ranking"] = {"num_starts": ranking_starts, "num_chunks": ranking_chunks,
                                           "policies": PUSHT_RANKED_POLICIES}
    fp8_ranked = [(f"fp8:{policy}", policy, 0) for policy in ranking_policies] if fp8_available() else []
    ranking_runs = [(BF16, None, 0), *fp8_ranked[:1], (f"{BF16}_seed1", None, 1), *fp8_ranked[1:]]
    for name, policy, seed in ranking_runs:
        ranking[name] = out_of_time()
        if ranking[name] is None:
            started = time.perf_counter()
            engine = load(policy)
            try:
                ranking[name] = compare_with_simulator(
                    PUSHT_RANKED_POLICIES, num_starts=ranking_starts, num_chunks=ranking_chunks,
                    first_sim_seed=110_000, assets_dir=assets.root, engine=engine, seed=seed)
            finally:
                engine.close()
            ranking[name]["seconds"] = time.perf_counter() - started
            print("pusht ranking", name, ranking[name]["agreement"], flush=True)
            if policy is not None and "policies" in (ranking.get(BF16) or {}):  # same seed, same policy actions
                ranking[name]["world_model_scores_vs_bf16"] = score_agreement(ranking[BF16], ranking[name])
        save()
    return results


PUSHT_RUN_S = 30.0  # a PushT run (following or ranking) on an H200: a guess, each run records its "seconds"
PUSHT_RANKED_POLICIES = "random,scripted:0,scripted:25,scripted:50,agent"


def score_agreement(reference: dict, other: dict) -> dict:
    """How close ``other``'s world-model final coverages (one per ranked policy) are to ``reference``'s."""
    names = list(reference["policies"])
    a = np.array([reference["policies"][n]["world_model"]["final_coverage"] for n in names])
    b = np.array([other["policies"][n]["world_model"]["final_coverage"] for n in names])
    pearson = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")
    return {"pearson": pearson, "max_abs_difference": float(np.max(np.abs(a - b)))}


def pusht_rollout_psnr(results, runs, load, assets, defaults, episodes, chunks) -> dict:
    """Without gym-pusht: the PSNR between FP8 and bf16 rollouts from the shipped start frames."""
    from cosmos3_gym.tasks.pusht import episodes as pusht
    from cosmos3_gym.tasks.pusht.compare import replay_actions
    from cosmos3_gym.tasks.pusht.env import make_pusht_vector_env

    with np.load(assets.initial_states) as archive:
        starts = archive["frames"][:episodes]
    chunk = defaults["chunk"]
    actions = np.random.default_rng(0).uniform(-1, 1, (len(starts), chunks, chunk, defaults["raw_action_dim"]))
    rollouts = {}
    for name, policy, seed in runs:
        engine = load(policy)
        envs = make_pusht_vector_env(len(starts), engine=engine, return_frames=True, reward_model=None,
                                     success_threshold=None, max_episode_steps=None)
        try:
            rollouts[name] = replay_actions(envs, starts, actions.astype(np.float32), seed=seed)
        finally:
            envs.close()
            engine.close()
    reference = rollouts[BF16]
    results["rollout_psnr_db_vs_bf16_seed0"] = {
        name: [pusht.psnr(reference[:, k], frames[:, k]) for k in range(chunks)]
        for name, frames in rollouts.items() if name != BF16
    }
    return results


def decode_variants(vae_module, latents: torch.Tensor, compiled: bool) -> dict:
    """The engine's decode after ``optimize()`` (fused norms, fp32) against cuDNN benchmark mode, channels-last-3d
    weights and bf16 (``compiled`` False), or against ``torch.compile`` of the whole decoder (``compiled`` True: its
    compiles take minutes, so it is a section of its own, last); each built from an untouched copy of the VAE."""

    def fresh(dtype=torch.float32) -> Cosmos3VAE:
        return Cosmos3VAE(copy.deepcopy(vae_module).to(dtype))

    table = {}
    reference = None
    candidates = [("current_fused_norms", False, lambda: fresh().fuse_decoder_norms())]
    if compiled:
        candidates += [("compiled_decoder", False, lambda: compiled_decoder(fresh())),
                       ("compiled_decoder_cudnn_benchmark", True, None)]
    else:
        candidates += [
            ("current_fused_norms_cudnn_benchmark", True, None),  # the same VAE object, cuDNN benchmark on
            ("channels_last_3d", False, lambda: fresh().use_channels_last().fuse_decoder_norms()),
            ("channels_last_3d_cudnn_benchmark", True, None),
            ("bf16_fused_norms_cudnn_benchmark", True, lambda: fresh(torch.bfloat16).fuse_decoder_norms()),
            ("bf16_channels_last_3d_cudnn_benchmark", True,
             lambda: fresh(torch.bfloat16).use_channels_last().fuse_decoder_norms()),
        ]
    vae = None
    for name, benchmark, build in candidates:
        torch.backends.cudnn.benchmark = benchmark
        try:
            if build is not None:
                vae = None
                free_memory()
                vae = build()
            started = time.perf_counter()
            pixels = vae.decode(latents)
            first = time.perf_counter() - started
            seconds, _ = timed(lambda: vae.decode(latents), repeats=2, warmup=0)
        except Exception as error:  # noqa: BLE001 - one variant failing does not stop the others
            traceback.print_exc()
            table[name] = {"error": f"{type(error).__name__}: {error}"[:1000]}
            continue
        if reference is None:
            reference = pixels
        table[name] = {"seconds": seconds, "first_call_s": first,
                       "max_abs_vs_current": float((pixels - reference).abs().max())}
        print("decode", name, table[name], flush=True)
    torch.backends.cudnn.benchmark = False
    current = table.get("current_fused_norms", {}).get("seconds")
    if current:
        for entry in table.values():
            if "seconds" in entry:
                entry["speedup_vs_current"] = current / entry["seconds"]
    table["latents_shape"] = list(latents.shape)
    return table


def compiled_decoder(vae: Cosmos3VAE) -> Cosmos3VAE:
    """``torch.compile`` of the whole decoder module (inductor then fuses the norms itself). Dynamic shapes: the
    first latent frame (no cache yet) and the later chunks (whose cached frames differ in count) share two graphs
    instead of compiling three."""
    vae.vae.decoder.compile(dynamic=True)
    return vae


def _num(value, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (width first, e.g. "10.4f") and ``suffix``; "-" at that width if missing."""
    width = int(re.match(r"\d*", spec).group() or 0)
    return f"{value:{spec}}{suffix}" if isinstance(value, (int, float)) else "-".rjust(width + len(suffix))


def summary_table(results: dict) -> str:
    """The run at a glance: GEN forward and request per variant, velocity error per policy, decode, PushT."""
    variants = {k: v for k, v in results.get("variants", {}).items() if isinstance(v, dict)}
    bf16_forward = variants.get(BF16, {}).get("gen_forward", {})
    shapes = list(bf16_forward) or ["tier480_b1", "tier480_b16", "tier256_b1", "tier256_b16"]
    lines = ["GEN forward, compiled + CUDA graph (ms; speedup over bf16)",
             f"{'variant':<22}" + "".join(f"{shape:>20}" for shape in shapes)]
    for name, entry in variants.items():
        if "gen_forward" not in entry:
            lines.append(f"{name:<22}{entry.get('error') or entry.get('skipped')}")
            continue
        cells = []
        for shape in shapes:
            seconds = entry["gen_forward"].get(shape, {}).get("forward_s")
            base = bf16_forward.get(shape, {}).get("forward_s")
            speedup = base / seconds if seconds and base else None
            cells.append(f"{_num(seconds and seconds * 1e3, '.1f')} ({_num(speedup, '.2f', 'x')})")
        lines.append(f"{name:<22}" + "".join(f"{cell:>20}" for cell in cells))

    lines += ["", "policy request (s; speedup over diffusers in the same run; actions' relative difference from bf16 "
              "seed 0, on the bf16 row seed 1's)",
              f"{'variant':<22}{'no decode':>12}{'with decode':>12}{'x diffusers':>12}{'x diff. dec':>12}"
              f"{'actions':>10}"]
    diffusers = results.get("diffusers", {})
    lines.append(f"{'diffusers':<22}{_num(diffusers.get('policy_request_no_decode_s'), '12.3f')}"
                 f"{_num(diffusers.get('policy_request_with_decode_s'), '12.3f')}")
    for name, entry in variants.items():
        if "policy_request" not in entry:
            lines.append(f"{name:<22}{entry.get('error') or entry.get('skipped')}")
            continue
        request = entry["policy_request"]
        action = entry.get("action_rel_vs_bf16", entry.get("action_rel_seed0_vs_seed1"))
        lines.append(f"{name:<22}{_num(request.get('total_no_decode_s'), '12.3f')}"
                     f"{_num(request.get('total_with_decode_s'), '12.3f')}"
                     f"{_num(entry.get('speedup_no_decode_vs_diffusers'), '11.2f', 'x')}"
                     f"{_num(entry.get('speedup_with_decode_vs_diffusers'), '11.2f', 'x')}{_num(action, '10.4f')}")

    env_rows = [(name, entry["vector_env"]) for name, entry in variants.items() if "vector_env" in entry]
    if env_rows:
        lines += ["", f"gym.make_vec, tier {ENV_TIER}, {env_rows[0][1].get('num_envs')} envs: env steps/s (speedup "
                      f"over diffusers one env at a time, {_num(diffusers.get('env_step_tier256_s'), '.3f')} s a "
                      f"step)"]
    for name, table in env_rows:
        cells = [f"{vae}: {_num(entry.get('env_steps_per_s'), '.2f')} "
                 f"({_num(entry.get('speedup_vs_diffusers_one_env_at_a_time'), '.2f', 'x')})"
                 for vae, entry in table.items() if isinstance(entry, dict)]
        lines.append(f"{name:<22}" + ("   ".join(cells) or str(table.get("error"))))

    lines += ["", "GEN velocity relative error vs fp32 (Nano width, random weights)",
              f"{'variant':<22}{'video':>10}{'action':>10}{'video vs bf16':>15}"]
    for name, entry in results.get("velocity_error", {}).items():
        if isinstance(entry, dict) and ("video_rel" in entry or "skipped" in entry):
            lines.append(f"{name:<22}{_num(entry.get('video_rel'), '10.4f')}{_num(entry.get('action_rel'), '10.4f')}"
                         f"{_num(entry.get('video_rel_vs_bf16'), '15.4f')}")

    lines += ["", "decode (s; speedup over the current decode; max |pixel difference|)"]
    for section in ("decode", "decode_compiled"):
        for name, entry in results.get(section, {}).items():
            if isinstance(entry, dict) and "seconds" in entry:
                lines.append(f"{section + ':' + name:<54}{entry['seconds']:8.3f}"
                             f"{_num(entry.get('speedup_vs_current'), '8.2f', 'x')}  {entry['max_abs_vs_current']:.1e}")

    following = results.get("pusht", {}).get("action_following", {})
    if following:
        lines += ["", "PushT action following (mean over chunks)"]
    for name, entry in following.items():
        if isinstance(entry, dict) and "psnr_db_mean" in entry:
            lines.append(f"{name:<22}PSNR {entry['psnr_db_mean']:.2f} dB   block error "
                         f"{entry['block_error_px_mean']:.1f} px")
    ranking = results.get("pusht", {}).get("policy_ranking", {})
    if ranking:
        lines += ["", "PushT policy ranking: world model vs simulator final coverage (Spearman, Pearson); FP8's "
                      "world-model scores vs bf16's (Pearson)"]
    for name, entry in ranking.items():
        if isinstance(entry, dict) and "agreement" in entry:
            agreement = entry["agreement"]
            lines.append(f"{name:<22}{_num(agreement.get('spearman'), '8.3f')}{_num(agreement.get('pearson'), '8.3f')}"
                         f"{_num(entry.get('world_model_scores_vs_bf16', {}).get('pearson'), '8.3f')}")
    return "\n".join(lines)


SKIPPABLE_SECTIONS = ("velocity_error", "vector_env", "pusht", "decode", "decode_compiled")
STANDALONE_SECTIONS = ("pusht", "decode", "decode_compiled")  # need no Nano transformer: --only runs them alone


def section_list(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise SystemExit(f"{option}: unknown section(s) {unknown}; expected some of {list(allowed)}")
    return names


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU dry run with tiny models (FP8 skipped)")
    add_output_arguments(parser)
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip sections that would start after this many seconds of main() (wheels and imports "
                             "come on top: about 60 s)")
    parser.add_argument("--skip", default="", metavar="SECTIONS",
                        help=f"sections of the full run to leave out, comma-separated: {','.join(SKIPPABLE_SECTIONS)}")
    parser.add_argument("--only", default="", metavar="SECTIONS",
                        help=f"run only these sections, comma-separated, of {','.join(STANDALONE_SECTIONS)} (the "
                             f"decode ones on random latents of the tier-480 request's shape)")
    parser.add_argument("--decode-only", action="store_true", help="the same as --only decode,decode_compiled")
    parser.add_argument("--pusht-only", action="store_true", help="the same as --only pusht")
    parser.add_argument("--speed-policies", default="all,keep_qkv,keep_qkv_edges",
                        help="FP8 layer policies timed on the full Nano model (in this order)")
    parser.add_argument("--vector-env-variants", default=f"{BF16},fp8:all,fp8:keep_qkv",
                        help="variants whose gym.make_vec throughput (16 envs, tier 256) is measured")
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--error-policies", default=",".join(FP8_LAYER_POLICIES),
                        help="FP8 layer policies whose velocity error is measured")
    parser.add_argument("--pusht-policies", default="all,keep_qkv,keep_qkv_edges,mlp_only",
                        help="FP8 layer policies whose PushT action following is measured")
    parser.add_argument("--pusht-ranking-policies", default="all,keep_qkv",
                        help="FP8 layer policies whose PushT policy ranking is measured")
    parser.add_argument("--error-layers", type=int, default=8, help="layers of the Nano-width error model")
    parser.add_argument("--pusht-episodes", type=int, default=8)
    parser.add_argument("--pusht-chunks", type=int, default=4)
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    tiny = args.tiny
    device = "cpu" if tiny else "cuda"
    only = section_list(args.only, STANDALONE_SECTIONS, "--only")
    only += ["pusht"] * args.pusht_only + ["decode", "decode_compiled"] * args.decode_only
    only = [name for name in STANDALONE_SECTIONS if name in only]
    skip = set(section_list(args.skip, SKIPPABLE_SECTIONS, "--skip"))
    name = "_".join(["fp8_gpu", *only, *(["tiny"] if tiny else [])]) + ".json"
    for option in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, option):
            setattr(torch._dynamo.config, option, 64)
    torch._dynamo.config.automatic_dynamic_shapes = False

    results: dict = {"provenance": provenance(["benchmarks/fp8_gpu.py", *(argv if argv is not None else
                                                                           sys.argv[1:])])}
    check_results_target(name, args.out, args.overwrite)
    save = lambda: write_results(results, name, args.out, args.overwrite)  # noqa: E731
    results["fp8_available"] = fp8_available()
    results["default_fp8_layers"] = DEFAULT_FP8_LAYERS
    results["layer_policies"] = {key: policy.description for key, policy in FP8_LAYER_POLICIES.items()}
    results["tf32"] = {**tf32_settings(), "note": "PyTorch's defaults, as diffusers' docs run; only the fp32 "
                                                  "reference of velocity_error turns TF32 off"}
    settings = dict(chunk=32, steps=4, guidance=3.0, fps=15.0, tier=480) if not tiny else \
        dict(chunk=8, steps=2, guidance=3.0, fps=15.0, tier=256)
    settings["image"] = scene(480, 832) if not tiny else scene(256, 256)
    settings["env_image"] = scene(256, 256, seed=1)
    settings["env_raw_actions"] = np.random.default_rng(1).uniform(-1, 1, (settings["chunk"], 10)).astype(np.float32)
    settings["num_envs"] = args.num_envs if not tiny else 2
    error_policies = [p for p in args.error_policies.split(",") if p]
    speed_policies = [p for p in args.speed_policies.split(",") if p]
    pusht_policies = [p for p in args.pusht_policies.split(",") if p]
    ranking_policies = [p for p in args.pusht_ranking_policies.split(",") if p]

    def pusht():
        run_pusht(results, args, budget, device, tiny, pusht_policies, ranking_policies, save)

    if only:
        if "pusht" in only:
            pusht()
        if "decode" in only or "decode_compiled" in only:
            vae, latents = random_decode_inputs(tiny, settings, device)
            results["decode_latents"] = "random normal latents (decode speed does not depend on their values)"
            if "decode" in only:
                run_section(results, "decode", budget, 0, lambda: decode_variants(vae, latents, compiled=False), save)
            if "decode_compiled" in only and tiny:
                results["decode_compiled"] = {"skipped": "--tiny: compiling the whole decoder takes minutes on a CPU"}
            elif "decode_compiled" in only:
                run_section(results, "decode_compiled", budget, DECODE_COMPILED_S,
                            lambda: decode_variants(vae, latents, compiled=True), save)
        results["wall_s"] = time.perf_counter() - budget.start
        save()
        print(summary_table(results))
        return results

    if not tiny:
        results["gemm_bf16_tflops"] = gemm_peak_tflops()
    peak = results.get("gemm_bf16_tflops", 1.0)

    # b. first, while the GPU is empty: a Nano-width fp32 model next to its bf16 and FP8 copies.
    if "velocity_error" not in skip:
        run_section(results, "velocity_error", budget, 15,
                    lambda: velocity_error(tiny, device, error_policies, args.error_layers if not tiny else 4,
                                           settings["chunk"], settings["fps"]), save)
        free_memory()

    started = time.perf_counter()
    pipe, engine, _ = make_models(tiny, device)
    results["build_s"] = time.perf_counter() - started
    pristine_vae = copy.deepcopy(engine.vae.vae)  # before optimize() fuses the shared decoder's norms in place
    run_section(results, "diffusers", budget, 25, lambda: diffusers_baseline(pipe, settings["image"], settings), save)
    pipe = None  # the engine keeps the weights it shares with diffusers' transformer; the rest is freed
    free_memory()

    # The vector env runs with the engine's VAE (fp32, as gym.make_vec loads it by default) and with a bf16 one
    # (vae_dtype="bf16").
    env_variants = set() if "vector_env" in skip else {v for v in args.vector_env_variants.split(",") if v}
    env_vaes = {"vae_fp32": engine.vae,
                "vae_bf16": Cosmos3VAE(copy.deepcopy(pristine_vae).to(torch.bfloat16)).fuse_decoder_norms()} \
        if env_variants else None

    master = engine.transformer
    if not tiny:
        for block in master.text_layers:  # once, shared by every variant (compile_blocks' text half)
            block.text_forward = torch.compile(block.text_forward)
    latent_hw_480 = (15, 26) if tiny else (30, 52)
    shapes = [("480", 1, (settings["chunk"] // 4 + 1, *latent_hw_480)),
              ("480", 16 if not tiny else 2, (settings["chunk"] // 4 + 1, *latent_hw_480)),
              ("256", 1, (settings["chunk"] // 4 + 1, 16, 16)),
              ("256", 16 if not tiny else 2, (settings["chunk"] // 4 + 1, 16, 16))]
    results["variants"] = {}
    variants = [(BF16, None)] + [(f"fp8:{p}", p) for p in speed_policies]
    baseline = None

    def measure(label, policy):
        return measure_variant(master, engine, policy, settings, shapes, peak, device, tiny, baseline,
                               results.get("diffusers"), env_vaes if label in env_variants else None)

    for index, (label, policy) in enumerate(variants):
        if policy is not None and not fp8_available():
            results["variants"][label] = {"skipped": "needs a CUDA GPU with compute capability >= 8.9"}
            continue
        if index == 2:  # bf16 and the first FP8 policy are in: PushT accuracy and the decode before the rest
            if "pusht" not in skip:
                pusht()
            if "decode" not in skip:
                run_decode(results, budget, pristine_vae, baseline, device, save)
        holder: dict = {}
        run_section(holder, label, budget, 90, lambda: measure(label, policy), save)
        entry = holder[label]
        outputs = entry.pop("_outputs", None) if isinstance(entry, dict) else None
        if policy is None and outputs is not None:
            baseline = outputs
        results["variants"][label] = entry
        save()
    if "pusht" not in results and "pusht" not in skip:
        pusht()
    if "decode" not in results and "decode" not in skip:
        run_decode(results, budget, pristine_vae, baseline, device, save)
    if not tiny and baseline is not None and "decode_compiled" not in skip:  # takes minutes: last
        latents = baseline[1][None].to(device)
        run_section(results, "decode_compiled", budget, DECODE_COMPILED_S,
                    lambda: decode_variants(pristine_vae, latents, compiled=True), save)
    results["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    results["wall_s"] = time.perf_counter() - budget.start
    save()
    print(summary_table(results))
    return results


DECODE_COMPILED_S = 150.0  # whole-decoder compile (never measured to the end yet) and its timings: a guess with margin


def random_decode_inputs(tiny: bool, settings: dict, device: str):
    """The Wan2.2 VAE (random weights) and random latents of the tier-480 request's shape (tiny: the tiny VAE)."""
    from common import build_wan22_vae

    from cosmos3_gym.testing import TINY_VAE_CONFIG

    if tiny:
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan(**TINY_VAE_CONFIG, latents_mean=[0.0] * 16, latents_std=[1.0] * 16).eval()
        shape = (1, 16, settings["chunk"] // 4 + 1, 16, 16)
    else:
        vae = build_wan22_vae(device)
        shape = (1, 48, settings["chunk"] // 4 + 1, 30, 52)
    return vae, torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)


def run_decode(results, budget, pristine_vae, baseline, device, save) -> None:
    """e. on the bf16 policy request's latents (tier 480)."""
    if baseline is None:
        results["decode"] = {"skipped": "no bf16 policy request to take latents from"}
        return
    latents = baseline[1][None].to(device)
    run_section(results, "decode", budget, 40, lambda: decode_variants(pristine_vae, latents, compiled=False), save)


def run_pusht(results, args, budget, device, tiny, policies, ranking_policies, save) -> None:
    episodes, chunks = (args.pusht_episodes, args.pusht_chunks) if not tiny else (2, 1)
    starts, ranking_chunks = (8, 4) if not tiny else (1, 1)
    table = results["pusht"] = {}  # filled run by run (see pusht_accuracy)
    run_section(results, "pusht", budget, PUSHT_RUN_S,
                lambda: pusht_accuracy(table, save, device, policies, ranking_policies, episodes, chunks, starts,
                                       ranking_chunks, budget), save)


if __name__ == "__main__":
    main()
