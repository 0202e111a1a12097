"""How far does the PushT env's hand-over alone move the T? Real gym-pusht frames encoded and decoded N times.

    python benchmarks/recipes/handover_roundtrip.py --out $OUT            # 2-core CPU: a few minutes
    python benchmarks/recipes/handover_roundtrip.py --vae-dtype float32   # the VAE in float32 instead of the env's
    python benchmarks/recipes/handover_roundtrip.py --checkpoint DIR --states 2 --rounds 2 --decoders vae --out DIR

fidelity.md's "cheapest experiment first" (issue 42, item 2). Each chunk of the PushT env starts from the last frame
of the previous chunk: decoded to uint8 pixels, then VAE-encoded again as the next request's conditioning frame. Here
no world model runs: a real frame goes through that hand-over ``--rounds`` times (encode -> decode -> uint8 -> the next
round's frame), and after each round the T's pose is fitted (``tasks.pusht.reward.fit_tee``, the fidelity targets'
fit) and the agent read off (``tasks.pusht.readoff.read_positions``).

* **States.** ``--states`` gym-pusht states from the ``measurements`` seed range of
  ``cosmos3_gym/tasks/pusht/policy_pools.json`` (``seed_block``): reset, then the noise-free scripted pusher for a
  number of steps drawn per seed in ``[0, --push-steps]``, so that some states have the agent at the block. Frames at
  the model's image size (256 x 256 for the built-in model).
* **Encode** exactly as the env does: ``Cosmos3Engine.prepare`` of the env's forward-dynamics request (the env's
  settings, ``pusht_env_defaults``), whose conditioning latent is ``vae.encode`` of the frame on the request's
  canvas. **Decode** the one latent frame with the checkpoint's exact VAE decode (``engine.vae.decode``, engine loaded
  with ``decoder="vae"``) or its light decoder (``engine.light_decoder.decode``, ``decoder="light"``, the built-in
  model's default), ``frames="last"`` as the env's step does, then uint8 as the env rounds. ``--vae-dtype env``
  loads each engine with ``fast_pusht_engine`` (what the PushT env runs: a bf16 VAE on GPUs and on CPUs with native
  bf16, else float32); ``float32`` with ``Cosmos3Engine.from_pretrained``'s default.
* **Errors per round** (95 % t intervals over the states, ``cosmos3_gym.statistics.mean_summary``): block position
  (the fitted T's area centroid, table px of 512), block angle (deg) and agent position (px), each against the fit on
  the original frame (what the hand-over changed) and against the simulator's true pose (what a rollout is scored
  against; round 0 is the fit's own floor). Also the mean signed block and agent shifts (a bias that repeats every
  hand-over adds up linearly, as the rollouts' block error does), the fitted T's rigidity, PSNR against the original
  frame, and how many states lost the block (no fit) or the agent (not visible).
* **Chunk's last frame** (``--chunk-clip``, default on): the env hands over the *last* frame of a generated chunk,
  the ninth frame of three latent frames, not a one-frame image. For each state the simulator runs ``chunk`` more
  scripted steps; that real clip is encoded whole and its last frame decoded (``frames="last"``) and fitted against
  the simulator's pose at that step: one hand-over with perfect latents.

Writes ``handover_roundtrip_cpu.json`` (``--results-name``; card, commit, command and checkpoint hashes via
``common.write_results``) to ``--out`` (default ``$OUT``, else benchmarks/results/fidelity).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]  # the repository, benchmarks/, recipes/

from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym.statistics import mean_summary  # noqa: E402

RESULTS_NAME = "handover_roundtrip_cpu.json"
TOPIC = "fidelity"
DECODERS = ("vae", "light")
ONE_ROUND_QUESTION_PX = (1.0, 2.0)  # fidelity.md: "if one round trip moves the pose by 1-2 px, the hand-over alone
# explains much of the drift"


# ---------------------------------------------------------------------------------------------------------------
# States and measurements
# ---------------------------------------------------------------------------------------------------------------


def simulate_states(seeds: range, image_size: tuple[int, int], push_steps: int, chunk: int, clip: bool
                    ) -> dict[str, Any]:
    """For each reset seed: the frame after ``k`` noise-free scripted steps (``k`` uniform in ``[0, push_steps]``,
    drawn from the seed), its true block pose and agent position; with ``clip``, the next ``chunk`` steps' frames
    too (``clips [N, chunk + 1, H, W, 3]``) and the true state at the clip's last frame."""
    from cosmos3_gym.tasks.pusht.episodes import PushTSim, ScriptedPusher

    out: dict[str, list] = {"frames": [], "pose": [], "agent": [], "steps": [], "clips": [], "clip_pose": [],
                            "clip_agent": []}
    sim = PushTSim(image_size)
    try:
        for seed in seeds:
            frame = sim.reset(int(seed))
            steps = int(np.random.default_rng([int(seed), 1]).integers(0, push_steps + 1))
            pusher = ScriptedPusher(np.random.default_rng([int(seed), 2]))
            for _ in range(steps):
                frame = sim.step(pusher(sim.agent_xy, sim.block_pose))
            out["frames"].append(frame)
            out["pose"].append(np.asarray(sim.block_pose, np.float64))
            out["agent"].append(np.asarray(sim.agent_xy, np.float64))
            out["steps"].append(steps)
            if clip:
                clip_frames = [frame]
                for _ in range(chunk):
                    clip_frames.append(sim.step(pusher(sim.agent_xy, sim.block_pose)))
                out["clips"].append(np.stack(clip_frames))
                out["clip_pose"].append(np.asarray(sim.block_pose, np.float64))
                out["clip_agent"].append(np.asarray(sim.agent_xy, np.float64))
    finally:
        sim.close()
    return {key: np.stack(value) if value and not isinstance(value[0], int) else np.asarray(value)
            for key, value in out.items() if value}


