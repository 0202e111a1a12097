"""Train the built-in PushT world model in one GPU call, export it in the layout of cosmos3_gym/assets/pusht, and
evaluate it against the real simulator.

    python benchmarks/recipes/train_pusht.py --out $OUT                      # one H100/H200, 16 cores: about 9 min
    python benchmarks/recipes/train_pusht.py --smoke --out /tmp/pusht_smoke  # the same pipeline scaled down, CPU

Needs gym-pusht (the ``sim`` extra). Stages:

1. simulate training episodes and held-out episodes (``cosmos3_gym.tasks.pusht.episodes.generate_pusht_dataset``, one
   process per core) and the held-out start frames the env ships (``--episodes``, ``--steps-per-episode``, ...);
2. train the VAE (``cosmos3_gym.training.train_vae``) for ``--vae-seconds``;
3. train the world model (``train_world_model``) for ``--wm-seconds``, written straight into ``<assets>/checkpoint``
   and given the env defaults in its meta.json (task, num_steps, guidance_scale, max_episode_steps, and gym-pusht's
   success_threshold 0.95 until stage 4b replaces it). A training stage's time budget becomes a step count from a
   short speed probe on a few episodes (``PROBE_STEPS``), capped by ``--vae-max-steps`` / ``--wm-max-steps``; reading
   the episodes and encoding the latents come on top. The world model's steps get ``PROBE_SPEED_HEADROOM`` and its
   run ends, with its cosine decay, at the budget (``WorldModelTrainConfig.max_seconds``);
4. train the reward model (``ClassifierRewardModel``) on the simulator's coverage of the target (soft labels);
4b. once the world model and the last reward model are trained, calibrate the checkpoint's ``success_threshold`` to
   the reward model it ships (``success_threshold_stage``). A regressor of coverage scores gym-pusht's successes
   (coverage > 0.95) about 0.93, never 0.95, so the threshold is the score with the best F1 for gym-pusht's success
   on real episodes the reward model never saw (half of them; the other half checks it). It goes into meta.json and,
   with its precision, recall and frame counts, into the results. Without enough success frames to fit on
   (``--smoke``) it stays 0.95 and the results say why;
5. check the assets' size (``--max-size-mb``) and pack them (``pusht_assets.tar.gz``: extract it in
   ``cosmos3_gym/assets/`` to install the model);
6. evaluate (``fidelity_pusht_chunks.evaluate``: PSNR per chunk against the simulator, policy mode in the simulator
   against random actions) and render a side-by-side video (simulator | world model, same start, same actions).

Stage 6 is skipped when less than ``--eval-reserve-s`` of ``--deadline-s`` is left. A run too long for one call
splits in two, over the same simulated data (episodes depend only on the seed)::

    python benchmarks/recipes/train_pusht.py --part first --out $OUT     # stages 1, 2, 4 -> $OUT/first_part.tar.gz
    python benchmarks/recipes/train_pusht.py --part second --first-part first_part.tar.gz --out $OUT  # 1, 3, 4b, 5, 6

(The first part has no checkpoint to calibrate. The second calibrates whichever reward model it ships, also the
first part's when ``--no-rollout-reward-model`` keeps it: same seed, same episodes, so the same threshold as if the
first part had fitted it.)

Two parts improve an installed model (``--assets``): ``--part decoder`` fine-tunes its VAE decoder on chunk + 1 frame
clips (encoder, latent space and world model unchanged), retrains its reward model on its rollouts, packs and
evaluates it; ``--part reward-model`` only retrains the reward model (and recalibrates the threshold in
``--assets``). ``--wm-init`` with ``--part second`` fine-tunes an installed world model; ``--first-part`` then can
be the installed model folder itself (its VAE and start frames)::

    python benchmarks/recipes/train_pusht.py --part second --first-part cosmos3_gym/assets/pusht \
        --wm-init cosmos3_gym/assets/pusht/checkpoint --wm-cond-noise 0.3 --wm-lr 2e-4 --out $OUT

(``--wm-rollout-prob`` conditions part of each batch on the model's own frames, ``training/rollout.py``. The
fine-tuned checkpoint keeps ``--wm-init``'s light decoder and its meta.json ``decoder``.)
``--wm-handover latent --wm-context-frames K`` trains the world model for an env that hands chunks over as latents,
conditioning on the last K latent frames (``WorldModelTrainConfig.handover`` / ``context_frames``, written to its
meta.json), also when fine-tuning with ``--wm-init`` (the transformer is the same for any K); the default is the
pixel hand-over with one frame.
``--lerobot`` trains stages 2 and 3 from the simulated episodes written as a LeRobot v3.0 dataset
(``training.lerobot.write_lerobot_dataset``, H.264 videos) instead of our episode layout.

Files in ``--out`` (at most 8, no folders): train_pusht.json (train_pusht_<part>.json) (stages, timings, sizes, configs,
last losses, provenance), fidelity_pusht_chunks.json, pusht_assets.tar.gz, side_by_side.mp4, vae_log.jsonl,
world_model_log.jsonl. Datasets, latent caches and training states stay in ``--work``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import imageio.v3 as imageio
import numpy as np
import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]  # the repository, benchmarks/, recipes/

import fidelity_pusht_chunks  # noqa: E402
from common import inputs_from_args, provenance, write_results  # noqa: E402

from cosmos3_gym.checkpoint import checkpoint_decoder  # noqa: E402
from cosmos3_gym.engine import LIGHT_DECODER_DIR, Cosmos3Engine  # noqa: E402
from cosmos3_gym.errors import InputError  # noqa: E402
from cosmos3_gym.processor import ActionStats  # noqa: E402
from cosmos3_gym.rewards import ClassifierRewardModel, train_classifier  # noqa: E402
from cosmos3_gym.rewards.calibration import calibrate_success_threshold, score_episode_files  # noqa: E402
from cosmos3_gym.storage import replace_entries  # noqa: E402
from cosmos3_gym.tasks.pusht import episodes as pusht  # noqa: E402
from cosmos3_gym.tasks.pusht.compare import replay_actions  # noqa: E402
from cosmos3_gym.tasks.pusht.env import (  # noqa: E402
    CHECKPOINT_DIR,
    INITIAL_STATES_FILE,
    META_FILE,
    REWARD_MODEL_DIR,
    load_pusht_assets,
    make_pusht_vector_env,
    pusht_env_defaults,
)
from cosmos3_gym.tasks.pusht.self_forcing import generate_self_forcing_episodes, sample_sheet  # noqa: E402
from cosmos3_gym.training import VAETrainConfig, WorldModelTrainConfig, train_vae, train_world_model  # noqa: E402
from cosmos3_gym.training.export import ACTION_STATS_FILE, resolve_save_dtype  # noqa: E402

# gym-pusht's episode limit: 300 control steps (30 s).
BLOCK_FOCUS = "cosmos3_gym.tasks.pusht.readoff:block_mask"  # --wm-block-focus: the block's pixels, by colour
SIM_EPISODE_STEPS = 300

FULL = dict(
    episodes=256, steps_per_episode=128, image_size=256, heldout_episodes=32, initial_states=48,
    vae_seconds=100.0, vae_max_steps=20000, vae_batch=8, vae_lr=1e-3, vae_contrast_weight=10.0, vae_base_dim=12,
    vae_decoder_dim=20, vae_z_dim=16,
    wm_seconds=140.0, wm_max_steps=20000, wm_batch=32, wm_lr=5e-4, wm_warmup=200, wm_policy_episodes="successful",
    wm_cond_noise=0.2, wm_rollout_prob=0.0, wm_rollout_chunks=3,
    hidden=256, layers=4, heads=8,
    kv_heads=4, head_dim=32, intermediate=768, chunk=8, rm_episodes=128, rm_frames=20000, rm_epochs=4,
    rm_input_size=96, rm_rollout_episodes=128, rm_rollout_chunks=4, rm_calibration_episodes=128,
    fidelity_episodes=16, fidelity_chunks=4, policy_episodes=32, policy_chunks=16, video_chunks=8,
)
# The same pipeline on a CPU in minutes: tiny frames, models and budgets (the numbers mean nothing).
SMOKE = dict(
    FULL, episodes=6, steps_per_episode=20, image_size=64, heldout_episodes=3, initial_states=4,
    vae_seconds=2.0, vae_max_steps=8, vae_batch=2, vae_base_dim=4, vae_decoder_dim=8, wm_seconds=2.0,
    wm_max_steps=8, wm_batch=2, wm_warmup=2, wm_policy_episodes="all", hidden=64, layers=2, heads=4, kv_heads=2,
    head_dim=16, intermediate=128, chunk=4, rm_frames=64, rm_epochs=1, rm_input_size=32, rm_rollout_episodes=2,
    fidelity_episodes=2, fidelity_chunks=4, policy_episodes=2, policy_chunks=2, video_chunks=2,
)
# Training speed is measured with this many steps on a few episodes (the second half of them timed), then the
# stage gets the steps that fit its time budget, at least MIN_STEPS and at most its --*-max-steps.
PROBE_STEPS, PROBE_EPISODES, MIN_STEPS = 40, 4, 4
PROBE_SPEED_HEADROOM = 2.0  # the world model's steps: this many times what the probe's speed fits in its budget
FIRST_PART_ARCHIVE = "first_part.tar.gz"  # what --part first hands to --part second: vae/ and assets/pusht/
# Time the world model's budget leaves for retraining the reward model on its rollouts (38-62 s on one H200).
ROLLOUT_REWARD_MODEL_RESERVE_S = 80.0
# ... and for calibrating the success threshold (reading and scoring at most --rm-calibration-episodes episodes).
SUCCESS_THRESHOLD_RESERVE_S = 10.0
# Fewer success frames than this among the calibration's fit frames: keep gym-pusht's 0.95 rather than fit on noise.
MIN_CALIBRATION_SUCCESS_FRAMES = 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results folder ($OUT on the device): results JSON, checkpoints")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a result of the same name already in benchmarks/results")
    parser.add_argument("--work", default=None, help="bulky intermediates (default: a temporary folder)")
    parser.add_argument("--data", default=None,
                        help="where the simulated episodes and their latents live (default: --work); runs given "
                             "the same --data and settings share them: start the others once the first run's "
                             "probe has encoded them (its world_model_probe/training/log.jsonl exists)")
    parser.add_argument("--smoke", action="store_true", help="tiny settings for a CPU check of the pipeline")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="simulator processes")
    parser.add_argument("--num-steps", type=int, default=4, help="denoising steps the env uses")
    parser.add_argument("--guidance-scale", type=float, default=1.0, help="the env's CFG scale (1: no CFG)")
    parser.add_argument("--save-dtype", default="float16", help="stored weights of transformer and VAE")
    parser.add_argument("--max-size-mb", type=float, default=25.0, help="fail when the assets are larger")
    parser.add_argument("--deadline-s", type=float, default=560.0, help="whole run, for skipping evaluation")
    parser.add_argument("--eval-reserve-s", type=float, default=75.0, help="time evaluation needs")
    parser.add_argument("--part", choices=("all", "first", "second", "reward-model", "decoder"), default="all",
                        help="first: data, VAE and reward model only; second: the rest, from --first-part; "
                             "reward-model: retrain the reward model of the model in --assets on real and "
                             "world-model frames; decoder: fine-tune the VAE decoder of the model in --assets on "
                             "chunk + 1 frame clips, then retrain its reward model on its rollouts, package and "
                             "evaluate")
    parser.add_argument("--assets", default=None,
                        help="an installed PushT model folder, for --part reward-model and --part decoder")
    parser.add_argument("--first-part", default=None,
                        help="first_part.tar.gz of a --part first run (same seed), or an installed model folder")
    parser.add_argument("--wm-init", default=None, help="fine-tune this checkpoint's transformer instead of a new one")
    parser.add_argument("--vae-frames-per-clip", type=int, default=None,
                        help="the VAE's training clip length, 1 + 4k frames (default: chunk + 1; longer for a latent "
                             "hand-over, whose whole-episode encodings reach latent positions past the chunk's)")
    parser.add_argument("--wm-handover", choices=("pixels", "latent"), default="pixels",
                        help="how the env hands a chunk over to the next (WorldModelTrainConfig.handover): pixels "
                             "(the last frame decoded and encoded again) or latent (the last --wm-context-frames "
                             "latent frames kept)")
    parser.add_argument("--wm-context-frames", type=int, default=1,
                        help="clean latent frames the world model conditions on (more than 1 needs --wm-handover "
                             "latent); with --wm-init any number (the transformer's shape does not depend on it)")
    parser.add_argument("--wm-action-history", type=int, default=0,
                        help="state rows: the previous N actions before each window (WorldModelTrainConfig."
                             "action_history_length, written to meta.json; the env passes a slot's last N actions). "
                             "A frame shows no velocity; the agent's is linear in its position and its last 3-4 "
                             "targets (handover_sensitivity.py)")
    parser.add_argument("--wm-context-noise-max", type=float, default=0.0,
                        help="context noise with its level as the context's timestep (WorldModelTrainConfig."
                             "context_noise_max; needs --wm-cond-noise 0): each sample's context frames noised to a "
                             "level drawn from U(0, this); 0: none")
    parser.add_argument("--wm-context-noise", type=float, default=0.0,
                        help="the context-noise level the exported model's envs run at (meta.json context_noise)")
    parser.add_argument("--wm-block-focus", type=float, default=0.0,
                        help="extra weight of the latent cells the block covers in a window (WorldModelTrainConfig."
                             "video_loss_focus with tasks.pusht.readoff:block_mask): 4 makes them weigh 5x the rest; "
                             "0: the plain loss")
    parser.add_argument("--wm-self-forcing-rollouts", type=int, default=0,
                        help="with --wm-init: self-forcing samples with a consistent target "
                             "(cosmos3_gym.tasks.pusht.self_forcing): this many rollouts of the --wm-init model per "
                             "training episode, each --wm-self-forcing-depth chunks, every chunk's last frame a "
                             "sample continued by gym-pusht from the state read off it; 0: none")
    parser.add_argument("--wm-self-forcing-depth", type=int, default=8, help="chunks per self-forcing rollout")
    parser.add_argument("--wm-self-forcing-min-rigidity", type=float, default=0.5,
                        help="frames whose fitted T is less rigid give no self-forcing sample")
    parser.add_argument("--wm-self-forcing-envs", type=int, default=256, help="env slots the rollouts run in")
    parser.add_argument("--grow-depth", type=int, default=None,
                        help="with --wm-init: first deepen its transformer to this many layers per tower, computing "
                             "the same function (cosmos3_gym.training.growth)")
    parser.add_argument("--grow-intermediate", type=int, default=None,
                        help="with --wm-init: first widen its MLPs to this many units, computing the same function")
    parser.add_argument("--grow-heads", type=int, default=None,
                        help="with --wm-init: first widen its attention to this many query heads (key/value heads in "
                             "proportion), computing the same function")
    parser.add_argument("--policy-mix", default=None,
                        help="the training episodes' policies and shares, e.g. 'scripted=0.5,uniform=0.2,"
                             "file:benchmarks/results/rl/policies/rl_pusht_bc.safetensors=0.3' (policies of "
                             "cosmos3_gym.tasks.pusht.episodes.generate_pusht_dataset; default its DEFAULT_POLICY_MIX)."
                             " Policy files need --wm-init (its action statistics map their actions)")
    parser.add_argument("--rollout-reward-model", action=argparse.BooleanOptionalAction, default=True,
                        help="retrain the reward model on the new world model's rollouts (off: keep --first-part's, "
                             "for a fine-tune that a later call continues)")
    parser.add_argument("--evaluate", action=argparse.BooleanOptionalAction, default=True,
                        help="evaluate the packaged model when --eval-reserve-s of --deadline-s is left")
    parser.add_argument("--encode-batch-size", type=int, default=128, help="windows per VAE encode call")
    parser.add_argument("--lerobot", action="store_true",
                        help="train VAE and world model from the simulated episodes written as a LeRobot v3.0 "
                             "dataset (training.lerobot.write_lerobot_dataset) instead of our episode layout")
    for name, value in FULL.items():  # every size and step count, defaulting to FULL (or SMOKE with --smoke)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args(argv)
    if (args.part == "second") != (args.first_part is not None):
        parser.error("--first-part goes with --part second, and --part second needs it")
    if (args.grow_depth, args.grow_intermediate, args.grow_heads) != (None, None, None) and not args.wm_init:
        parser.error("--grow-depth, --grow-intermediate and --grow-heads go with --wm-init")
    if args.wm_self_forcing_rollouts and not args.wm_init:
        parser.error("--wm-self-forcing-rollouts needs --wm-init (the model whose own frames the samples start from)")
    args.policy_mix = parse_policy_mix(parser, args.policy_mix)
    if any(name.startswith("file:") for name in args.policy_mix or {}) and not args.wm_init:
        parser.error("--policy-mix with policy files needs --wm-init (its action statistics map their actions)")
    if (args.part in ("reward-model", "decoder")) != (args.assets is not None):
        parser.error("--assets goes with --part reward-model or decoder, and those need it")
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def parse_policy_mix(parser, text: str | None) -> dict[str, float] | None:
    try:
        return pusht.parse_policy_mix(text)
    except InputError as error:
        parser.error(f"--policy-mix: {error}")


class Stages:
    """Times each stage and collects what it reports into one results dict, written to ``out`` after every stage
    (so a run cut off by a time limit still tells how far it got)."""

    def __init__(self, out: Path, filename: str, overwrite: bool = False, inputs=()):
        self.out, self.filename, self.overwrite, self.inputs = out, filename, overwrite, list(inputs)
        self.started = time.perf_counter()
        self.results: dict[str, Any] = {"stages": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def run(self, name: str, fn, *args, **kwargs):
        print(f"== {name} (at {self.elapsed():.0f} s)", flush=True)
        start = time.perf_counter()
        report = fn(*args, **kwargs)
        self.results["stages"][name] = {"seconds": round(time.perf_counter() - start, 2), **(report or {})}
        self.results["total_seconds"] = round(self.elapsed(), 2)
        print(f"== {name}: {self.results['stages'][name]['seconds']} s", flush=True)
        write_results(self.results, self.filename, str(self.out), self.overwrite, inputs=self.inputs)
        return report


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def simulate(args, work: Path) -> dict:
    """Simulate the training and held-out episodes into ``--data``, or reuse them when it already holds the same
    ones (they depend only on the seed and these settings), and link them and their latent cache into ``work``."""
    data = Path(args.data) if args.data else work
    data.mkdir(parents=True, exist_ok=True)
    size = (args.image_size, args.image_size)
    action_stats = Path(args.wm_init) / ACTION_STATS_FILE if args.wm_init else None
    heldout_steps = max(args.fidelity_chunks * args.chunk, 1)
    heldout_episodes = max(args.heldout_episodes, args.fidelity_episodes, args.policy_episodes)
    for name, episodes, steps, seed, mix in (("dataset", args.episodes, args.steps_per_episode, args.seed,
                                              args.policy_mix),
                                             ("heldout", heldout_episodes, heldout_steps, args.seed + 1, None)):
        request = {"episodes": episodes, "steps": steps, "image_size": list(size), "seed": seed, "policy_mix": mix}
        marker = data / f"{name}.request.json"
        if marker.is_file() and json.loads(marker.read_text()) == request:
            continue
        shutil.rmtree(data / name, ignore_errors=True)
        pusht.generate_pusht_dataset(data / name, episodes, steps_per_episode=steps, image_size=size, seed=seed,
                                     workers=args.workers, policy_mix=mix,
                                     action_stats=action_stats if name == "dataset" else None)
        marker.write_text(json.dumps(request))
    if data != work:
        (data / "latent_cache").mkdir(exist_ok=True)
        for name in ("dataset", "heldout", "latent_cache"):
            link = work / name
            if link.is_dir() and not link.is_symlink():
                shutil.rmtree(link)
            elif link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(data.resolve() / name, target_is_directory=True)
    meta = json.loads((work / "dataset" / "meta.json").read_text())
    return {key: meta[key] for key in ("num_episodes", "steps_per_episode", "policies", "success_rate",
                                       "mean_final_coverage")}


def start_frames(args, assets: Path) -> dict:
    """Start frames for the env from seeds of their own stream (held out like the held-out episodes)."""
    sim_seeds = np.random.default_rng([args.seed, 2]).integers(2**31, size=args.initial_states)
    sim = pusht.PushTSim((args.image_size, args.image_size))
    try:
        frames = np.stack([sim.reset(int(s)) for s in sim_seeds])
    finally:
        sim.close()
    (assets / INITIAL_STATES_FILE).parent.mkdir(parents=True, exist_ok=True)  # inside the checkpoint folder
    np.savez_compressed(assets / INITIAL_STATES_FILE, frames=frames, task=np.asarray(pusht.TASK),
                        sim_seeds=sim_seeds.astype(np.int64))
    return {"count": len(frames)}


def vae_stage(args, work: Path, init_vae: Path | None = None) -> dict:
    """Train the VAE into ``work/vae``; with ``init_vae``, fine-tune only that VAE's decoder (its encoder and latent
    statistics stay, so a world model trained on its latents stays valid)."""
    config = VAETrainConfig(
        base_dim=args.vae_base_dim, decoder_base_dim=args.vae_decoder_dim, z_dim=args.vae_z_dim,
        batch_size=args.vae_batch, lr=args.vae_lr, contrast_weight=args.vae_contrast_weight, resolution_tier=256,
        # Clips as long as the world model's chunk by default: the causal VAE only learns the latent positions it is
        # shown (past them its latents drift: long_encoding_roundtrip.py), which the pixel hand-over never leaves. A
        # latent hand-over (--wm-handover latent) trains on whole-episode encodings and needs longer clips.
        frames_per_clip=args.vae_frames_per_clip or args.chunk + 1, seed=args.seed, device=args.device,
        stats_clips=min(256, 8 * args.episodes),
        init_vae=None if init_vae is None else str(init_vae), train_encoder=init_vae is None,
        # Putting clips on the canvas is CPU work that would leave a GPU waiting.
        num_workers=min(8, args.workers) if args.device.startswith("cuda") else 0,
    )
    probe = dataclasses.replace(config, steps=PROBE_STEPS, warmup_steps=0, log_every=PROBE_STEPS // 2, stats_clips=1)
    train_vae(probe_dataset(work), work / "vae_probe", probe)
    steps_per_s = last_log_line(work / "vae_probe" / "train_log.jsonl")["clips_per_s"] / config.batch_size
    steps = steps_for_budget(steps_per_s, args.vae_seconds, args.vae_max_steps)
    config = dataclasses.replace(config, steps=steps, warmup_steps=min(200, steps // 5))
    train_vae(training_dataset(args, work), work / "vae", config)
    return {"probe_steps_per_s": steps_per_s, "config": dataclasses.asdict(config),
            "last_log": last_log_line(work / "vae" / "train_log.jsonl")}


def decoder_stage(args, work: Path, assets: Path) -> dict:
    """Fine-tune the decoder of the model in ``assets`` and store it there in ``--save-dtype``."""
    from diffusers import AutoencoderKLWan

    shipped = assets / CHECKPOINT_DIR / "vae"
    report = vae_stage(args, work, init_vae=shipped)
    vae = AutoencoderKLWan.from_pretrained(str(work / "vae"), torch_dtype=resolve_save_dtype(args.save_dtype),
                                           use_safetensors=True)
    # The shipped VAE stays whole until the new one is complete (cosmos3_gym.storage: crash-safe replacement).
    replace_entries(shipped, lambda staging: vae.save_pretrained(staging, safe_serialization=True))
    return report


def self_forcing_stage(args, work: Path) -> dict:
    """Self-forcing samples of the training episodes (``cosmos3_gym.tasks.pusht.self_forcing``), rolled out by the
    ``--wm-init`` model in the env it ships in (its assets folder: ``--wm-init`` is ``<assets>/checkpoint``), into
    ``work/self_forcing``; ``training_dataset`` then trains on them beside the simulated episodes."""
    init_assets = load_pusht_assets(Path(args.wm_init).parent)
    stats = ActionStats.from_json(Path(args.wm_init) / ACTION_STATS_FILE,
                                  mode=init_assets.meta.get("action_normalization", "minmax"))
    target = work / "self_forcing"
    request = {"rollouts": args.wm_self_forcing_rollouts, "depth": args.wm_self_forcing_depth, "seed": args.seed,
               "min_rigidity": args.wm_self_forcing_min_rigidity, "init": str(Path(args.wm_init).resolve()),
               "dataset": json.loads((Path(args.data or work) / "dataset.request.json").read_text())}
    marker = work / "self_forcing.request.json"
    if marker.is_file() and json.loads(marker.read_text()) == request and (target / "meta.json").is_file():
        # the same samples (and their cached latents) as an earlier run with this --work: a longer fine-tune
        return {**json.loads((target / "meta.json").read_text())["self_forcing"], "reused": True}
    shutil.rmtree(target, ignore_errors=True)
    marker.unlink(missing_ok=True)
    envs = make_pusht_vector_env(args.wm_self_forcing_envs, assets_dir=init_assets.root, device=args.device,
                                 return_frames=True, reward_model=None, success_threshold=None,
                                 max_episode_steps=None)
    try:
        report = generate_self_forcing_episodes(
            target, work / "dataset", envs, stats=stats, rollouts_per_episode=args.wm_self_forcing_rollouts,
            depth=args.wm_self_forcing_depth, min_rigidity=args.wm_self_forcing_min_rigidity, seed=args.seed,
            workers=args.workers, fit_device=args.device, progress=False)
    finally:
        envs.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the env's graphs and buffers: training needs the memory next
    marker.write_text(json.dumps(request))
    print(f"self-forcing: {report}", flush=True)
    # Each row: the model's frame, then the simulator's continuation of the state read off it (frames 1, 4, 8).
    imageio.imwrite(Path(args.out) / "self_forcing_samples.png", sample_sheet(target))
    return report


def world_model_stage(args, work: Path, assets: Path, seconds_left) -> dict:
    model = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
             "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate_size": args.intermediate}
    # The interleaved mRoPE sections (t, h, w) add up to head_dim / 2, split 2:1:1 as in DEFAULT_MODEL_CONFIG.
    quarter = args.head_dim // 8
    model["rope_scaling"] = {"mrope_section": [args.head_dim // 2 - 2 * quarter, quarter, quarter]}
    config = WorldModelTrainConfig(
        model={} if args.wm_init else model, init_checkpoint=args.wm_init, grow_depth=args.grow_depth,
        grow_width={key: value for key, value in (("intermediate_size", args.grow_intermediate),
                                                  ("num_attention_heads", args.grow_heads)) if value is not None}
        or None,
        chunk=args.chunk, resolution_tier=256,
        batch_size=args.wm_batch, lr=args.wm_lr, policy_episodes=args.wm_policy_episodes,
        cond_noise_std=args.wm_cond_noise, rollout_prob=args.wm_rollout_prob, rollout_max_chunks=args.wm_rollout_chunks,
        rollout_num_steps=args.num_steps,
        # the hand-over the env makes with the model fine-tuned from: its light decoder where its meta.json says so
        rollout_decoder=checkpoint_decoder(args.wm_init) if args.wm_init else "vae",
        handover=args.wm_handover, context_frames=args.wm_context_frames,
        action_history_length=args.wm_action_history,
        context_noise_max=args.wm_context_noise_max, context_noise=args.wm_context_noise,
        video_loss_focus=BLOCK_FOCUS if args.wm_block_focus > 0 else None, video_loss_focus_weight=args.wm_block_focus,
        seed=args.seed, device=args.device, save_every=0,
        save_dtype=args.save_dtype, vae_save_dtype=args.save_dtype, encode_batch_size=args.encode_batch_size,
        cache_dir=str(work / "latent_cache"),
    )
    if args.wm_init:  # fine-tuning keeps the checkpoint's action normalisation (same domain, same simulator)
        shutil.copyfile(Path(args.wm_init) / ACTION_STATS_FILE, work / "dataset" / "stats.json")
    if (work / "self_forcing").is_dir():
        merge_episode_datasets(work / "dataset_with_self_forcing", work / "dataset", work / "self_forcing")
    # The probe runs on the whole dataset, so it also encodes (and caches) every window's latents: the budget left
    # after it is all training.
    probe = dataclasses.replace(config, steps=PROBE_STEPS, warmup_steps=0, log_every=PROBE_STEPS // 2,
                                work_dir=str(work / "world_model_probe" / "training"))
    train_world_model(training_dataset(args, work), work / "world_model_probe", probe, vae_dir=work / "vae")
    log = last_log_line(work / "world_model_probe" / "training" / "log.jsonl")
    steps_per_s = log["samples_per_s"] / config.batch_size
    budget = max(min(args.wm_seconds, seconds_left()), 1.0)
    # The probe's speed is a guess either way: on an H200 it read 2.9-3.6 steps/s where the run then made 4.3-5.0
    # (round 7), and a job starting beside it on the same GPU slows the run. So the step count has headroom, and
    # max_seconds ends the run, and its cosine decay, at the budget (WorldModelTrainConfig.max_seconds).
    steps = steps_for_budget(steps_per_s * PROBE_SPEED_HEADROOM, budget, args.wm_max_steps)
    config = dataclasses.replace(config, steps=steps, warmup_steps=min(args.wm_warmup, steps // 5),
                                 work_dir=str(work / "world_model"), max_seconds=budget)
    checkpoint = assets / CHECKPOINT_DIR
    train_world_model(training_dataset(args, work), checkpoint, config, vae_dir=work / "vae")
    write_env_defaults(checkpoint, num_steps=args.num_steps, guidance_scale=args.guidance_scale, chunk=args.chunk)
    if args.wm_init:
        keep_light_decoder(Path(args.wm_init), checkpoint)
    return {"probe_steps_per_s": steps_per_s, "config": dataclasses.asdict(config),
            "last_log": last_log_line(work / "world_model" / "log.jsonl")}


def write_env_defaults(checkpoint: Path, *, num_steps: int, guidance_scale: float, chunk: int) -> None:
    """Add the env's defaults to the meta.json training wrote (domain, chunk, tier, fps, image size), including
    where the assets folder keeps the start frames and the reward model, so that ``checkpoint_defaults`` of the
    checkpoint alone (``load_engine("pusht")``, the CLI) finds them. Round 8's fine-tune had lost those three."""
    update_meta(
        checkpoint, drop=("dataset",),  # a path on the training machine means nothing to users
        task=pusht.TASK, num_steps=num_steps, guidance_scale=guidance_scale,
        success_threshold=pusht.SUCCESS_COVERAGE,  # gym-pusht's line until success_threshold_stage calibrates it
        max_episode_steps=-(-SIM_EPISODE_STEPS // chunk),
        # Relative to the checkpoint, inside it (checkpoint_defaults refuses paths that lead out of it).
        score_name="coverage", initial_states=Path(INITIAL_STATES_FILE).relative_to(CHECKPOINT_DIR).as_posix(),
        reward_model=f"classifier:{Path(REWARD_MODEL_DIR).relative_to(CHECKPOINT_DIR).as_posix()}",
    )


def update_meta(checkpoint: Path, drop: tuple[str, ...] = (), **fields) -> dict:
    """Set ``fields`` in the checkpoint's meta.json and remove the keys in ``drop``; returns the meta.json before."""
    before = json.loads((checkpoint / META_FILE).read_text())
    meta = {key: value for key, value in {**before, **fields}.items() if key not in drop}
    (checkpoint / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return before


def keep_light_decoder(init: Path, checkpoint: Path) -> None:
    """A fine-tune keeps the light decoder of the checkpoint it started from, and its meta.json's ``decoder``: the
    decoder reads the VAE's latents, which fine-tuning the world model leaves as they were (the VAE is not trained).
    Without it the fine-tuned model lost the built-in env's fast decode, and a later part's rollouts the env's
    hand-over."""
    if not (init / LIGHT_DECODER_DIR / "config.json").is_file():
        return
    shutil.rmtree(checkpoint / LIGHT_DECODER_DIR, ignore_errors=True)
    shutil.copytree(init / LIGHT_DECODER_DIR, checkpoint / LIGHT_DECODER_DIR)
    update_meta(checkpoint, decoder=checkpoint_decoder(init))


def unpack_first_part(source: Path, work: Path) -> None:
    """Put what ``--part second`` starts from into ``work``: ``vae/`` and ``assets/pusht/`` (start frames, reward
    model), from a ``first_part.tar.gz`` or from an installed model folder (its VAE and everything but its
    checkpoint), so that an installed model can be fine-tuned without its first part."""
    if not source.is_dir():
        with tarfile.open(source) as tar:
            tar.extractall(work, filter="data")
        return
    shutil.rmtree(work / "vae", ignore_errors=True)
    shutil.copytree(source / CHECKPOINT_DIR / "vae", work / "vae")
    target = work / "assets" / "pusht"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(CHECKPOINT_DIR), dirs_exist_ok=True)
    # The start frames and the reward model live in the checkpoint folder; the rest of it the world model stage writes.
    (target / REWARD_MODEL_DIR).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source / REWARD_MODEL_DIR, target / REWARD_MODEL_DIR, dirs_exist_ok=True)
    shutil.copyfile(source / INITIAL_STATES_FILE, target / INITIAL_STATES_FILE)


