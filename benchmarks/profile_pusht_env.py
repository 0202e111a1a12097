"""Where a PushT-v0 env step spends its time: host time per stage and a torch.profiler summary, at several env counts.

    python benchmarks/profile_pusht_env.py --device cpu --envs 1,4 --steps 3          # CPU, a minute or two
    python benchmarks/profile_pusht_env.py --device cuda --envs 1,16,64,256 --out $OUT  # one GPU, ~3 min

For each env count and each path (``--paths``: ``fast``, the default of ``gym.make_vec("cosmos3_gym/PushT-v0")``;
``baseline``, the same env with ``optimize=False``: eager engine, fp32 VAE, every frame decoded; with ``--decoder
light`` also ``light``, the default env with ``decoder="light"``), random actions:

* ``step_s``: wall time of one ``env.step`` (median of ``--steps`` after ``--warmup``), env steps/s = envs / step_s;
* ``stages_s``: host time per stage of one step, measured with a device sync around each stage (so the stages add
  up, at the price of the overlap a normal step has): ``request_prep`` (``engine._prepare_batch`` less its encode:
  frames on the canvas, prompt, actions, schedule), ``encode`` (VAE encode of the conditioning frames), ``text``
  (prompt K/V, cached), ``denoise`` (the batched denoising loop, everything in ``_denoise`` but text and decode),
  ``decode`` (VAE decode), ``reward`` (reward model), ``env_rest`` (everything else: seeds, requests, uint8
  conversion, observations, infos);
* ``profile``: one profiled step (``benchmarks/profile_gpu.py``'s ``summarise``: GPU busy / idle, kernel launches,
  top kernels, top CPU ops).

``--host-only`` stubs the transformer and the VAE (``stub_model``) to measure the host stages alone.
Results JSON (card, commit, command) via ``benchmarks/common.py``; ``--trace`` also writes Chrome traces.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_decoder_arguments,
    add_output_arguments,
    check_results_target,
    provenance,
    sync,
    use_decoder_arguments,
    write_results,
)
from profile_gpu import profile_call, summarise  # noqa: E402

from cosmos3_gym.tasks.pusht.env import make_pusht_vector_env  # noqa: E402

STAGES = ("request_prep", "encode", "text", "denoise", "decode", "reward", "env_rest")


class StageTimer:
    """Wraps the engine's and the env core's stage methods (instance attributes) to add up their synced wall time."""

    def __init__(self, env):
        self.totals = dict.fromkeys(STAGES, 0.0)
        self.inner = 0.0  # time of stages nested inside _denoise (text, decode), subtracted from "denoise"
        engine, core = env.engine, env._core
        # request_prep: the whole batched preparation (per-request ``prepare`` calls or the batched path) less the
        # encode nested in it.
        self._wrap(engine, "_prepare_batch", "request_prep", outer=True)
        self._wrap(engine, "_encode_conditions", "encode", nested=True)
        self._wrap(engine, "text_kvs", "text", nested=True)
        self._wrap(engine, "_decode", "decode", nested=True)
        self._wrap(engine, "_denoise", "denoise", outer=True)
        self._wrap(core, "_score", "reward")

    def _wrap(self, obj, name, stage, nested=False, outer=False):
        method = getattr(obj, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            sync()
            start = time.perf_counter()
            inner_before = self.inner
            try:
                return method(*args, **kwargs)
            finally:
                sync()
                elapsed = time.perf_counter() - start
                if outer:
                    self.totals[stage] += elapsed - (self.inner - inner_before)
                else:
                    self.totals[stage] += elapsed
                if nested:
                    self.inner += elapsed

        setattr(obj, name, timed)

    def reset(self):
        self.totals = dict.fromkeys(STAGES, 0.0)
        self.inner = 0.0


def stub_model(engine) -> None:
    """``--host-only``: the transformer and the VAE return zeros / mid-grey of the right shapes at once, so that the
    host stages (request_prep, env_rest, and the reward model) are measured alone, in seconds even on a CPU at 64
    envs. Their cost does not depend on the model's values; the model stages then read ~0."""
    config = engine.transformer.config
    compression = engine.vae.temporal_compression

    def forward(text, layout, video, video_noisy, timesteps, actions, *rest):
        return torch.zeros_like(video), torch.zeros_like(actions)

    def encode(pixels):
        b, _, t, h, w = pixels.shape
        return torch.zeros(b, config.latent_channel, (t - 1) // compression + 1, h // 16, w // 16, device=pixels.device)

    def decode(video, frames="all"):
        b, _, t, h, w = video.shape
        frames_out = 1 if frames == "last" else (t - 1) * compression + 1
        return torch.full((b, 3, frames_out, h * 16, w * 16), 0.5, device=video.device)

    forward.row_counts = set()  # what the engine reads of a ``GraphedGenForward`` (no kept graphs: rows bucketed)
    forward.max_padding = None
    engine._graphed_forward = forward
    engine.vae.encode = encode
    engine.vae.decode = decode
    if getattr(engine, "light_decoder", None) is not None:
        engine.light_decoder.decode = decode


def measure(num_envs: int, path: str, args) -> dict:
    options = {"decoder": "light"} if path == "light" else {}
    if args.reward_model is not None:
        options["reward_model"] = args.reward_model
    env = make_pusht_vector_env(num_envs, assets_dir=args.assets, device=args.device, optimize=path != "baseline",
                                **options)
    if args.host_only:
        stub_model(env.engine)
    try:
        env.reset(seed=0)
        env.action_space.seed(0)

        def step():
            env.step(env.action_space.sample())

        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            sync()
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times)

        timer = StageTimer(env)
        stage_runs = []
        for _ in range(args.steps):
            timer.reset()
            sync()
            start = time.perf_counter()
            step()
            sync()
            total = time.perf_counter() - start
            stages = dict(timer.totals)
            stages["env_rest"] = total - sum(stages.values())
            stage_runs.append(stages)
        stages = {k: statistics.median(run[k] for run in stage_runs) for k in STAGES}

        prof, wall = profile_call(step)
        if args.trace:
            prof.export_chrome_trace(str(Path(args.out or ".") / f"profile_pusht_{path}_{num_envs}.trace.json"))
        entry = {
            "step_s": step_s,
            "step_times_s": times,
            "env_steps_per_s": num_envs / step_s,
            "stages_s": stages,
            "profile": summarise(prof, wall, top=12),
        }
        if torch.cuda.is_available():
            entry["gpu_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        return entry
    finally:
        env.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--envs", default="1,16,64,256", help="comma-separated env counts")
    parser.add_argument("--paths", default="fast,baseline", help="fast (the default env) and/or baseline")
    add_decoder_arguments(parser, "light: also profile the default env with decoder='light' (path 'light')")
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the installed built-in one)")
    parser.add_argument("--reward-model", default=None,
                        help="reward-model spec for the env, e.g. pusht_geometric (default: the model's own)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles, CUDA-graph captures)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--host-only", action="store_true",
                        help="stub the transformer and VAE (stub_model): measure the host stages alone")
    parser.add_argument("--trace", action="store_true", help="write Chrome traces next to the results")
    add_output_arguments(parser)
    parser.add_argument("--name", default=None, help="results file name (default: profile_pusht_env_<device>.json)")
    args = parser.parse_args(argv)
    name = args.name or f"profile_pusht_env_{args.device.split(':')[0]}.json"
    check_results_target(name, args.out, args.overwrite)  # before measuring
    use_decoder_arguments(parser, args)
    paths = args.paths.split(",") + (["light"] if args.decoder == "light" else [])
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {
        "provenance": provenance(),
        "settings": {"device": args.device, "steps": args.steps, "warmup": args.warmup, "host_only": args.host_only,
                     "torch_threads": torch.get_num_threads()},
    }
    for num_envs in [int(n) for n in args.envs.split(",")]:
        for path in paths:
            try:
                entry = measure(num_envs, path, args)
            except torch.OutOfMemoryError as error:
                entry = {"error": f"OOM: {error}"[:200]}
            results[f"{path}_envs_{num_envs}"] = entry
            if "error" not in entry:
                stages = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in entry["stages_s"].items())
                print(f"{path:8s} {num_envs:4d} envs: {entry['step_s'] * 1e3:8.1f} ms/step "
                      f"{entry['env_steps_per_s']:8.1f} env steps/s | ms: {stages}", flush=True)
    write_results(results, name, args.out, args.overwrite, args=args)
    return results


if __name__ == "__main__":
    main()
