"""Does the built-in PushT VAE keep long clips? Real gym-pusht episodes encoded whole (one causal pass, as the latent
hand-over's training windows are cut from), decoded, and compared with the real frames per latent position.

    python benchmarks/recipes/long_encoding_roundtrip.py --out $OUT      # 2-core CPU: about 2 minutes

Issue 42 item 2 trains on windows cut from whole-episode encodings so that clean non-first latent frames are in
distribution. That holds only if the VAE encodes a long clip as well as the short clips it was trained on (chunk + 1
= 9 frames, 3 latent frames). Here, for ``--episodes`` episodes of ``--frames`` frames (the noisy scripted pusher
from the policy-pool manifest's ``measurements`` seeds):

* **whole**: the episode encoded in one causal pass, then decoded whole by the exact VAE and by the light decoder
  (``Cosmos3Engine.decode_latents``): PSNR against the real frames per latent position (latent 0 is frame 0, latent
  ``j`` frames ``4j-3 .. 4j``);
* **windows**: the ``chunk + 1`` frame windows from frame ``4j`` encoded on their own, as the pixel hand-over's training
  windows are, and decoded by the light decoder (the env's): PSNR of their ``chunk`` new frames, and the mean
  absolute difference between their latents and the whole-episode latents of the same frames;
* **sliding**: every latent from a short clip: latents 0 and 1 from the first window, latent ``j >= 2`` the last
  latent of the window of frames ``4(j-2) .. 4j``, decoded whole by both decoders (the layout a latent hand-over
  can train on without a VAE trained on long clips).

Writes ``long_encoding_roundtrip_cpu.json`` (card, commit, command, checkpoint hashes via ``common.write_results``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent)]  # the repository, benchmarks/

from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym import processor  # noqa: E402
from cosmos3_gym.engine import Cosmos3Engine  # noqa: E402
from cosmos3_gym.models.light_decoder import LightDecoder  # noqa: E402
from cosmos3_gym.statistics import mean_summary  # noqa: E402

RESULTS_NAME = "long_encoding_roundtrip_cpu.json"


def psnr(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    return float(10 * torch.log10(1.0 / (estimate - reference).square().mean().clamp_min(1e-12)))


def episode_frames(seed: int, frames: int, image_size: tuple[int, int]) -> np.ndarray:
    from cosmos3_gym.tasks.pusht.policies import ScriptedPusher
    from cosmos3_gym.tasks.pusht.sim import PushTSim, rollout_episode

    sim = PushTSim(image_size=image_size)
    episode = rollout_episode(sim, ScriptedPusher(np.random.default_rng(seed), noise=10), seed, frames - 1)
    return episode["frames"][:frames]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--checkpoint", default="cosmos3_gym/tasks/pusht/assets/checkpoint")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--frames", type=int, default=65, help="frames per episode, 1 + a multiple of 4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--light-decoder", default=None, help="a light decoder folder instead of the checkpoint's")
    parser.add_argument("--results-name", default=RESULTS_NAME)
    args = parser.parse_args(argv)
    args.argv = sys.argv if argv is None else ["long_encoding_roundtrip.py", *argv]
    check_results_target(args.results_name, args.out, args.overwrite, topic="fidelity")
    torch.set_num_threads(args.threads)
    from cosmos3_gym.tasks.pusht.policy_pools import load_policy_pools

    seeds = load_policy_pools(check_files=False).seed_block("measurements", args.episodes, offset=1000)
    engines = {
        decoder: Cosmos3Engine.from_pretrained(args.checkpoint, device="cpu", dtype="fp32", decoder=decoder)
        for decoder in ("vae", "light")
    }
    if args.light_decoder:
        engines["light"].light_decoder = LightDecoder.from_pretrained(args.light_decoder).eval().requires_grad_(False)
    vae = engines["light"].vae
    tc, chunk = vae.temporal_compression, 8
    latents_per_episode = (args.frames - 1) // tc + 1
    whole: dict[str, list[list[float]]] = {"vae": [], "light": []}
    window_psnr: list[list[float]] = []
    window_latent_gap: list[list[float]] = []
    sliding_rows: dict[str, list[list[float]]] = {"vae": [], "light": []}
    started = time.perf_counter()
    with torch.no_grad():
        for seed in seeds:
            frames = episode_frames(seed, args.frames, (256, 256))
            cond = processor.prepare_conditioning(frames, 256, len(frames))
            h, w = cond.latent_hw
            latents = vae.encode(cond.pixels)[..., :h, :w]  # [1, C, L, h, w], one causal pass
            real = torch.from_numpy(frames).float().permute(3, 0, 1, 2) / 255.0  # [3, T, H, W]
            groups = [slice(0, 1)] + [slice(1 + tc * (j - 1), 1 + tc * j) for j in range(1, latents_per_episode)]
            for decoder, engine in engines.items():
                decoded = engine.decode_latents(latents)[0]
                whole[decoder].append([psnr(decoded[:, g], real[:, g]) for g in groups])
            psnrs, gaps, windows = [], [], []
            for j in range(latents_per_episode - chunk // tc):
                start = tc * j
                clip = processor.prepare_conditioning(frames[start : start + chunk + 1], 256, chunk + 1)
                window = vae.encode(clip.pixels)[..., :h, :w]
                windows.append(window)
                decoded = engines["light"].decode_latents(window)[0][:, 1:]
                psnrs.append(psnr(decoded, real[:, start + 1 : start + chunk + 1]))
                gaps.append(float((window[:, :, 1:] - latents[:, :, j + 1 : j + 1 + chunk // tc]).abs().mean()))
            window_psnr.append(psnrs)
            window_latent_gap.append(gaps)
            # Sliding-window latents: latent j >= 2 is the last latent of the window of frames 4(j-2) .. 4j, latents 0
            # and 1 those of the first window; every latent then comes from a clip as short as the VAE's training clips
            sliding = torch.cat([windows[0][:, :, :2]] + [window[:, :, 2:3] for window in windows], dim=2)
            for decoder, engine in engines.items():
                decoded = engine.decode_latents(sliding)[0]
                n = sliding.shape[2]
                sliding_rows[decoder].append([psnr(decoded[:, g], real[:, g]) for g in groups[:n]])
            print(f"seed {seed}: whole-episode light decode PSNR by latent {np.round(whole['light'][-1], 1).tolist()}")

    def per_position(rows: list[list[float]]) -> list[dict]:
        return [mean_summary([row[i] for row in rows]) for i in range(len(rows[0]))]

    results = {
        "provenance": provenance(args.argv),
        "checkpoint": args.checkpoint,
        "episodes": len(seeds),
        "seeds": [seeds[0], seeds[-1]],
        "frames": args.frames,
        "what": "PSNR (dB) against the real frames per latent position; window rows by their first latent index j",
        "whole_episode_psnr_db": {decoder: per_position(rows) for decoder, rows in whole.items()},
        "window_psnr_db_light": per_position(window_psnr),
        "window_vs_whole_latent_abs_diff": per_position(window_latent_gap),
        "sliding_window_psnr_db": {decoder: per_position(rows) for decoder, rows in sliding_rows.items()},
        "seconds": time.perf_counter() - started,
    }
    inputs = [args.checkpoint] + ([args.light_decoder] if args.light_decoder else [])
    results["light_decoder"] = args.light_decoder or "the checkpoint's"
    write_results(results, args.results_name, args.out, args.overwrite, topic="fidelity", inputs=inputs)
    for decoder in ("vae", "light"):
        print(decoder, [round(s["mean"], 1) for s in results["whole_episode_psnr_db"][decoder]])
    print("windows (light)", [round(s["mean"], 1) for s in results["window_psnr_db_light"]])
    for decoder in ("vae", "light"):
        print("sliding", decoder, [round(s["mean"], 1) for s in results["sliding_window_psnr_db"][decoder]])


if __name__ == "__main__":
    main()
