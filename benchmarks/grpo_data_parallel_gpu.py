"""The GRPO loop inside the PushT world model on one or several GPUs of a host (issue 44 item 3): one env and one
engine per rank, each rank's groups played and scored where they are, gradients all-reduced over the whole minibatch
(``cosmos3_gym.rl.grpo``'s data-parallel replicas).

    python benchmarks/grpo_data_parallel_gpu.py --out $OUT                                  # one GPU
    torchrun --nproc_per_node=2 benchmarks/grpo_data_parallel_gpu.py --out $OUT             # two GPUs, same run
    torchrun --nproc_per_node=2 benchmarks/grpo_data_parallel_gpu.py --tiny --out /tmp/x    # CPU dry run, gloo

Each rank: ``make_pusht_vector_env(--envs-per-rank)`` with the built-in model on its GPU (cuda:LOCAL_RANK), the
committed GRPO runs' env settings (geometric reward, success at 0.95, episodes of ``--horizon`` chunks, 96 x 96
observations, groups of ``--group-size`` slots) and the model's built-in start states; the policy is ``--policy``
(default the committed BC + DAgger policy) and GRPO runs with the committed recipe's update settings, without the
gym-pusht guard (its replay processes would share the host's cores between the ranks; ``rl_pusht.py`` measures the
loop with it). ``--tiny``: the tiny random checkpoint on the CPU, a fresh small policy, no reward model.

Reports, for the iterations from ``--skip`` on (the first ones compile and capture graphs): env steps per second of
the whole loop (rollout and update; all ranks' env steps over the slowest rank's time, as the logged iteration
records give them) and of the env steps alone. Rank 0 writes ``grpo_data_parallel_world<N>[_tiny].json`` (card,
commit, command) with every iteration's record.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from common import add_output_arguments, check_results_target, write_results  # noqa: E402

from cosmos3_gym.rl.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig, load_policy_file  # noqa: E402
from cosmos3_gym.training.distributed import init_distributed  # noqa: E402

DEFAULT_POLICY = REPO / "benchmarks" / "results" / "rl" / "policies" / "rl_pusht_bc_dagger.safetensors"
OBSERVATION = (96, 96)


def make_env(args, device: torch.device):
    common = dict(group_size=args.group_size, max_episode_steps=args.horizon, observation_size=OBSERVATION,
                  device=str(device))
    if args.tiny:
        from cosmos3_gym.envs.vector_env import WorldModelVectorEnv
        from cosmos3_gym.testing import cached_tiny_checkpoint

        starts = [np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8) for i in range(4)]
        return WorldModelVectorEnv(args.envs_per_rank, checkpoint=cached_tiny_checkpoint(), domain="pusht",
                                   raw_action_dim=2, chunk=8, num_steps=1, guidance_scale=1.0, resolution_tier=256,
                                   fps=10.0, initial_states=starts, reward_model=None, **common)
    from cosmos3_gym.tasks.pusht.env import make_pusht_vector_env

    return make_pusht_vector_env(args.envs_per_rank, reward_model="pusht_geometric", success_threshold=0.95, **common)


def make_policy(args, device: torch.device) -> PixelGaussianPolicy:
    if args.tiny:
        torch.manual_seed(0)
        return PixelGaussianPolicy(PolicyConfig(chunk=8, channels=(4, 4, 4, 4), hidden=16)).to(device)
    policy = load_policy_file(args.policy, device=device)
    with torch.no_grad():
        policy.log_std.fill_(args.initial_log_std)
    return policy


def steady_rates(history: list[dict], skip: int) -> dict[str, float]:
    steady = history[skip:] or history
    env_steps = sum(r["env_steps"] for r in steady)
    loop_s = sum(r["rollout_s"] + r["update_s"] for r in steady)
    return {"iterations": len(steady), "env_steps": env_steps, "loop_s": loop_s,
            "loop_env_steps_per_s": env_steps / loop_s, "env_only_env_steps_per_s": env_steps / sum(
                r["env_s"] for r in steady)}


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs-per-rank", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--horizon", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="iterations left out of the rates (compile, capture)")
    parser.add_argument("--policy", default=str(DEFAULT_POLICY))
    parser.add_argument("--initial-log-std", type=float, default=-3.5)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: the tiny random checkpoint, gloo")
    parser.add_argument("--results-name", default=None)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    ctx = init_distributed("cpu" if args.tiny else "cuda")
    name = args.results_name or f"grpo_data_parallel_world{ctx.world_size}{'_tiny' if args.tiny else ''}.json"
    if ctx.is_main:
        check_results_target(name, args.out, args.overwrite)
    env = make_env(args, ctx.device)
    try:
        config = GRPOConfig(iterations=args.iterations, group_size=args.group_size, horizon=args.horizon,
                            learning_rate=1e-5, update_epochs=2, minibatch_size=256, kl_coef=0.05,
                            coverage_weight=10.0, advantage_normalization="group", guard_every=0,
                            seed=0)
        trainer = GRPOTrainer(make_policy(args, ctx.device), env, config)
        started = time.perf_counter()
        history = trainer.train(progress=False)
        train_s = time.perf_counter() - started
    finally:
        env.close()
    results = None
    if ctx.is_main:
        results = {"world_size": ctx.world_size, "envs_per_rank": args.envs_per_rank, "tiny": args.tiny,
                   "group_size": args.group_size, "horizon": args.horizon, "config": vars(args) | {"out": None},
                   "train_s": train_s, "steady": steady_rates(history, args.skip), "history": history}
        write_results(results, name, args.out, args.overwrite, topic="rl")
        steady = results["steady"]
        print(f"{ctx.world_size} rank(s) x {args.envs_per_rank} envs: loop {steady['loop_env_steps_per_s']:.0f} env "
              f"steps/s, env alone {steady['env_only_env_steps_per_s']:.0f} ({steady['iterations']} iterations)",
              flush=True)
    ctx.close()
    return results


if __name__ == "__main__":
    main()