def measure(frames: np.ndarray, device: str) -> dict[str, np.ndarray]:
    """uint8 frames ``[N, H, W, 3]`` -> block ``pose [N, 3]`` (NaN where no block was found), ``rigidity [N]``,
    ``agent [N, 2]`` (NaN where not visible)."""
    from cosmos3_gym.tasks.pusht.readoff import read_positions
    from cosmos3_gym.tasks.pusht.reward import fit_tee

    fit = fit_tee(torch.from_numpy(np.ascontiguousarray(frames)).to(device))
    pose = fit.pose.double().cpu().numpy()
    valid = fit.valid.cpu().numpy()
    pose[~valid] = np.nan
    agent, _ = read_positions(frames)
    return {"pose": pose, "rigidity": np.where(valid, fit.rigidity.double().cpu().numpy(), np.nan), "agent": agent}


def pose_errors(estimate: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block poses ``[N, 3]`` -> centroid distance (px), angle error (deg), signed centroid shift ``[N, 2]`` (px), as
    the fidelity targets measure the block (``pusht_fidelity_targets.pose_errors``: centroids, so that an angle error
    does not count twice)."""
    from pusht_fidelity_targets import angle_error_deg, tee_centroid

    shift = tee_centroid(estimate) - tee_centroid(truth)
    return np.linalg.norm(shift, axis=-1), angle_error_deg(estimate[..., 2], truth[..., 2]), shift


def psnr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PSNR (dB) per frame of uint8 ``[N, H, W, 3]`` pairs (capped at 99 for identical frames)."""
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
    return np.where(mse > 0, 10 * np.log10(255.0**2 / np.maximum(mse, 1e-12)), 99.0)


DISTANCE, DEGREES, UNIT = (0.0, math.inf), (0.0, 180.0), (0.0, 1.0)  # the bounds the t intervals are clipped to


def summary(values: np.ndarray, bounds: tuple[float, float] | None = None) -> dict[str, Any]:
    """``mean_summary`` over the finite values (the states where the part was found), with the count left out."""
    values = np.asarray(values, np.float64)
    finite = values[np.isfinite(values)]
    result = mean_summary(finite.tolist(), bounds=bounds) if len(finite) else {"mean": float("nan"), "n": 0}
    result["missing"] = int(len(values) - len(finite))
    return result


def errors_against(measured: dict[str, np.ndarray], pose: np.ndarray, agent: np.ndarray) -> dict[str, Any]:
    position, angle, shift = pose_errors(measured["pose"], pose)
    agent_shift = measured["agent"] - agent
    return {"block_position_px": summary(position, DISTANCE), "block_angle_deg": summary(angle, DEGREES),
            "agent_px": summary(np.linalg.norm(agent_shift, axis=-1), DISTANCE),
            "block_shift_x_px": summary(shift[:, 0]), "block_shift_y_px": summary(shift[:, 1]),
            "agent_shift_x_px": summary(agent_shift[:, 0]), "agent_shift_y_px": summary(agent_shift[:, 1])}


# ---------------------------------------------------------------------------------------------------------------
# The hand-over
# ---------------------------------------------------------------------------------------------------------------


class HandOver:
    """The env's hand-over for one engine: ``encode(frames)`` (as its requests encode a conditioning frame) and
    ``decode(latents)`` (the last frame, with the engine's decoder), both on uint8 frames / float latents."""

    def __init__(self, engine, request_fields: dict[str, Any], decoder: str):
        self.engine, self.fields, self.decoder = engine, request_fields, decoder

    def request(self, frame: np.ndarray):
        from cosmos3_gym.engine import Cosmos3Request

        chunk, dim = int(self.fields["chunk"]), int(self.fields["raw_action_dim"])
        return Cosmos3Request(mode="forward_dynamics", observation=frame, task="", action=np.zeros((chunk, dim)),
                              seed=0, **self.fields)

    @torch.inference_mode()
    def encode(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 ``[N, H, W, 3]`` -> the conditioning latents ``[N, z, 1, h, w]`` the env's requests carry."""
        return torch.cat([self.engine.prepare(self.request(frame)).x0_video for frame in frames])

    @torch.inference_mode()
    def encode_clips(self, clips: np.ndarray) -> torch.Tensor:
        """uint8 clips ``[N, T, H, W, 3]`` -> latents ``[N, z, (T - 1) / 4 + 1, h, w]`` on the same canvas."""
        from cosmos3_gym import processor

        latents = []
        for clip in clips:
            prepared = self.engine.prepare(self.request(clip[0]), encode=False)  # the resolved request: its canvas
            request = prepared.request
            pixels = processor.prepare_conditioning(clip, request.resolution_tier, len(clip), canvas=request.canvas)
            pixels = pixels.pixels
            _, h, w = prepared.latent_thw
            latents.append(self.engine.vae.encode(pixels.to(self.engine.device))[:, :, :, :h, :w])
        return torch.cat(latents)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents ``[N, z, t, h, w]`` -> the last frame, uint8 ``[N, H, W, 3]``, rounded as the env rounds."""
        from cosmos3_gym.media import to_uint8

        if self.decoder == "light":
            pixels = self.engine.light_decoder.decode(latents, frames="last")
        else:
            pixels = self.engine.vae.decode(latents, frames="last")
        return to_uint8(pixels[:, :, -1].float().permute(0, 2, 3, 1).cpu().numpy())


def load_engine(checkpoint: Path, decoder: str, vae_dtype: str, device: str):
    from cosmos3_gym.engine import Cosmos3Engine
    from cosmos3_gym.tasks.pusht.env import fast_pusht_engine

    if vae_dtype == "env":
        return fast_pusht_engine(checkpoint, device, decoder=decoder)
    return Cosmos3Engine.from_pretrained(checkpoint, device=device, decoder=decoder, progress=False,
                                         vae_dtype=getattr(torch, vae_dtype))


def settings_for(args) -> tuple[Path, dict[str, Any], tuple[int, int]]:
    """The checkpoint, the env's request fields and the frame size, for ``--assets`` / ``--checkpoint``."""
    from cosmos3_gym.checkpoint import checkpoint_defaults
    from cosmos3_gym.envs.settings import WorldModelSettings, split_settings
    from cosmos3_gym.tasks.pusht.env import FALLBACK_SETTINGS, load_pusht_assets, pusht_env_defaults

    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
        defaults = {**FALLBACK_SETTINGS, "chunk": 8, "raw_action_dim": 2, **checkpoint_defaults(checkpoint)}
        image_size = tuple(args.image_size or defaults.get("image_size") or (64, 64))
    else:
        assets = load_pusht_assets(args.assets)
        checkpoint, defaults = assets.checkpoint, pusht_env_defaults(assets)
        image_size = tuple(args.image_size or assets.meta.get("image_size", (256, 256)))
    settings = WorldModelSettings(**split_settings(dict(defaults)))
    return checkpoint, settings.request_fields(), (int(image_size[0]), int(image_size[1]))


def run_decoder(handover: HandOver, states: dict[str, Any], rounds: int, device: str, clip: bool) -> dict[str, Any]:
    original = states["frames"]
    first = measure(original, device)
    frames, per_round, times = original, [], []
    for n in range(1, rounds + 1):
        started = time.perf_counter()
        previous = frames
        frames = handover.decode(handover.encode(frames))
        times.append(time.perf_counter() - started)
        measured = measure(frames, device)
        per_round.append({
            "round": n,
            "against_original_fit": errors_against(measured, first["pose"], first["agent"]),
            "against_simulator": errors_against(measured, states["pose"], states["agent"]),
            "rigidity": summary(measured["rigidity"], UNIT),
            "psnr_vs_original_db": summary(psnr(frames, original)),
            "psnr_vs_previous_round_db": summary(psnr(frames, previous)),
            "block_lost": int(np.isnan(measured["pose"][:, 0]).sum()),
            "agent_lost": int(np.isnan(measured["agent"][:, 0]).sum()),
        })
    result: dict[str, Any] = {"rounds": per_round, "seconds_per_round": float(np.mean(times))}
    if clip:
        last = handover.decode(handover.encode_clips(states["clips"]))
        truth = measure(states["clips"][:, -1], device)
        measured = measure(last, device)
        result["chunk_last_frame"] = {
            "against_simulator": errors_against(measured, states["clip_pose"], states["clip_agent"]),
            "against_fit_on_real_last_frame": errors_against(measured, truth["pose"], truth["agent"]),
            "psnr_vs_real_last_frame_db": summary(psnr(last, states["clips"][:, -1])),
            "rigidity": summary(measured["rigidity"], UNIT),
        }
    return result


def compact(results: dict[str, Any]) -> list[str]:
    """A few lines: per decoder and round, the mean block / angle / agent errors against the original fit."""
    lines = []
    for name, entry in results["decoders"].items():
        for row in entry["rounds"]:
            e = row["against_original_fit"]
            t = row["against_simulator"]
            lines.append(
                f"{name:>14s} round {row['round']}: vs original fit block {e['block_position_px']['mean']:.2f} px "
                f"[{e['block_position_px'].get('low', float('nan')):.2f}, "
                f"{e['block_position_px'].get('high', float('nan')):.2f}], angle {e['block_angle_deg']['mean']:.2f} "
                f"deg, agent {e['agent_px']['mean']:.2f} px | vs simulator block {t['block_position_px']['mean']:.2f} "
                f"px, angle {t['block_angle_deg']['mean']:.2f} deg, agent {t['agent_px']['mean']:.2f} px | PSNR "
                f"{row['psnr_vs_original_db']['mean']:.1f} dB, lost {row['block_lost']}/{row['agent_lost']}")
        if "chunk_last_frame" in entry:
            c = entry["chunk_last_frame"]["against_simulator"]
            lines.append(f"{name:>14s} chunk's last frame vs simulator: block {c['block_position_px']['mean']:.2f} px, "
                         f"angle {c['block_angle_deg']['mean']:.2f} deg, agent {c['agent_px']['mean']:.2f} px")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the installed built-in one)")
    parser.add_argument("--checkpoint", default=None,
                        help="a checkpoint folder instead of --assets (e.g. the tiny test checkpoint), with the "
                             "PushT env's fallback settings under its own meta.json")
    parser.add_argument("--image-size", type=int, nargs=2, default=None,
                        help="frame size H W (default: the model's image_size; 64 64 for a checkpoint without one)")
    parser.add_argument("--states", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--push-steps", type=int, default=40,
                        help="each state: the scripted pusher runs a seeded number of steps in [0, this] after reset")
    parser.add_argument("--first-seed", type=int, default=None,
                        help="first gym-pusht reset seed (default: the manifest's measurements range, seed_block)")
    parser.add_argument("--decoders", default=",".join(DECODERS), help="comma-separated, of vae,light")
    parser.add_argument("--vae-dtype", choices=("env", "float32", "bfloat16"), default="env",
                        help="env: each engine as the PushT env loads it (fast_pusht_engine)")
    parser.add_argument("--chunk-clip", action=argparse.BooleanOptionalAction, default=True,
                        help="also hand over the last frame of a real chunk + 1 frame clip once")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_output_arguments(parser)
    parser.add_argument("--results-name", default=RESULTS_NAME)
    args = parser.parse_args(argv)
    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    if not decoders or set(decoders) - set(DECODERS):
        parser.error(f"--decoders: expected some of {list(DECODERS)}, got {args.decoders!r}")
    for name in ("states", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected an integer >= 1")
    if args.push_steps < 0:
        parser.error("--push-steps: expected an integer >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    check_results_target(args.results_name, args.out, args.overwrite, topic=TOPIC)

    from cosmos3_gym.tasks.pusht.policy_pools import load_policy_pools

    if args.first_seed is None:
        seeds = load_policy_pools(check_files=False).seed_block("measurements", args.states)
    else:
        seeds = range(args.first_seed, args.first_seed + args.states)
    checkpoint, fields, image_size = settings_for(args)
    started = time.perf_counter()
    states = simulate_states(seeds, image_size, args.push_steps, int(fields["chunk"]), args.chunk_clip)
    simulate_s = time.perf_counter() - started
    floor = measure(states["frames"], args.device)

    results: dict[str, Any] = {
        "provenance": provenance(["benchmarks/recipes/handover_roundtrip.py", *(argv or sys.argv[1:])]),
        "checkpoint": str(checkpoint), "image_size": list(image_size), "states": args.states,
        "sim_seeds": [seeds[0], seeds[-1]], "push_steps": states["steps"].tolist(), "rounds": args.rounds,
        "vae_dtype": args.vae_dtype, "request": {k: v for k, v in fields.items() if isinstance(v, (int, float, str))},
        "fit_floor": {"against_simulator": errors_against(floor, states["pose"], states["agent"]),
                      "rigidity": summary(floor["rigidity"], UNIT)},
        "units": "block position: distance of the fitted T's area centroid, table px (of 512); angle: deg; agent: px; "
                 "means with 95 % t intervals over the states where the part was found (missing: where not)",
        "decoders": {},
        "timings": {"simulate_s": simulate_s},
    }
    for decoder in decoders:
        started = time.perf_counter()
        engine = load_engine(checkpoint, decoder, args.vae_dtype, args.device)
        try:
            entry = run_decoder(HandOver(engine, fields, decoder), states, args.rounds, args.device, args.chunk_clip)
            entry["vae_dtype"] = str(next(engine.vae.parameters()).dtype).removeprefix("torch.")
            results["decoders"][decoder] = entry
        finally:
            engine.close()
        results["timings"][f"{decoder}_s"] = time.perf_counter() - started
    one = {name: entry["rounds"][0]["against_original_fit"]["block_position_px"]["mean"]
           for name, entry in results["decoders"].items()}
    results["one_round_block_px"] = one
    results["question"] = (f"does one round trip move the block by {ONE_ROUND_QUESTION_PX[0]:g}-"
                           f"{ONE_ROUND_QUESTION_PX[1]:g} px (fidelity.md)? mean per decoder: "
                           + ", ".join(f"{k} {v:.2f} px" for k, v in one.items()))
    print("\n".join(compact(results)))
    print(results["question"])
    write_results(results, args.results_name, args.out, args.overwrite, topic=TOPIC, inputs=[checkpoint])
    return results


if __name__ == "__main__":
    main()