def match_first_part_image_size(args, assets: Path) -> None:
    """The episodes ``--part second`` simulates must have the size of the first part's start frames (the world
    model's rollouts start from them, and the reward model learns from both). ``--smoke`` takes the first part's
    size (an installed 256x256 model); otherwise a different ``--image-size`` is an error."""
    with np.load(assets / INITIAL_STATES_FILE) as archive:
        height, width = archive["frames"].shape[1:3]
    if (height, width) == (args.image_size, args.image_size):
        return
    if args.smoke and height == width:
        print(f"--smoke: --image-size {height}, the size of --first-part's start frames", flush=True)
        args.image_size = int(height)
        return
    raise InputError(f"--image-size: expected the size of --first-part's start frames ({height}x{width}), got "
                     f"{args.image_size}")


def merge_episode_datasets(target: Path, first: Path, *others: Path) -> Path:
    """A dataset in ``target`` whose episodes are links to those of ``first`` and ``others`` (names kept: they must
    differ) and whose meta.json and stats.json (the action statistics every episode is normalised with) are
    ``first``'s."""
    shutil.rmtree(target, ignore_errors=True)
    (target / "episodes").mkdir(parents=True)
    for name in ("meta.json", "stats.json"):
        shutil.copyfile(first / name, target / name)
    for source in (first, *others):
        for path in sorted((source / "episodes").glob("episode_*.npz")):
            link = target / "episodes" / path.name
            if link.exists():
                raise InputError(f"dataset: {path.name} is in two of the merged datasets")
            link.symlink_to(path.resolve())
    return target


