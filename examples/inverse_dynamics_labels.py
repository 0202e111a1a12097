"""Label a video with the actions that produced it, using Cosmos3's inverse dynamics (InverseDynamicsAgent).

    python examples/inverse_dynamics_labels.py --video clip.mp4 --checkpoint CKPT --domain pusht --out labels.json
    python examples/inverse_dynamics_labels.py        # tiny RANDOM-weight checkpoint; generates its own video

``label_video`` cuts the video into windows of ``chunk + 1`` frames and labels every transition, all windows in one
batched model call (``--window-batch`` to split). The labels are in the model's normalised action space, [-1, 1],
written as ``{"shape": [T - 1, D], "dtype": "float32", "data": [...]}`` (the format ``cosmos3-gym infer
--action-file`` reads). Without ``--video`` the script first generates one with the world model from random
actions; the commanded actions are then known, so it also prints how far the labels are from them.
"""

import argparse
from pathlib import Path

import numpy as np

from cosmos3_gym.agents import InverseDynamicsAgent, action_errors
from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.envs import WorldModelEnv
from cosmos3_gym.media import write_video
from cosmos3_gym.processor import save_action_file
from cosmos3_gym.testing import cached_tiny_checkpoint

ASSETS = Path(__file__).resolve().parent / "assets"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="default: the tiny random-weight checkpoint (cached)")
    parser.add_argument("--video", default=None, help="video to label (default: generate one)")
    parser.add_argument("--initial-states", default=str(ASSETS / "tabletop.png"), help="start of a generated video")
    parser.add_argument("--generate-steps", type=int, default=2, help="chunks in a generated video")
    parser.add_argument("--task", default="push the T-shaped block onto the target")
    parser.add_argument("--domain", default="pusht")
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=2)
    parser.add_argument("--resolution-tier", type=int, default=256)
    parser.add_argument("--fps", type=float, default=15.0)
    parser.add_argument("--window-batch", type=int, default=None, help="windows per model call (default: all)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="inverse_dynamics_labels.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = dict(domain=args.domain, chunk=args.chunk, num_steps=args.num_steps,
                    resolution_tier=args.resolution_tier, fps=args.fps)
    checkpoint = args.checkpoint or cached_tiny_checkpoint()
    engine = Cosmos3Engine.from_pretrained(checkpoint, device=args.device, progress=False)

    video, commanded = args.video, None
    if video is None:  # roll the world model forward with random actions and keep the frames
        env = WorldModelEnv(engine=engine, initial_states=args.initial_states, task=args.task, return_frames=True,
                            **settings)
        observation, _ = env.reset(seed=args.seed)
        env.action_space.seed(args.seed)
        frames, commanded = [observation["image"][None]], []
        for _ in range(args.generate_steps):
            action = env.action_space.sample()
            _, _, _, _, info = env.step(action)
            frames.append(info["frames"])
            commanded.append(action)
        video = write_video(out.with_suffix(".mp4"), np.concatenate(frames), fps=args.fps)
        commanded = np.concatenate(commanded)
        print(f"generated {video} from {len(commanded)} random actions")

    agent = InverseDynamicsAgent(engine, args.task, seed=args.seed, **settings)
    labels = agent.label_video(video, batch_size=args.window_batch)  # [frames - 1, raw_action_dim]
    save_action_file(out, labels)
    print(f"wrote {labels.shape[0]} actions of {labels.shape[1]} dims to {out}")
    if commanded is not None:
        errors = action_errors(labels, commanded)
        print(f"labels vs commanded actions: mse {errors['mse']:.4f}, mae {errors['mae']:.4f}")
    engine.close()


if __name__ == "__main__":
    main()
