"""Observation preprocessing on the CPU: ``processor.prepare_conditioning`` against diffusers' ``VideoProcessor`` path
it replaces for frames whose size is a multiple of 16 (bit-identical output, checked here too).

    python benchmarks/preprocess_cpu.py --out $OUT

Cases: one 480x832 frame (a policy request at tier 480) and a 129-frame 256x256 episode (what the training code
prepares before encoding an episode's latents).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_output_arguments, check_results_target, provenance, timed, write_results  # noqa: E402

from cosmos3_gym import processor  # noqa: E402

CASES = {"request_480x832": (1, 480, 832, 480), "episode_129x256x256": (129, 256, 256, 256)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    add_output_arguments(parser)
    args = parser.parse_args()
    check_results_target("preprocess_cpu.json", args.out, args.overwrite)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {"provenance": provenance(), "threads": torch.get_num_threads()}
    rng = np.random.default_rng(0)
    for name, (num_frames, height, width, tier) in CASES.items():
        frames = rng.integers(0, 256, (num_frames, height, width, 3)).astype(np.float32) / 255.0
        ours, _ = timed(lambda: processor.prepare_conditioning(frames, tier, num_frames), repeats=5)
        reference, _ = timed(lambda: processor._VIDEO_PROCESSOR.preprocess_video(
            processor._video_processor_input(frames)), repeats=5)
        same = torch.equal(processor.prepare_conditioning(frames, tier, num_frames).pixels,
                           processor._VIDEO_PROCESSOR.preprocess_video(processor._video_processor_input(frames)))
        results[name] = {"prepare_conditioning_s": ours, "diffusers_video_processor_s": reference,
                         "speedup": reference / ours, "bit_identical": same}
        print(name, results[name], flush=True)
    write_results(results, "preprocess_cpu.json", args.out, args.overwrite)


if __name__ == "__main__":
    main()