def training_dataset(args, work: Path) -> Path | str:
    """What the VAE and the world model train on: ``work/dataset``, or with ``--lerobot`` that dataset converted once
    to LeRobot v3.0 (``lerobot:work/lerobot``) with the action statistics of ``work/dataset`` (which ``--wm-init``
    replaces by the checkpoint's)."""
    if (work / "dataset_with_self_forcing").is_dir():
        if args.lerobot:
            raise InputError("--lerobot: self-forcing samples are written in the episode layout only")
        return work / "dataset_with_self_forcing"
    if not args.lerobot:
        return work / "dataset"
    from cosmos3_gym.data.lerobot import write_lerobot_dataset

    target = work / "lerobot"
    if not target.exists():
        write_lerobot_dataset(work / "dataset", target, progress=False)
    stats = json.loads((work / "dataset" / "stats.json").read_text())
    (target / "meta" / "stats.json").write_text(json.dumps(stats))
    return f"lerobot:{target}"


def probe_dataset(work: Path) -> Path:
    """The first PROBE_EPISODES training episodes as a dataset of their own (links), for measuring speed."""
    dataset, probe = work / "dataset", work / "probe_dataset"
    if not probe.exists():
        (probe / "episodes").mkdir(parents=True)
        for name in ("meta.json", "stats.json"):
            shutil.copyfile(dataset / name, probe / name)
        for path in sorted((dataset / "episodes").glob("episode_*.npz"))[:PROBE_EPISODES]:
            (probe / "episodes" / path.name).symlink_to(path)
    return probe


