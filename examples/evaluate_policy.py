"""Evaluate the checkpoint's own policy (PolicyAgent) against a random baseline inside the Cosmos3 world model.

    python examples/evaluate_policy.py                       # tiny RANDOM-weight checkpoint on CPU, a few seconds
    python examples/evaluate_policy.py --checkpoint CKPT --goal goal.png --episodes 100 --num-envs 16 --device cuda

Both policies run on the same env and the same seed, so they start from the same initial states. The reward is
how close each chunk's last frame is to a goal image (``goal_image`` reward model); the default goal is the start
image itself, a stand-in: pass your own with ``--goal``. An episode succeeds when the score reaches
``--success-threshold``. The table shows success rate (Wilson 95% interval) and mean return (Student-t 95%
interval) per task; report.json and episode videos go to ``--out/<policy>/``.
"""

import argparse
from pathlib import Path

from cosmos3_gym.envs import WorldModelVectorEnv
from cosmos3_gym.evaluation import evaluate_policy, load_policy
from cosmos3_gym.testing import cached_tiny_checkpoint

ASSETS = Path(__file__).resolve().parent / "assets"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="default: the tiny random-weight checkpoint (cached)")
    parser.add_argument("--initial-states", default=str(ASSETS / "tabletop.png"), help="image / video / folder")
    parser.add_argument("--task", default="push the T-shaped block onto the target")
    parser.add_argument("--domain", default="pusht")
    parser.add_argument("--goal", default=str(ASSETS / "tabletop.png"), help="goal image of the reward model")
    parser.add_argument("--success-threshold", type=float, default=0.9)
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument("--max-episode-steps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=2)
    parser.add_argument("--resolution-tier", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="evaluate_policy_out")
    args = parser.parse_args(argv)

    env = WorldModelVectorEnv(
        args.num_envs, args.checkpoint or cached_tiny_checkpoint(), initial_states=args.initial_states,
        task=args.task, domain=args.domain, reward_model=f"goal_image:{args.goal}",
        success_threshold=args.success_threshold, max_episode_steps=args.max_episode_steps, chunk=args.chunk,
        num_steps=args.num_steps, resolution_tier=args.resolution_tier, return_frames=True, device=args.device,
    )
    for name in ("agent", "random"):
        policy = load_policy(name, env, seed=0)  # "agent": a PolicyAgent on the env's engine and settings
        report = evaluate_policy(env, policy, args.episodes, seed=0, video_dir=Path(args.out) / name, max_videos=2)
        report.to_json(Path(args.out) / name / "report.json")
        print(f"\n== {name} ==\n{report.table()}")
    env.close()


if __name__ == "__main__":
    main()
