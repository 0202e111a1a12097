"""PushT-v0 env throughput, baseline against the optimised paths in the same run, and what they cost in fidelity.

    python benchmarks/pusht_env_throughput_gpu.py --out $OUT                       # one GPU, ~5 min
    python benchmarks/pusht_env_throughput_gpu.py --device cpu --envs 1 --steps 5 --fidelity-episodes 0   # CPU
    python benchmarks/pusht_env_throughput_gpu.py --decoder light --light-decoder $OUT/light_decoder --out $OUT
    python benchmarks/pusht_env_throughput_gpu.py --envs 1,16 --steps 20 --fidelity-episodes 0 --decoder light \
        --stage-graphs-ab --out $OUT                                                   # the stage graphs' A/B

Two envs per env count, built by ``gym.make_vec("cosmos3_gym/PushT-v0", num_envs=N)``'s entry point:

* ``baseline``: ``optimize=False``, the path before issue 24 (eager engine, fp32 VAE, every frame decoded);
* ``exact``: the fast engine with the exact VAE decode, ``decoder="vae"`` (GPU: ``engine.optimize()``, bf16 VAE,
  direct convolutions, only the frame the env returns decoded; CPU: the VAE's eager fast path); the default before
  session 20;
* with ``--decoder light`` a third, ``light``: the same with ``decoder="light"`` (the model's ``light_decoder/``
  decodes instead of the VAE), the built-in model's default since its light decoder matched the VAE's fidelity.
  ``--light-decoder DIR`` installs a trained one (``benchmarks/recipes/train_light_decoder.py``'s output) into a
  temporary copy of the assets first;
* with ``--stage-graphs-ab`` one more path each, ``exact_eager_stages`` (and ``light_eager_stages``), turns the
  stage graphs off (``engine.use_stage_graphs(False)`` and the reward model's ``use_cuda_graphs(False)``: VAE encode,
  light decode and reward scoring eager, on a GPU graphed by default) while the GEN forward stays CUDA-graphed: the
  stage graphs' gain against its baseline in the same run (``stage_graphs_speedup`` per path;
  ``*_stage_graphs_obs_psnr_db``: graphed against eager stages, per step).

All reset with the same seed and step with the same random actions, **interleaved** (baseline step, exact step,
...), so load changes hit all alike. Per env count: median seconds per step (the latency of one env step at N envs),
env steps/s, GPU memory. ``obs_psnr_db``: PSNR of the exact path's observation against the baseline's after each step
(the same conditioning at step 1; later steps drift apart as each env continues from its own frames).

``--fidelity-episodes`` > 0 and gym-pusht installed: action-following PSNR against the simulator
(``benchmarks/fidelity_pusht_chunks.py``'s ``forward_fidelity``, held-out episodes simulated here) for the baseline
engine and each optimised engine, with 95 % CIs (both decode every frame there: the metric reads them all).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "recipes"))  # fidelity_pusht_chunks

from common import (  # noqa: E402
    add_decoder_arguments,
    add_output_arguments,
    check_results_target,
    provenance,
    sync,
    use_decoder_arguments,
    write_results,
)

from cosmos3_gym.engine import Cosmos3Engine  # noqa: E402
from cosmos3_gym.tasks.pusht.env import fast_pusht_engine, load_pusht_assets, make_pusht_vector_env  # noqa: E402

EAGER_STAGES = "_eager_stages"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    error = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2) / 255.0**2
    return float("inf") if error == 0 else float(10 * np.log10(1 / error))


def paths(args) -> tuple[str, ...]:
    optimised = ("exact",) + (("light",) if args.decoder == "light" else ())
    eager_stages = tuple(path + EAGER_STAGES for path in optimised) if args.stage_graphs_ab else ()
    return ("baseline",) + optimised + eager_stages


def make_env(path: str, num_envs: int, args):
    base = path.removesuffix(EAGER_STAGES)
    options = {"decoder": "light" if base == "light" else "vae"}
    env = make_pusht_vector_env(num_envs, assets_dir=args.assets, device=args.device, optimize=base != "baseline",
                                **options)
    if path.endswith(EAGER_STAGES):  # the optimised paths' stage graphs (on by default on a GPU) turned off
        env.engine.use_stage_graphs(False)
        if hasattr(env._core.reward_model, "use_cuda_graphs"):
            env._core.reward_model.use_cuda_graphs(False)  # and the reward model's scoring
    return env


def measure(num_envs: int, args) -> dict:
    envs = {path: make_env(path, num_envs, args) for path in paths(args)}
    try:
        observations = {path: env.reset(seed=0)[0] for path, env in envs.items()}
        space = envs["baseline"].action_space
        space.seed(0)
        times = {path: [] for path in envs}
        obs_psnr, light_psnr, stage_psnr = [], [], {}
        for step in range(args.warmup + args.steps):
            actions = space.sample()
            for path, env in envs.items():
                sync()
                start = time.perf_counter()
                observations[path] = env.step(actions)[0]
                sync()
                if step >= args.warmup:
                    times[path].append(time.perf_counter() - start)
            obs_psnr.append(psnr(observations["baseline"]["image"], observations["exact"]["image"]))
            if "light" in observations:
                light_psnr.append(psnr(observations["exact"]["image"], observations["light"]["image"]))
            for path in observations:
                if path.endswith(EAGER_STAGES):
                    stage_psnr.setdefault(path, []).append(
                        psnr(observations[path.removesuffix(EAGER_STAGES)]["image"], observations[path]["image"])
                    )
        entry = {}
        for path in envs:
            step_s = statistics.median(times[path])
            entry[path] = {"step_s": step_s, "step_times_s": times[path], "env_steps_per_s": num_envs / step_s}
        entry["speedup"] = entry["baseline"]["step_s"] / entry["exact"]["step_s"]
        entry["obs_psnr_db"] = obs_psnr  # per step, warm-up steps included (step 1 first)
        if "light" in entry:
            entry["light_speedup_over_exact"] = entry["exact"]["step_s"] / entry["light"]["step_s"]
            entry["light_obs_psnr_db"] = light_psnr  # light against exact, per step (they drift apart too)
        for path, values in stage_psnr.items():
            graphed = path.removesuffix(EAGER_STAGES)
            entry[graphed]["stage_graphs_speedup"] = entry[path]["step_s"] / entry[graphed]["step_s"]
            entry[f"{graphed}_stage_graphs_obs_psnr_db"] = values  # graphed against eager stages, per step
        if torch.cuda.is_available():
            entry["gpu_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        return entry
    finally:
        for env in envs.values():
            env.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def fidelity(args) -> dict:
    try:
        import gym_pusht  # noqa: F401
    except ImportError:
        return {"skipped": "gym-pusht is not installed (the sim extra)"}
    from fidelity_pusht_chunks import forward_fidelity, load_episodes

    from cosmos3_gym.tasks.pusht import episodes as pusht

    assets = load_pusht_assets(args.assets)
    chunk = int(assets.meta["chunk"])
    heldout = pusht.generate_pusht_dataset(
        Path(tempfile.mkdtemp()) / "heldout", args.fidelity_episodes, steps_per_episode=args.fidelity_chunks * chunk,
        image_size=tuple(assets.meta["image_size"]), seed=args.heldout_seed,
    )
    episodes = load_episodes(heldout, args.fidelity_episodes)
    results = {}
    for path in paths(args):
        if path == "baseline":
            engine = Cosmos3Engine.from_pretrained(assets.checkpoint, device=args.device, progress=False)
        else:
            engine = fast_pusht_engine(assets.checkpoint, device=args.device,
                                       decoder="light" if path == "light" else "vae")
        try:
            results[path] = forward_fidelity(engine, assets.root, episodes, args.fidelity_chunks)
        finally:
            engine.close()
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--envs", default="1,16,64,256")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles, graph captures)")
    parser.add_argument("--fidelity-episodes", type=int, default=8)
    parser.add_argument("--fidelity-chunks", type=int, default=4)
    parser.add_argument("--heldout-seed", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="torch.backends.cudnn.benchmark for both paths (the decoder's thin convolutions)")
    add_decoder_arguments(parser, "light: also measure the env with decoder='light' (a third path)")
    parser.add_argument("--stage-graphs-ab", action="store_true",
                        help="also each optimised path after engine.use_stage_graphs(False) (VAE encode, light decode "
                             "eager), interleaved with the rest: the stage graphs against their baseline in one run")
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the installed built-in one)")
    add_output_arguments(parser)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    name = args.name or f"pusht_env_throughput_{'cpu' if args.device == 'cpu' else 'gpu'}.json"
    check_results_target(name, args.out, args.overwrite)  # before measuring
    use_decoder_arguments(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    results = {"provenance": provenance(), "settings": {**vars(args), "torch_threads": torch.get_num_threads()}}
    for num_envs in [int(n) for n in args.envs.split(",")]:
        try:
            entry = measure(num_envs, args)
        except torch.OutOfMemoryError as error:
            entry = {"error": f"OOM: {error}"[:200]}
            torch.cuda.empty_cache()
        results[f"envs_{num_envs}"] = entry
        if "error" not in entry:
            print(f"{num_envs:4d} envs: baseline {entry['baseline']['step_s'] * 1e3:8.1f} ms/step "
                  f"({entry['baseline']['env_steps_per_s']:7.1f} env steps/s), exact "
                  f"{entry['exact']['step_s'] * 1e3:8.1f} ms/step ({entry['exact']['env_steps_per_s']:7.1f} "
                  f"env steps/s), {entry['speedup']:.2f}x; obs PSNR step 1 {entry['obs_psnr_db'][0]:.1f} dB",
                  flush=True)
            if "light" in entry:
                print(f"{num_envs:4d} envs: light {entry['light']['step_s'] * 1e3:8.1f} ms/step "
                      f"({entry['light']['env_steps_per_s']:7.1f} env steps/s), "
                      f"{entry['light_speedup_over_exact']:.2f}x over exact; obs PSNR vs exact step 1 "
                      f"{entry['light_obs_psnr_db'][0]:.1f} dB", flush=True)
            for path in paths(args):
                if path.endswith(EAGER_STAGES):
                    graphed = path.removesuffix(EAGER_STAGES)
                    print(f"{num_envs:4d} envs: {graphed} with stage graphs {entry[graphed]['step_s'] * 1e3:8.1f} "
                          f"ms/step, eager stages {entry[path]['step_s'] * 1e3:8.1f} ms/step, "
                          f"{entry[graphed]['stage_graphs_speedup']:.2f}x; obs PSNR step 1 "
                          f"{entry[f'{graphed}_stage_graphs_obs_psnr_db'][0]:.1f} dB", flush=True)
    if args.fidelity_episodes > 0:
        results["fidelity"] = fidelity(args)
        for path, entry in results["fidelity"].items():
            if isinstance(entry, dict) and "psnr_db" in entry:
                rollout = [round(c["mean"], 2) for c in entry["psnr_db"]["rollout"]]
                one = [round(c["mean"], 2) for c in entry["psnr_db"]["one_chunk"]]
                print(f"fidelity {path}: rollout PSNR per chunk {rollout}, one-chunk {one}")
    write_results(results, name, args.out, args.overwrite, args=args)
    return results


if __name__ == "__main__":
    main()
