"""Train a PPO agent (Stable-Baselines3, MultiInputPolicy) inside the Cosmos3 world model, then evaluate it.

    python examples/train_ppo_in_world_model.py                 # tiny RANDOM-weight checkpoint on CPU, a minute
    python examples/train_ppo_in_world_model.py --checkpoint pusht --num-envs 2 --total-timesteps 16  # built-in
    python examples/train_ppo_in_world_model.py --checkpoint CKPT --goal goal.png --num-envs 16 \\
        --chunk 32 --num-steps 4 --total-timesteps 20000 --device cuda

The world model is the simulator: each env step sends one action chunk through forward dynamics for all slots in
one batched model call (``WorldModelVectorEnv``). SB3 needs its own VecEnv API and resets finished envs within the
step, so the vector env runs with ``SAME_STEP`` autoreset under ``SB3VecEnv``. The reward is how close each chunk's
last frame is to a goal image (an episode succeeds and ends when it reaches ``--success-threshold``); the default
goal is the start image itself, a stand-in for your own ``--goal``. With ``--checkpoint pusht`` the built-in PushT
model brings its own reward model (coverage of the target), success threshold, start frames and settings. The policy
sees the image downscaled to ``--observation-size`` (SB3's NatureCNN); the model keeps its own resolution.

The trained policy is saved as safetensors (``cosmos3_gym.agents.save_sb3_policy``, no pickle), ready for
``cosmos3-gym eval --policy file:OUT --observation-size N`` and ``cosmos3-gym eval-real --policies file:OUT``.
"""

import argparse
from pathlib import Path

from gymnasium.vector import AutoresetMode
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import VecMonitor

from cosmos3_gym.agents import save_sb3_policy
from cosmos3_gym.envs import SB3VecEnv, WorldModelVectorEnv, make_world_model_vector_env
from cosmos3_gym.evaluation import evaluate_policy
from cosmos3_gym.testing import cached_tiny_checkpoint

ASSETS = Path(__file__).resolve().parent / "assets"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="'pusht' (the built-in PushT model) or a checkpoint folder "
                        "(default: the tiny random-weight checkpoint, cached)")
    parser.add_argument("--initial-states", default=str(ASSETS / "tabletop.png"), help="image / video / folder")
    parser.add_argument("--task", default="push the T-shaped block onto the target")
    parser.add_argument("--domain", default="pusht", help="embodiment (not for pusht: the checkpoint's)")
    parser.add_argument("--goal", default=str(ASSETS / "tabletop.png"), help="goal image of the reward model")
    parser.add_argument("--success-threshold", type=float, default=0.9, help="the episode ends when the score does")
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--max-episode-steps", type=int, default=4, help="action chunks per episode")
    parser.add_argument("--total-timesteps", type=int, default=64, help="env steps (chunks) over all envs")
    parser.add_argument("--n-steps", type=int, default=8, help="steps per env between PPO updates")
    parser.add_argument("--chunk", type=int, default=4, help="actions per env step (not for pusht: the checkpoint's)")
    parser.add_argument("--num-steps", type=int, default=2, help="denoising steps per env step")
    parser.add_argument("--resolution-tier", type=int, default=256, help="canvas tier (not for pusht)")
    parser.add_argument("--observation-size", type=int, default=64, help="the policy's image size (square)")
    parser.add_argument("--eval-episodes", type=int, default=4)
    parser.add_argument("--device", default=None, help="the world model's device (default: cuda if available)")
    parser.add_argument("--policy-device", default="auto", help="the PPO networks' device")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/ppo_world_model.safetensors",
                        help="where the trained policy is saved (safetensors, save_sb3_policy)")
    args = parser.parse_args(argv)

    common = dict(max_episode_steps=args.max_episode_steps, num_steps=args.num_steps,
                  observation_size=(args.observation_size, args.observation_size),
                  autoreset_mode=AutoresetMode.SAME_STEP, device=args.device)
    if args.checkpoint in ("pusht", "builtin:pusht"):  # its reward model, threshold, start frames and settings
        env = make_world_model_vector_env(args.num_envs, checkpoint=args.checkpoint, **common)
    else:
        env = WorldModelVectorEnv(
            args.num_envs, args.checkpoint or cached_tiny_checkpoint(), initial_states=args.initial_states,
            task=args.task, domain=args.domain, reward_model=f"goal_image:{args.goal}",
            success_threshold=args.success_threshold, chunk=args.chunk, resolution_tier=args.resolution_tier,
            **common,
        )
    vec_env = VecMonitor(SB3VecEnv(env))  # VecMonitor: episode returns and lengths in SB3's logs
    vec_env.seed(args.seed)
    model = PPO("MultiInputPolicy", vec_env, n_steps=args.n_steps, batch_size=args.n_steps * args.num_envs,
                n_epochs=4, seed=args.seed, device=args.policy_device, verbose=1)
    model.learn(total_timesteps=args.total_timesteps)
    path = save_sb3_policy(model, args.out, trained_in="world_model", checkpoint=str(args.checkpoint or "tiny"))
    print(f"saved the policy to {path}")

    pusht = args.checkpoint in ("pusht", "builtin:pusht")  # its classifier reward scores coverage in [0, 1]
    report = evaluate_policy(env, model, args.eval_episodes, seed=args.seed + 1000,  # fresh initial noise
                             reward_bounds=(0.0, 1.0) if pusht else None)
    print(report.table())
    vec_env.close()


if __name__ == "__main__":
    main()