def steps_for_budget(steps_per_s: float, seconds: float, max_steps: int) -> int:
    return int(min(max_steps, max(MIN_STEPS, steps_per_s * seconds)))


def reward_model_stage(args, work: Path, assets: Path, on_rollouts: bool = False) -> dict:
    """A classifier whose score estimates coverage: trained with BCE on coverage as a soft label.

    With ``on_rollouts`` it also learns from the world model's own frames (``rollout_frames``), labelled with the
    simulator's coverage at the same step: trained on real frames alone it reads a faded target as a covered one
    (coverage hides the green target), and scores every imagined episode high.
    """
    paths = reward_model_episodes(args, work)
    per_episode = max(1, args.rm_frames // len(paths))
    rng = np.random.default_rng(args.seed)
    frames, labels = [], []
    for path in paths:
        with np.load(path) as episode:
            picked = rng.choice(len(episode["coverage"]), size=min(per_episode, len(episode["coverage"])),
                                replace=False)
            frames.append(episode["frames"][picked])
            labels.append(episode["coverage"][picked])
    report = {"real_frames": int(sum(len(f) for f in frames))}
    if on_rollouts:
        generated, generated_labels = rollout_frames(args, work, assets)
        frames.append(generated)
        labels.append(generated_labels)
        report["world_model_frames"] = int(len(generated))
    frames, labels = np.concatenate(frames), np.clip(np.concatenate(labels), 0.0, 1.0)
    model = train_classifier(frames, labels, epochs=args.rm_epochs, batch_size=128, lr=1e-3, seed=args.seed,
                             device=args.device, input_size=args.rm_input_size, channels=(16, 32, 64, 64),
                             reduce="last")
    model.save(assets / REWARD_MODEL_DIR)
    return {**report, "mean_label": float(labels.mean()),
            "success_frames": int((labels > pusht.SUCCESS_COVERAGE).sum())}


def reward_model_episodes(args, work: Path) -> list[Path]:
    """The training episodes whose real frames ``reward_model_stage`` reads: every k-th, about ``--rm-episodes``
    (reading every episode's frames would take long)."""
    paths = sorted((work / "dataset" / "episodes").glob("episode_*.npz"))
    return paths[:: max(1, len(paths) // args.rm_episodes)]


def calibration_episodes(args, work: Path) -> dict[str, Any]:
    """Real episodes the reward model never saw, split in two (alternate episodes) to fit the success threshold on
    ("fit") and to check it ("check"): the training episodes that ``reward_model_stage`` neither reads
    (``reward_model_episodes``) nor replays in the world model (``rollout_frames``), at most
    ``--rm-calibration-episodes`` spread over the dataset, and the held-out episodes (another seed; evaluation's,
    shorter)."""
    paths = sorted((work / "dataset" / "episodes").glob("episode_*.npz"))
    seen = set(reward_model_episodes(args, work)) | set(paths[: args.rm_rollout_episodes])
    unseen = [path for path in paths if path not in seen]
    cap = max(0, args.rm_calibration_episodes)
    if len(unseen) > cap:
        unseen = unseen[:: -(-len(unseen) // cap)] if cap else []
    heldout = sorted((work / "heldout" / "episodes").glob("episode_*.npz"))
    return {"fit": unseen[0::2] + heldout[0::2], "check": unseen[1::2] + heldout[1::2],
            "training_episodes": len(unseen), "heldout_episodes": len(heldout)}


def success_threshold_stage(args, work: Path, assets: Path) -> dict:
    """Set ``success_threshold`` in the checkpoint's meta.json to the reward model's score that best (F1) marks
    gym-pusht's success (coverage > ``SUCCESS_COVERAGE``) on the "fit" episodes of ``calibration_episodes``, and
    measure it on the "check" ones (``rewards.calibration.calibrate_success_threshold``, as
    ``benchmarks/reward_model_calibration.py`` does). With fewer than ``MIN_CALIBRATION_SUCCESS_FRAMES`` success frames
    to fit on it writes gym-pusht's 0.95, and the report says why."""
    episodes = calibration_episodes(args, work)
    model = ClassifierRewardModel.load(assets / REWARD_MODEL_DIR, device=args.device)
    sets = {}
    for name in ("fit", "check"):
        coverage, scores = score_episode_files(episodes[name], model)
        sets[name] = (scores, coverage > pusht.SUCCESS_COVERAGE)
    calibration = calibrate_success_threshold(*sets["fit"], *sets["check"], fallback=pusht.SUCCESS_COVERAGE,
                                              min_success_frames=MIN_CALIBRATION_SUCCESS_FRAMES)
    previous = update_meta(assets / CHECKPOINT_DIR,
                           success_threshold=calibration["success_threshold"]).get("success_threshold")
    if calibration["fitted"]:
        how = "; ".join(f"{name}: F1 {row['f1']:.2f}, precision {row['precision']:.2f}, recall {row['recall']:.2f} "
                        f"on {row['frames']} frames, {row['success_frames']} successes"
                        for name, row in (("fit", calibration["fit"]), ("check", calibration["check"])) if row)
    else:
        how = calibration["reason"]
    print(f"success_threshold {previous} -> {calibration['success_threshold']:g} ({how})", flush=True)
    return {**calibration, "previous_success_threshold": previous,
            "success": f"gym-pusht coverage > {pusht.SUCCESS_COVERAGE}",
            "episodes": {"fit": len(episodes["fit"]), "check": len(episodes["check"]),
                         "training_unseen_by_reward_model": episodes["training_episodes"],
                         "heldout": episodes["heldout_episodes"]}}


def rollout_frames(args, work: Path, assets: Path) -> tuple[np.ndarray, np.ndarray]:
    """The world model in ``assets`` replaying ``--rm-rollout-episodes`` training episodes' actions for
    ``--rm-rollout-chunks`` chunks, each from a random frame of its episode (so that the labels span the coverage
    range, not just starts): its frames and the simulator's coverage at each step."""
    paths = sorted((work / "dataset" / "episodes").glob("episode_*.npz"))[: args.rm_rollout_episodes]
    model = load_pusht_assets(assets)
    checkpoint = model.checkpoint
    stats = ActionStats.from_json(pusht_env_defaults(model)["action_stats"],
                                  mode=model.meta.get("action_normalization", "minmax"))
    steps = args.rm_rollout_chunks * args.chunk
    rng = np.random.default_rng([args.seed, 3])
    starts, actions, labels = [], [], []
    for path in paths:  # only the start frame of each episode is kept in memory, not its whole video
        with np.load(path) as episode:
            first = int(rng.integers(0, len(episode["actions"]) - steps + 1))
            starts.append(episode["frames"][first])
            actions.append(episode["actions"][first : first + steps])
            labels.append(episode["coverage"][first + 1 : first + steps + 1])
    actions = np.clip(stats.normalize(np.stack(actions).astype(np.float32)), -1.0, 1.0)
    actions = actions.reshape(len(paths), args.rm_rollout_chunks, args.chunk, -1)
    engine = Cosmos3Engine.from_pretrained(checkpoint, device=args.device, progress=False)
    envs = make_pusht_vector_env(len(paths), assets_dir=assets, engine=engine, return_frames=True,
                                 reward_model=None, success_threshold=None, max_episode_steps=None)
    try:
        generated = replay_actions(envs, np.stack(starts), actions, seed=args.seed)
    finally:
        envs.close()
        engine.close()
    return generated.reshape(-1, *generated.shape[-3:]), np.stack(labels).reshape(-1)


def package(args, assets: Path, out: Path) -> dict:
    load_pusht_assets(assets)  # the folder is complete
    sizes = {}
    for path in sorted(p for p in assets.rglob("*") if p.is_file()):
        sizes[str(path.relative_to(assets))] = path.stat().st_size
    total_mb = sum(sizes.values()) / 1e6
    archive = out / "pusht_assets.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(assets, arcname=assets.name)
    report = {"total_mb": round(total_mb, 3), "archive_mb": round(archive.stat().st_size / 1e6, 3),
              "files": sizes}
    if total_mb > args.max_size_mb:
        raise SystemExit(f"the assets take {total_mb:.1f} MB, more than --max-size-mb {args.max_size_mb}: {report}")
    return report


def evaluate_stage(args, work: Path, assets: Path, out: Path) -> dict:
    results = fidelity_pusht_chunks.evaluate(
        assets, work / "heldout", device=args.device, fidelity_episodes=args.fidelity_episodes,
        fidelity_chunks=args.fidelity_chunks, policy_episodes=args.policy_episodes,
        policy_chunks=args.policy_chunks, workers=args.workers,
    )
    results = {"provenance": provenance(), **results}
    write_results(results, "fidelity_pusht_chunks.json", str(out), args.overwrite)
    video = pusht.side_by_side(out / "side_by_side.mp4", seed=int(args.seed + 3), num_chunks=args.video_chunks,
                               assets_dir=assets, device=args.device)
    return {
        "psnr_rollout_db": [round(c["mean"], 2) for c in results["forward_dynamics"]["psnr_db"]["rollout"]],
        "psnr_hold_first_db": [round(c["mean"], 2) for c in results["forward_dynamics"]["psnr_db"]["hold_first"]],
        "psnr_copy_start_db": [round(c["mean"], 2) for c in results["forward_dynamics"]["psnr_db"]["copy_start"]],
        "policy_final_coverage": results["policy_in_simulator"]["policy"]["final_coverage"],
        "random_final_coverage": results["policy_in_simulator"]["random"]["final_coverage"],
        "video": video,
    }


def last_log_line(path: Path) -> dict | None:
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]) if lines else None


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.backends.cudnn.benchmark = True  # fixed shapes throughout: the VAE's 3-D convolutions gain the most
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="train_pusht_"))
    assets = work / "assets" / "pusht"
    if assets.exists():
        shutil.rmtree(assets)
    assets.mkdir(parents=True)
    stages = Stages(out, "train_pusht.json" if args.part == "all" else f"train_pusht_{args.part}.json", args.overwrite,
                    inputs_from_args(args, builtin_assets=False))  # the files it starts from: their sha256
    stages.results.update(provenance=provenance(), arguments=vars(args), work=str(work))

    try:
        if args.part == "second":  # first: the simulation must match its start frames' size
            unpack_first_part(Path(args.first_part), work)
            match_first_part_image_size(args, assets)
        stages.run("simulate", simulate, args, work)
        if args.part == "reward-model":
            stages.run("reward_model", reward_model_stage, args, work, Path(args.assets), on_rollouts=True)
            stages.run("success_threshold", success_threshold_stage, args, work, Path(args.assets))
            return stages.results
        if args.part == "decoder":
            shutil.copytree(args.assets, assets, dirs_exist_ok=True)
            stages.run("vae_decoder", decoder_stage, args, work, assets)
        elif args.part != "second":
            stages.run("start_frames", start_frames, args, assets)
            stages.run("vae", vae_stage, args, work)
            stages.run("reward_model", reward_model_stage, args, work, assets)
        if args.part == "first":
            with tarfile.open(out / FIRST_PART_ARCHIVE, "w:gz") as tar:
                tar.add(work / "vae", arcname="vae")
                tar.add(assets, arcname=str(assets.relative_to(work)))
            return stages.results
        if args.part != "decoder":
            # what is left of --deadline-s after the export (about 30 s) and the stages that follow
            after = 30.0 + SUCCESS_THRESHOLD_RESERVE_S + (
                ROLLOUT_REWARD_MODEL_RESERVE_S if args.rollout_reward_model else 0.0) + (
                args.eval_reserve_s if args.evaluate else 0.0)
            seconds_left = lambda: args.deadline_s - after - stages.elapsed()  # noqa: E731
            if args.wm_self_forcing_rollouts:
                stages.run("self_forcing", self_forcing_stage, args, work)
            stages.run("world_model", world_model_stage, args, work, assets, seconds_left)
        if args.rollout_reward_model:
            stages.run("reward_model_on_rollouts", reward_model_stage, args, work, assets, on_rollouts=True)
        # the reward model that ships, retrained or not (--no-rollout-reward-model keeps --first-part's / --assets')
        stages.run("success_threshold", success_threshold_stage, args, work, assets)
        stages.run("package", package, args, assets, out)
        if not args.evaluate:
            stages.results["stages"]["evaluate"] = {"skipped": "--no-evaluate"}
        elif args.deadline_s - stages.elapsed() >= args.eval_reserve_s:
            stages.run("evaluate", evaluate_stage, args, work, assets, out)
        else:
            stages.results["stages"]["evaluate"] = {"skipped": f"less than {args.eval_reserve_s} s left"}
    finally:
        for source, name in ((work / "vae" / "train_log.jsonl", "vae_log.jsonl"),
                             (work / "world_model" / "log.jsonl", "world_model_log.jsonl")):
            if source.is_file():
                shutil.copyfile(source, out / name)
        stages.results["total_seconds"] = round(stages.elapsed(), 2)
        write_results(stages.results, stages.filename, str(out), args.overwrite, inputs=stages.inputs)
    return stages.results


if __name__ == "__main__":
    main()
