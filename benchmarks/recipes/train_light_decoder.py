"""Train a ``LightDecoder`` for a PushT world model's latent space in one GPU call, and measure it against the VAE.

    python benchmarks/recipes/train_light_decoder.py --out $OUT                  # one H100/H200, 16 cores: ~8 min
    python benchmarks/recipes/train_light_decoder.py --smoke --out /tmp/light    # the same pipeline on a CPU, ~1 min

The shipped decoder (session 20, ``benchmarks/results/training/train_light_decoder_h200_v2.json``) took simulate 8 s,
encode 58 s, generate 102 s, train 240 s and evaluate 27 s on one H200 with ``--workers 15``. ``--deadline-s`` shortens
the training so that a time-limited call ends in time. More data than fits one 10-minute call: two calls on one warm
machine with the same ``--work``, the first ending after the encode stage::

    python benchmarks/recipes/train_light_decoder.py --out $OUT --work /tmp/ldw --episodes 384 --stop-after encode
    python benchmarks/recipes/train_light_decoder.py --out $OUT --work /tmp/ldw --episodes 384 --seconds 300

Needs gym-pusht (the ``sim`` extra). Stages:

1. ``simulate``: training episodes (``--episodes`` x ``--steps-per-episode``, seed ``--seed``, the default policy
   mix of ``cosmos3_gym.tasks.pusht.episodes.generate_pusht_dataset``) and held-out episodes (seed ``--seed + 1000``);
2. ``encode``: their ``chunk + 1`` frame windows through the model's own VAE, as the world model's training windows
   (``training.light_decoder.build_decoder_windows``, fp32 VAE);
3. ``train``: ``train_light_decoder`` for ``--seconds`` (or ``--max-steps``), into ``--out``/light_decoder;
4. ``evaluate``: on the held-out windows, PSNR per window of the light decoder's last frame against the real frame
   (``light_vs_real``), of the exact VAE decode of the same latents (``vae_vs_real``) and between the two
   (``light_vs_vae``); the same over every frame of the window (``all_frames``); means with 95 % intervals;
6. ``speed``: decode time of the last frame per env step (one window's latents), for the VAE as the PushT env's
   default engine runs it (``fast_pusht_engine``: bf16 and compiled fused norms on a GPU) and for the light decoder
   as ``decoder="light"`` runs it (the same dtype, channels-last), at ``--timing-batches`` (device-synchronised,
   median of ``--timing-repeats``), and conv FLOPs per last frame at batch 1 (``torch.utils.flop_counter``).

Files in ``--out``: ``light_decoder/`` (config.json, model.safetensors in ``--save-dtype``, train_log.jsonl,
train_config.json; 2.2 MB at the default size in fp16: copy it to ``<assets>/checkpoint/light_decoder`` to install
it) and ``train_light_decoder.json`` (settings, stage timings, metrics; card, commit and command). Datasets and the
encoded windows stay in ``--work``, and a later run with the same ``--work`` and settings reuses them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from tqdm.auto import tqdm

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]  # the repository, benchmarks/, recipes/

from common import add_output_arguments, check_results_target, provenance, timed, write_results  # noqa: E402
from fidelity_pusht_chunks import finite_mean_ci95  # noqa: E402

from cosmos3_gym.models.light_decoder import LightDecoder, LightDecoderConfig  # noqa: E402
from cosmos3_gym.models.vae import Cosmos3VAE  # noqa: E402
from cosmos3_gym.tasks.pusht.env import fast_pusht_engine, load_pusht_assets  # noqa: E402
from cosmos3_gym.training.export import ACTION_STATS_FILE  # noqa: E402
from cosmos3_gym.training.light_decoder import (  # noqa: E402
    DecoderWindows,
    LightDecoderTrainConfig,
    build_decoder_windows,
    decoder_psnr,
    train_light_decoder,
)

RESULTS_NAME = "train_light_decoder.json"
DECODER_DIR = "light_decoder"
MAX_DECODER_MB = 16.0
EVAL_RESERVE_S = 60.0  # what --deadline-s leaves for the evaluate and speed stages (~30 s on an H200)
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

FULL = dict(episodes=256, steps_per_episode=128, heldout_episodes=32, image_size=None, seconds=240.0,
            max_steps=100_000, batch_size=32, lr=1e-3, channels="192,128,96,64", blocks="3,2,1,1",
            timing_batches="1,64", timing_repeats=20, generated_starts_per_episode=4, generated_chunks=4,
            generate_batch=256)
# The same pipeline on a CPU in about a minute: tiny frames, decoder and budgets (the numbers mean nothing).
SMOKE = dict(FULL, episodes=3, steps_per_episode=16, heldout_episodes=2, image_size=64, seconds=10.0, max_steps=6,
             batch_size=2, channels="16,16,8,8", blocks="1,0,0,0", timing_batches="1,2", timing_repeats=2,
             generated_starts_per_episode=1, generated_chunks=1, generate_batch=4)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the installed built-in one)")
    parser.add_argument("--work", default=None, help="simulated datasets (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="tiny settings for a CPU check of the pipeline")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="simulator processes (default: one per core)")
    parser.add_argument("--stride", type=int, default=None, help="frames between windows (default: the chunk)")
    parser.add_argument("--encode-batch-size", type=int, default=64)
    parser.add_argument("--stop-after", choices=("simulate", "encode"), default=None,
                        help="end after this stage (results still written); a later run with the same --work reuses "
                             "its datasets and encoded windows: simulate and encode in one time-limited call, train "
                             "in the next")
    parser.add_argument("--policy-mix", default=None,
                        help="the training episodes' policies, as train_pusht.py's --policy-mix (default: "
                             "generate_pusht_dataset's mix); policy files act through the model's action statistics")
    parser.add_argument("--results-name", default=RESULTS_NAME)
    parser.add_argument("--latent-noise", type=float, default=0.0,
                        help="std of noise added to the training latents (LightDecoderTrainConfig.latent_noise)")
    parser.add_argument("--save-dtype", choices=sorted(SAVE_DTYPES), default="float16", help="stored weights")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="end training early enough that the run ends within this many seconds of its start "
                             f"(for time-limited calls; evaluate and speed are given {EVAL_RESERVE_S:.0f} s)")
    for name, value in FULL.items():  # sizes and budgets, defaulting to FULL (or SMOKE with --smoke)
        kind = int if name == "image_size" else type(value)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def simulate(args, work: Path, image_size: tuple[int, int], assets) -> dict[str, Path]:
    """The training and held-out datasets in ``work`` (both with ``--policy-mix``); a complete one from an earlier
    run with the same settings is reused, so a run split over time-limited calls (``--stop-after``) simulates once."""
    from cosmos3_gym.tasks.pusht import episodes as pusht

    mix = pusht.parse_policy_mix(args.policy_mix)
    action_stats = assets.checkpoint / ACTION_STATS_FILE
    datasets = {}
    for name, episodes, seed in (("train", args.episodes, args.seed), ("heldout", args.heldout_episodes,
                                                                       args.seed + 1000)):
        request = {"num_episodes": episodes, "steps_per_episode": args.steps_per_episode, "seed": seed,
                   "image_size": list(image_size), "policy_mix": mix}
        marker = work / f"{name}.request.json"
        if (work / name / "meta.json").is_file() and marker.is_file() and json.loads(marker.read_text()) == request:
            print(f"{name}: reusing {work / name}", flush=True)
            datasets[name] = work / name
            continue
        datasets[name] = pusht.generate_pusht_dataset(
            work / name, episodes, steps_per_episode=args.steps_per_episode, image_size=image_size, seed=seed,
            workers=args.workers, policy_mix=mix, action_stats=action_stats,
        )
        marker.write_text(json.dumps(request))
    return datasets


def encode(args, datasets: dict[str, Path], vae, chunk: int, tier: int, work: Path) -> list[DecoderWindows]:
    """The train and held-out windows, encoded once: kept in ``work`` as safetensors (latents and uint8 frames; GBs
    at the full size) and read back by a later run with the same ``--work`` and stride (encoding is minutes)."""
    windows = []
    for name in ("train", "heldout"):
        path = work / f"windows_{name}_stride{args.stride or chunk}.safetensors"
        if path.is_file():
            print(f"{name}: reusing {path}", flush=True)
            tensors = safetensors.torch.load_file(str(path))
            windows.append(DecoderWindows(tensors["latents"], tensors["frames"]))
            continue
        encoded = build_decoder_windows(datasets[name], vae, chunk=chunk, stride=args.stride, resolution_tier=tier,
                                        encode_batch_size=args.encode_batch_size)
        safetensors.torch.save_file({"latents": encoded.latents.contiguous(), "frames": encoded.frames.contiguous()},
                                    str(path))
        windows.append(encoded)
    return windows


class StepRecorder:
    """Keeps each forward-dynamics result's latents and pixels (the exact decode, as uint8 on the host) that
    ``engine.step`` returns: what the env's world model generates, for ``generate``. It replaces the engine's
    ``step`` on the instance (the env checks its engine against the ``WorldModelEngine`` protocol, so no wrapper)."""

    def __init__(self, engine, chunk: int):
        self.engine, self.chunk, self.engine_step = engine, chunk, engine.step
        self.latents: list[torch.Tensor] = []
        self.frames: list[torch.Tensor] = []
        engine.step = self.step

    def step(self, requests, *, decode=None, pixels_on_device: bool = False):
        results = self.engine_step(requests, decode=decode, pixels_on_device=pixels_on_device)
        for result in results:
            if result.pixels is None or result.pixels.shape[1] != self.chunk + 1:
                raise RuntimeError("generate: the env must decode every frame of the chunk (return_frames=True)")
            self.latents.append(result.video_latents.float().cpu())
            self.frames.append((result.pixels.float() * 255.0).round_().clamp_(0, 255).to(torch.uint8).cpu())
        return results


def generate(args, datasets: dict[str, Path], assets, chunk: int, image_size: tuple[int, int],
             work: Path) -> list[DecoderWindows | None]:
    """The world model's own windows (module docstring, stage 3) for the train and held-out episodes, kept in
    ``work`` for a later run as ``encode`` keeps its windows; None for both when ``--generated-starts-per-episode``
    is 0."""
    if args.generated_starts_per_episode == 0:
        return [None, None]
    from cosmos3_gym.processor import ActionStats
    from cosmos3_gym.tasks.pusht.compare import replay_actions
    from cosmos3_gym.tasks.pusht.env import make_pusht_vector_env, pusht_env_defaults

    stats = ActionStats.from_json(pusht_env_defaults(assets)["action_stats"],
                                  mode=assets.meta.get("action_normalization", "minmax"))
    steps = args.generated_chunks * chunk
    windows = []
    for split, name in enumerate(("train", "heldout")):
        path = work / (f"generated_{name}_s{args.generated_starts_per_episode}_c{args.generated_chunks}"
                       f"_seed{args.seed}.safetensors")
        if path.is_file():
            print(f"generated {name}: reusing {path}", flush=True)
            tensors = safetensors.torch.load_file(str(path))
            windows.append(DecoderWindows(tensors["latents"], tensors["frames"]))
            continue
        rng = np.random.default_rng([args.seed, 7, split])
        starts, actions = [], []
        for episode_path in sorted((datasets[name] / "episodes").glob("episode_*.npz")):
            with np.load(episode_path) as episode:
                last = len(episode["actions"]) - steps
                if last < 0:
                    continue
                for first in rng.choice(last + 1, min(args.generated_starts_per_episode, last + 1), replace=False):
                    starts.append(episode["frames"][first])
                    actions.append(episode["actions"][first : first + steps])
        if not starts:
            raise SystemExit(f"generate: no {name} episode has {steps} steps (--generated-chunks x the chunk)")
        actions = np.clip(stats.normalize(np.stack(actions).astype(np.float32)), -1.0, 1.0)
        actions = actions.reshape(len(starts), args.generated_chunks, chunk, -1)
        engine = fast_pusht_engine(assets.checkpoint, device=args.device)
        recorder = StepRecorder(engine, chunk)
        try:
            for begin in tqdm(range(0, len(starts), args.generate_batch), desc=f"generating {name}", leave=False):
                batch = slice(begin, begin + args.generate_batch)
                envs = make_pusht_vector_env(len(starts[batch]), assets_dir=assets.root, engine=engine,
                                             return_frames=True, reward_model=None, success_threshold=None,
                                             max_episode_steps=None, image_size=image_size)
                try:
                    replay_actions(envs, np.stack(starts[batch]), actions[batch], seed=args.seed + begin)
                finally:
                    envs.close()
        finally:
            engine.close()
        generated = DecoderWindows(torch.stack(recorder.latents), torch.stack(recorder.frames))
        safetensors.torch.save_file({"latents": generated.latents.contiguous(),
                                     "frames": generated.frames.contiguous()}, str(path))
        windows.append(generated)
    return windows


def train_seconds(args, elapsed: float) -> float:
    """``--seconds``, shortened to meet ``--deadline-s`` after ``elapsed`` seconds of earlier stages."""
    if args.deadline_s is None:
        return args.seconds
    left = args.deadline_s - elapsed - EVAL_RESERVE_S
    if left < 10.0:
        raise SystemExit(f"--deadline-s {args.deadline_s}: {elapsed:.0f} s went to the earlier stages, too little is "
                         "left to train (run again with the same --work: they are reused)")
    return min(args.seconds, left)


def conv_flops(fn) -> int:
    """FLOPs of ``fn()`` as ``torch.utils.flop_counter`` counts them (convolutions and matmuls, 2 per MAC)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def speed(args, assets, decoder_dir: Path, latents: torch.Tensor) -> dict[str, Any]:
    """Last-frame decode time per env step and FLOPs, VAE (the env's default engine) against the light decoder."""
    engine = fast_pusht_engine(assets.checkpoint, device=args.device)
    try:
        vae = engine.vae
        light = LightDecoder.from_pretrained(decoder_dir, device=engine.device, dtype=vae.vae.dtype)
        light.use_channels_last()
        report: dict[str, Any] = {"dtype": str(vae.vae.dtype), "batches": {}}
        for batch in ints(args.timing_batches):
            index = torch.arange(batch) % len(latents)
            chunk = latents[index].to(engine.device)
            entry = {}
            for name, decode in (("vae", vae.decode), ("light", light.decode)):
                median, times = timed(lambda: decode(chunk, frames="last"), repeats=args.timing_repeats, warmup=3)
                entry[name] = {"ms_per_call": median * 1e3, "ms_per_env_step": median * 1e3 / batch,
                               "times_ms": [t * 1e3 for t in times]}
            entry["speedup"] = entry["vae"]["ms_per_call"] / entry["light"]["ms_per_call"]
            report["batches"][str(batch)] = entry
            print(f"batch {batch:3d}: VAE {entry['vae']['ms_per_call']:8.2f} ms, light "
                  f"{entry['light']['ms_per_call']:8.2f} ms per last-frame decode ({entry['speedup']:.1f}x)",
                  flush=True)
    finally:
        engine.close()
    # FLOPs on fp32 copies (the counter counts the same convolutions whatever the dtype or fused norms).
    one = latents[:1].to(args.device)
    reference_vae = Cosmos3VAE.from_pretrained(assets.checkpoint / "vae", device=args.device)
    reference_light = LightDecoder.from_pretrained(decoder_dir, device=args.device)
    report["gflop_per_last_frame"] = {
        "vae": conv_flops(lambda: reference_vae.decode(one, frames="last")) / 1e9,
        "light": conv_flops(lambda: reference_light.decode(one, frames="last")) / 1e9,
    }
    report["gflop_per_last_frame"]["ratio"] = (report["gflop_per_last_frame"]["vae"]
                                               / report["gflop_per_last_frame"]["light"])
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results_path = check_results_target(args.results_name, args.out, args.overwrite)  # before the work
    out = results_path.parent
    torch.backends.cudnn.benchmark = True  # fixed shapes throughout
    assets = load_pusht_assets(args.assets)
    chunk = int(assets.meta["chunk"])
    image_size = (args.image_size,) * 2 if args.image_size else tuple(assets.meta["image_size"])
    tier = int(assets.meta.get("resolution_tier", 256))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="train_light_decoder_"))
    decoder_dir = out / DECODER_DIR
    results: dict[str, Any] = {"provenance": provenance(), "arguments": vars(args), "assets": str(assets.root),
                               "stages": {}}
    started = time.perf_counter()

    def stage(name: str, fn, *fn_args):
        print(f"== {name} (at {time.perf_counter() - started:.0f} s)", flush=True)
        begin = time.perf_counter()
        value = fn(*fn_args)
        results["stages"][name] = round(time.perf_counter() - begin, 2)
        return value

    try:
        datasets = stage("simulate", simulate, args, work, image_size, assets)
        if args.stop_after == "simulate":
            return results
        vae = Cosmos3VAE.from_pretrained(assets.checkpoint / "vae", device=args.device)
        train_windows, heldout_windows = stage("encode", encode, args, datasets, vae, chunk, tier, work)
        results["windows"] = {"train": len(train_windows), "heldout": len(heldout_windows),
                              "latent_shape": list(train_windows.latents.shape[1:]),
                              "frame_shape": list(train_windows.frames.shape[1:])}
        if args.stop_after == "encode":
            return results
        generated_train, generated_heldout = stage("generate", generate, args, datasets, assets, chunk, image_size,
                                                   work)
        if generated_train is not None:
            results["windows"].update(generated_train=len(generated_train), generated_heldout=len(generated_heldout))
            train_windows = DecoderWindows(torch.cat([train_windows.latents, generated_train.latents]),
                                           torch.cat([train_windows.frames, generated_train.frames]))
            del generated_train
        config = LightDecoderTrainConfig(
            decoder=LightDecoderConfig(latent_channels=vae.latent_channels, channels=ints(args.channels),
                                       blocks=ints(args.blocks), temporal_compression=vae.temporal_compression),
            steps=args.max_steps, seconds=train_seconds(args, time.perf_counter() - started),
            batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device,
            warmup_steps=min(100, args.max_steps // 10), latent_noise=args.latent_noise,
        )
        stage("train", train_light_decoder, train_windows, decoder_dir, config)
        del train_windows  # gigabytes of frames on the device
        # What ships: the weights in --save-dtype (fp16 halves the assets; the engine runs bf16 on a GPU anyway),
        # evaluated as loaded back from the folder.
        LightDecoder.from_pretrained(decoder_dir).save_pretrained(decoder_dir, dtype=SAVE_DTYPES[args.save_dtype])
        decoder = LightDecoder.from_pretrained(decoder_dir, device=args.device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        train_config = json.loads((decoder_dir / "train_config.json").read_text())
        results["training"] = {"steps": train_config["steps"], "seconds": train_config["seconds"],
                               "parameters": sum(p.numel() for p in decoder.parameters()),
                               "fp16_mb": sum(p.numel() for p in decoder.parameters()) * 2 / 1e6,
                               "folder_mb": sum(f.stat().st_size for f in decoder_dir.iterdir()) / 2**20}
        log = (decoder_dir / "train_log.jsonl").read_text().splitlines()
        results["training"]["last_log"] = json.loads(log[-1]) if log else None
        if results["training"]["folder_mb"] > MAX_DECODER_MB:
            raise SystemExit(f"{decoder_dir} is {results['training']['folder_mb']:.1f} MiB, over {MAX_DECODER_MB}")

        def evaluate(decoder: LightDecoder, vae: Cosmos3VAE) -> dict:
            report = {}
            for frames in ("last", "all"):
                psnr = decoder_psnr(decoder, heldout_windows, vae, frames=frames)
                report["last_frame" if frames == "last" else "all_frames"] = {
                    key: finite_mean_ci95(values) for key, values in psnr.items()
                }
            if generated_heldout is not None:  # "real" is the VAE's decode of the model's latents there
                psnr = decoder_psnr(decoder, generated_heldout, frames="last")
                report["generated"] = {"light_vs_vae_last_frame": finite_mean_ci95(psnr["light_vs_real"]),
                                       "light_vs_vae_all_frames": finite_mean_ci95(
                                           decoder_psnr(decoder, generated_heldout, frames="all")["light_vs_real"])}
            if torch.device(args.device).type == "cuda":  # as decoder="light" runs it on a GPU: bf16, channels-last
                bf16 = LightDecoder.from_pretrained(decoder_dir, device=args.device, dtype=torch.bfloat16)
                psnr = decoder_psnr(bf16.use_channels_last(), heldout_windows, frames="last")
                report["last_frame"]["light_bf16_vs_real"] = finite_mean_ci95(psnr["light_vs_real"])
            return report

        results["psnr_db"] = stage("evaluate", evaluate, decoder, vae)
        psnr_db = results["psnr_db"]
        for key, value in [*psnr_db["last_frame"].items(), *psnr_db.get("generated", {}).items()]:
            print(f"last frame PSNR {key}: {value['mean']:.2f} dB [{value['ci95_low']:.2f}, {value['ci95_high']:.2f}]")
        del vae, decoder
        results["speed"] = stage("speed", speed, args, assets, decoder_dir, heldout_windows.latents)
        flops = results["speed"]["gflop_per_last_frame"]
        print(f"GFLOP per last frame: VAE {flops['vae']:.2f}, light {flops['light']:.2f} ({flops['ratio']:.1f}x)")
    finally:
        results["total_seconds"] = round(time.perf_counter() - started, 2)
        write_results(results, args.results_name, args.out, args.overwrite, args=args)
    return results


if __name__ == "__main__":
    main()
