"""Can the light decoder learn to render whole-episode encodings? A CPU probe for issue 42 item 2.

    python benchmarks/recipes/light_decoder_long_clips_probe.py --seconds 720 --work /tmp/ld_long --out /tmp/probe
    python benchmarks/recipes/long_encoding_roundtrip.py --light-decoder /tmp/ld_long/light_decoder \\
        --results-name long_encoding_roundtrip_cpu_light_decoder_finetuned_cpu.json

Simulates ``--episodes`` new PushT episodes (dataset seed 101, the policy-pool manifest's unused dataset seeds),
encodes them both ways the world model can train on (``build_decoder_windows``: ``handover="latent"`` windows cut
from whole-episode encodings, every 4 frames, and ``"pixels"`` windows encoded on their own, every 8), and fine-tunes
the built-in model's light decoder on both for ``--seconds`` (its own training settings, batch 8, lr 2e-4) into
``--work``/light_decoder. ``long_encoding_roundtrip.py --light-decoder`` then measures it. Not a product: the shipped
light decoder is unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent)]  # the repository, benchmarks/

from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym.engine import Cosmos3Engine  # noqa: E402
from cosmos3_gym.models.light_decoder import LightDecoder  # noqa: E402
from cosmos3_gym.tasks.pusht.dataset import generate_pusht_dataset  # noqa: E402
from cosmos3_gym.training.light_decoder import (  # noqa: E402
    DecoderWindows,
    LightDecoderTrainConfig,
    build_decoder_windows,
    train_light_decoder,
)

CHECKPOINT = Path("cosmos3_gym/tasks/pusht/assets/checkpoint")
RESULTS_NAME = "light_decoder_long_clips_probe_cpu.json"
KEPT = ("l1_weight", "gradient_weight", "contrast_weight", "last_frame_weight", "weight_decay", "betas", "grad_clip",
        "lr_schedule", "min_lr_ratio", "latent_noise", "seed", "log_every")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--work", default="/tmp/ld_long")
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=720.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    check_results_target(RESULTS_NAME, args.out, args.overwrite, topic="fidelity")
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    data = work / "data"
    generate_pusht_dataset(data, args.episodes, steps_per_episode=64, seed=101, workers=args.threads,
                           action_stats=str(CHECKPOINT / "action_stats.json"), progress=False)
    engine = Cosmos3Engine.from_pretrained(CHECKPOINT, device="cpu", dtype="fp32", decoder="light", progress=False)
    latent = build_decoder_windows(data, engine.vae, chunk=8, stride=4, handover="latent", progress=False)
    pixels = build_decoder_windows(data, engine.vae, chunk=8, stride=8, handover="pixels", progress=False)
    windows = DecoderWindows(torch.cat([latent.latents, pixels.latents]), torch.cat([latent.frames, pixels.frames]))
    init = LightDecoder.from_pretrained(CHECKPOINT / "light_decoder")
    shipped = json.loads((CHECKPOINT / "light_decoder" / "train_config.json").read_text())["config"]
    config = LightDecoderTrainConfig(
        decoder=init.config, **{key: shipped[key] for key in KEPT if key in shipped}, steps=100_000,
        seconds=args.seconds, batch_size=8, lr=2e-4, warmup_steps=20, device="cpu", progress=False,
    )
    train_light_decoder(windows, work / "light_decoder", config, init=init)
    log = [json.loads(line) for line in (work / "light_decoder" / "train_log.jsonl").read_text().splitlines()]
    results = {
        "provenance": provenance(sys.argv),
        "what": "the shipped light decoder fine-tuned on whole-episode and window encodings (measure it with "
        "long_encoding_roundtrip.py --light-decoder)",
        "light_decoder": str(work / "light_decoder"),
        "whole_episode_samples": len(latent),
        "window_samples": len(pixels),
        "steps": log[-1]["step"] if log else 0,
        "loss": [(entry["step"], entry["loss"]) for entry in log],
    }
    write_results(results, RESULTS_NAME, args.out, args.overwrite, topic="fidelity", inputs=[work / "light_decoder"])
    print(f"{len(latent)} whole-episode and {len(pixels)} window samples; wrote {work / 'light_decoder'}")


if __name__ == "__main__":
    main()
