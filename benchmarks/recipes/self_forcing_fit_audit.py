"""How well a rigid T explains the built-in model's own frames, chunk by chunk: the diagnosis of issue 42 item 3.

Self-forcing (``cosmos3_gym.tasks.pusht.self_forcing``) reads the state off each frame the model generates by fitting
a rigid T. Where the model's T is melted, the fit can sit far from what the frame shows, and the sample then teaches
the block to jump between its first two frames. This runs the same sample generation on the CPU, at a small scale,
with the built-in model (its env, light decoder and hand-over) and reports the fitted T's rigidity (IoU of the block's
pixels and the fitted T) of every generated frame per chunk: the share of samples a stricter
``--wm-self-forcing-min-rigidity`` would keep.

    python benchmarks/recipes/self_forcing_fit_audit.py --out /tmp/bench   # 2 CPU cores: about 3 minutes

Source episodes: ``generate_pusht_dataset`` dataset seed 102 (the policy-pool manifest's training data; the
families of round 9's mix without its policy files). Writes ``self_forcing_fit_audit_cpu.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent)]  # the repository, benchmarks/

from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym.processor import ActionStats  # noqa: E402
from cosmos3_gym.tasks.pusht.dataset import generate_pusht_dataset  # noqa: E402
from cosmos3_gym.tasks.pusht.env import load_pusht_assets, make_pusht_vector_env, pusht_env_defaults  # noqa: E402
from cosmos3_gym.tasks.pusht.self_forcing import generate_self_forcing_episodes  # noqa: E402

RESULTS_NAME = "self_forcing_fit_audit_cpu.json"
MIX = {"scripted_random_goal": 0.4, "scripted": 0.2, "random": 0.15, "replay": 0.1, "uniform": 0.15}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--episodes", type=int, default=16, help="simulated source episodes (128 actions each)")
    parser.add_argument("--rollouts", type=int, default=2, help="rollouts per episode")
    parser.add_argument("--depth", type=int, default=10, help="chunks per rollout")
    parser.add_argument("--envs", type=int, default=16, help="env slots the rollouts run in")
    parser.add_argument("--seed", type=int, default=102, help="dataset seed of the source episodes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results-name", default=RESULTS_NAME)
    args = parser.parse_args(argv)
    command = provenance(["benchmarks/recipes/self_forcing_fit_audit.py", *(sys.argv[1:] if argv is None else argv)])
    check_results_target(args.results_name, args.out, args.overwrite, topic="fidelity")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="self_forcing_audit_"))
    source = generate_pusht_dataset(work / "source", args.episodes, steps_per_episode=128, policy_mix=MIX,
                                    seed=args.seed, workers=args.threads, progress=False)
    assets = load_pusht_assets()
    stats = ActionStats.from_json(pusht_env_defaults(assets)["action_stats"],
                                  mode=assets.meta.get("action_normalization", "minmax"))
    envs = make_pusht_vector_env(args.envs, return_frames=True, reward_model=None, success_threshold=None,
                                 max_episode_steps=None, num_threads=args.threads)
    try:
        report = generate_self_forcing_episodes(work / "samples", source, envs, stats=stats,
                                                rollouts_per_episode=args.rollouts, depth=args.depth, seed=args.seed,
                                                workers=1, progress=True)
    finally:
        envs.close()
    results = {"provenance": command, "settings": vars(args), "policy_mix": MIX, "report": report,
               "seconds": round(time.perf_counter() - started, 1)}
    print("chunk  frames  rigidity p10 / median / p90  share >= 0.9")
    for depth, row in report["fit_rigidity_by_depth"].items():
        print(f"{depth:>5}  {row['frames']:>6}  {row['p10']:.3f} / {row['median']:.3f} / {row['p90']:.3f}"
              f"  {row['at_least_0.9']:.2f}")
    write_results(results, args.results_name, args.out, args.overwrite, topic="fidelity",
                  inputs=[str(assets.checkpoint)])
    return results


if __name__ == "__main__":
    main()
