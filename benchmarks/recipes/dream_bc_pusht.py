"""Imagined successes as training data (issue 45 item 4): behaviour cloning on the real PushT demonstrations plus
the reward-filtered imagined successes of a stronger policy, against behaviour cloning on the real demonstrations
alone, at the same number of gradient steps, both measured in the real simulator (gym-pusht) on held-out seeds with
the paired difference.

    python benchmarks/recipes/dream_bc_pusht.py --smoke --out /tmp/dream_bc        # CPU, under a minute: the pipeline
    python benchmarks/recipes/dream_bc_pusht.py --out $OUT --device cuda           # one GPU + 16 cores, all stages
                                                                                   # (or in two calls: below)

Stages (``--stages``, comma-separated, in this order; a later call continues from ``--work``):

1. ``demos``: ``--demo-episodes`` scripted-pusher demonstrations in gym-pusht (``tasks.pusht.demos``; reset seeds
   ``--demo-seed``.., in the policy-pool manifest's training range): 96 x 96 observations and the next 8 normalised
   actions of every ``--demo-stride``-th step.
2. ``dream``: the stronger policy (``--teacher``, any policy spec; default the GRPO policy of
   benchmarks/results/rl/policies, 54 % real success on 1000 held-out seeds) rolled in the PushT world model
   (``cosmos3_gym/PushT-v0``, ``--dream-envs`` slots, ``--dream-chunks`` chunks per episode, from the model's own
   start frames) for ``--dream-episodes`` episodes by ``cosmos3_gym.rl.dream.dream``, which writes them as a LeRobot
   v3.0 dataset (``--work``/dreams). ``--keep successes`` (the default; reward-filtered) keeps the episodes the
   world model's reward model calls successful (its calibrated ``success_threshold``). The dataset is read back with
   ``cosmos3_gym.data.lerobot.LeRobotDataset``: every ``--demo-stride``-th frame, downscaled to 96 x 96 as the env
   observes, with the next 8 actions normalised by the checkpoint's action statistics, becomes a BC sample.
3. ``bc``: two ``PixelGaussianPolicy`` fitted with the same configuration, seed and ``--bc-steps`` gradient steps
   (``rl.bc``): ``real`` on the demonstrations, ``real_plus_dreams`` on the demonstrations and the imagined samples.
4. ``eval``: both (and the teacher) in gym-pusht from held-out reset seeds (default: 1000 of the policy-pool
   manifest's reporting range, which no training and no choice used; ``--eval-seed`` sets another first seed) for
   ``--eval-chunks`` chunks, as benchmarks/rl_pusht.py evaluates
   (``tasks.pusht.replay.evaluate_in_simulator``: success = coverage above 0.95 at some step, where gym-pusht ends
   the episode): success rates with Wilson 95 % CIs, mean final coverage with t 95 % CIs, and the paired
   per-seed difference ``real_plus_dreams - real`` (success and final coverage, t 95 % CIs; the discordant seeds).

Writes ``dream_bc_pusht.json`` (``dream_bc_pusht_smoke.json`` with ``--smoke``) to ``--out`` (default ``$OUT`` or
benchmarks/results/rl) and the two BC policies to ``<out>/policies/`` (under 1 MB each). ``--work`` (default
/tmp/cosmos3_gym_dream_bc) keeps the demonstrations, the dream dataset, the policies and the results between calls.
Device calls of under 10 minutes each. At the defaults on one H200 with 16 cores, estimated from the rates
benchmarks/rl_pusht.py measured there (not yet run): demonstrations ~20 s, dreams ~1-2 min (64 slots, light decoder),
BC 2 x ~1.5 min (4.3 ms a step), gym-pusht evaluation ~105 s per policy for 1000 episodes, 3 policies: about 11
minutes in all, so two calls::

    python benchmarks/recipes/dream_bc_pusht.py --out $OUT --work $OUT/dream_bc_work --stages demos,dream,bc
    # carry that call's dream_bc_work (policies/ and the results JSON, a few MB; not demos.npz or dreams/)
    python benchmarks/recipes/dream_bc_pusht.py --out $OUT --work <the carried folder> --stages eval

Needs gym-pusht (the ``sim`` extra) and imageio-ffmpeg (the LeRobot writer's video encoder). The GPU machines' image
has no imageio-ffmpeg: carry its wheel with the others. Measured there once (session 24, one H200): the demos took
seconds and the dream stage about 3 minutes for 500 episodes before the writer stopped on the missing encoder, so the
full run needs the two calls above.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent)]  # the repository, benchmarks/

from common import add_output_arguments, check_results_target, provenance, results_dir, write_results  # noqa: E402

from cosmos3_gym.rl.bc import BCConfig, train_bc  # noqa: E402
from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig, load_policy_file, save_policy_file  # noqa: E402
from cosmos3_gym.statistics import mean_interval, wilson_interval  # noqa: E402

STAGES = ("demos", "dream", "bc", "eval")
# Seeds from the policy-pool manifest's ranges (cosmos3_gym/tasks/pusht/policy_pools.json): demonstrations are
# training data (training range), the evaluation reports (reporting range, a block no earlier script used).
DEMO_SEED = 1_500_000
EVAL_SEED_OFFSET = 100_000
TEACHER = "benchmarks/results/rl/policies/rl_pusht_grpo_simulator_policy_starts_h4_cw10_400it.safetensors"
POLICIES = ("real", "real_plus_dreams")
OBSERVATION_SIZE = (96, 96)
FULL = dict(demo_episodes=200, demo_max_steps=300, demo_stride=2, dream_episodes=1000, dream_envs=64,
            dream_chunks=38, bc_steps=20000, bc_batch_size=256, eval_episodes=1000, eval_chunks=38, workers=16)
SMOKE = dict(demo_episodes=2, demo_max_steps=16, demo_stride=4, dream_episodes=2, dream_envs=2, dream_chunks=2,
             bc_steps=4, bc_batch_size=8, eval_episodes=3, eval_chunks=2, workers=1)
SMOKE_POLICY = dict(channels=(8, 8), hidden=16)


class Run:
    """What the stages share: the PushT model's facts, ``--work`` and the results so far."""

    def __init__(self, args: argparse.Namespace):
        from cosmos3_gym.processor import ActionStats
        from cosmos3_gym.tasks.pusht.env import load_pusht_assets

        self.args = args
        self.name = "dream_bc_pusht_smoke.json" if args.smoke else "dream_bc_pusht.json"
        check_results_target(self.name, args.out, args.overwrite, topic="rl")  # before any stage runs
        self.out = results_dir(args.out, "rl")
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.policy_dir = self.work / "policies"
        self.results_path = self.work / self.name
        self.results: dict[str, Any] = json.loads(self.results_path.read_text()) if self.results_path.is_file() else {}
        self.results.setdefault("calls", []).append({"command": " ".join(args.argv), "stages": args.stages})
        self.assets = load_pusht_assets(None)
        self.action_stats = ActionStats.from_json(self.assets.checkpoint / "action_stats.json", mode="minmax")
        self.image_size = tuple(self.assets.meta.get("image_size", (256, 256)))
        self.chunk = int(self.assets.meta.get("chunk", 8))

    def policy_path(self, name: str) -> Path:
        return self.policy_dir / f"dream_bc_pusht_{name}.safetensors"

    def existing(self, path: Path, stage: str) -> Path:
        if not path.exists():
            raise SystemExit(f"{path} is missing: run the '{stage}' stage first with the same --work (in another call: "
                             "bring that call's --work folder along).")
        return path

    def save(self) -> None:
        self.results["provenance"] = provenance(self.args.argv)
        self.results["settings"] = {key: value for key, value in vars(self.args).items() if key != "argv"}
        self.results_path.write_text(json.dumps(self.results, indent=2, default=str))
        policies = sorted(self.policy_dir.glob("*.safetensors"))
        write_results(self.results, self.name, str(self.out), self.args.overwrite, topic="rl",
                      inputs=[*policies, *self.teacher_files()])
        if policies:
            (self.out / "policies").mkdir(exist_ok=True)
            for path in policies:
                shutil.copy2(path, self.out / "policies" / path.name)

    def teacher_files(self) -> list[Path]:
        _, _, path = self.args.teacher.partition(":")
        return [Path(path)] if path and Path(path).is_file() else []


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def stage_demos(run: Run) -> None:
    from cosmos3_gym.tasks.pusht.demos import generate_demonstrations

    args = run.args
    started = time.perf_counter()
    demos = generate_demonstrations(
        args.demo_episodes, action_stats=run.action_stats, seed=args.demo_seed, max_steps=args.demo_max_steps,
        stride=args.demo_stride, chunk=run.chunk, image_size=run.image_size, observation_size=OBSERVATION_SIZE,
        noise_levels=(0.0,), workers=args.workers, progress=not args.no_progress)
    np.savez(run.work / "demos.npz", observations=demos["observations"], action_chunks=demos["action_chunks"])
    run.results["demos"] = {
        "episodes": args.demo_episodes, "seeds": [args.demo_seed, args.demo_seed + args.demo_episodes - 1],
        "scripted_success_rate": demos["success_rate"],
        "mean_steps": float(np.mean([e["steps"] for e in demos["episodes"]])),
        "bc_samples": int(len(demos["observations"])), "stride": args.demo_stride,
        "wall_s": time.perf_counter() - started,
    }


def dream_samples(path: Path, stats: Any, chunk: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """BC samples of a dream dataset (read back with this package's LeRobot reader): every ``stride``-th frame at
    the env's observation size and the next ``chunk`` actions, normalised (the last repeated past the end)."""
    from cosmos3_gym.data.initial_states import resize_frame
    from cosmos3_gym.data.lerobot import LeRobotDataset

    dataset = LeRobotDataset(path)
    observations, chunks = [], []
    for i in range(len(dataset)):
        episode = dataset.load(i)
        actions = np.clip(np.asarray(stats.normalize(episode.actions), np.float32), -1.0, 1.0)
        padded = np.concatenate([actions, np.repeat(actions[-1:], chunk, axis=0)])
        for t in range(0, len(actions), stride):
            observations.append(resize_frame(episode.frames[t], OBSERVATION_SIZE))
            chunks.append(padded[t : t + chunk])
    return np.stack(observations), np.stack(chunks).astype(np.float32)


def stage_dream(run: Run) -> None:
    import gymnasium as gym

    import cosmos3_gym  # noqa: F401  (registers the env ids)
    from cosmos3_gym.evaluation import load_policy
    from cosmos3_gym.rl.dream import dream

    args = run.args
    folder = run.work / "dreams"
    shutil.rmtree(folder, ignore_errors=True)  # a stage run again dreams again
    settings: dict[str, Any] = dict(return_frames=True, max_episode_steps=args.dream_chunks, device=args.device)
    if args.dream_num_steps is not None:
        settings["num_steps"] = args.dream_num_steps
    env = gym.make_vec("cosmos3_gym/PushT-v0", num_envs=args.dream_envs, vectorization_mode="vector_entry_point",
                       **settings)
    started = time.perf_counter()
    try:
        teacher = load_policy(args.teacher, env, seed=args.seed)
        result = dream(env, teacher, args.dream_episodes, folder, keep=args.keep, seed=args.seed,
                       max_episode_steps=args.dream_chunks, reward_bounds=(0.0, 1.0),
                       source=f"benchmarks/recipes/dream_bc_pusht.py: {args.teacher}", progress=not args.no_progress)
    finally:
        env.close()
    dream_s = time.perf_counter() - started
    observations, chunks = dream_samples(folder, run.action_stats, run.chunk, args.demo_stride)
    np.savez(run.work / "dream_samples.npz", observations=observations, action_chunks=chunks)
    overall = result.report.overall
    run.results["dreams"] = {
        "teacher": args.teacher, "episodes": overall.episodes, "keep": args.keep,
        "imagined_success_rate": overall.success_rate,
        "imagined_success_rate_wilson95": overall.success_rate_interval,
        "mean_imagined_return": overall.mean_return, "episodes_kept": result.episodes_written,
        "bc_samples": int(len(observations)), "chunks_per_episode": args.dream_chunks, "num_envs": args.dream_envs,
        "num_steps": args.dream_num_steps or "the checkpoint's", "dataset": "LeRobot v3.0 (--work/dreams)",
        "dream_s": dream_s, "convert_s": time.perf_counter() - started - dream_s,
    }


def stage_bc(run: Run) -> None:
    args = run.args
    demos = np.load(run.existing(run.work / "demos.npz", "demos"))
    dreams = np.load(run.existing(run.work / "dream_samples.npz", "dream"))
    datasets = {
        "real": (demos["observations"], demos["action_chunks"]),
        "real_plus_dreams": (np.concatenate([demos["observations"], dreams["observations"]]),
                             np.concatenate([demos["action_chunks"], dreams["action_chunks"]])),
    }
    run.policy_dir.mkdir(parents=True, exist_ok=True)
    run.results["bc"] = {}
    for name, (observations, chunks) in datasets.items():
        torch.manual_seed(args.seed)  # the same initial weights and batches' seed for both
        policy = PixelGaussianPolicy(PolicyConfig(chunk=run.chunk, **(SMOKE_POLICY if args.smoke else {})))
        policy = policy.to(args.device)
        config = BCConfig(steps=args.bc_steps, batch_size=args.bc_batch_size, seed=args.seed)
        started = time.perf_counter()
        losses = train_bc(policy, observations, chunks, config, progress=not args.no_progress)
        train_s = time.perf_counter() - started
        save_policy_file(policy, run.policy_path(name), trained_by=f"benchmarks/recipes/dream_bc_pusht.py ({name})",
                         samples=int(len(chunks)), steps=len(losses))
        every = max(1, len(losses) // 50)
        run.results["bc"][name] = {
            "samples": int(len(chunks)), "steps": len(losses), "final_loss": losses[-1],
            "loss": losses[::every] + [losses[-1]], "config": asdict(config), "train_s": train_s,
        }
    run.results["policies"] = {name: f"benchmarks/results/rl/policies/{run.policy_path(name).name}"
                               for name in POLICIES}


def eval_seeds(args: argparse.Namespace) -> range:
    """``--eval-seed``.. or, by default, a block of the policy-pool manifest's reporting seeds (held out from every
    training and every choice; ``tasks.pusht.policy_pools``), past the 32 the evaluation-pool ranking uses."""
    if args.eval_seed is not None:
        return range(args.eval_seed, args.eval_seed + args.eval_episodes)
    from cosmos3_gym.tasks.pusht.policy_pools import load_policy_pools

    return load_policy_pools(check_files=False).seed_block("reporting", args.eval_episodes, offset=EVAL_SEED_OFFSET)


def evaluate(run: Run, policy: Any) -> dict[str, Any]:
    """One policy in gym-pusht from the held-out seeds, as benchmarks/rl_pusht.py evaluates."""
    from cosmos3_gym.tasks.pusht.replay import evaluate_in_simulator
    from cosmos3_gym.tasks.pusht.sim_vector_env import PushTSimVectorEnv
    from cosmos3_gym.tasks.pusht.starts import DemoStartStates

    args = run.args
    seeds = eval_seeds(args)
    starts = DemoStartStates.from_seeds(seeds, image_size=run.image_size)
    env = PushTSimVectorEnv(args.eval_episodes, starts=starts, action_stats=run.action_stats, group_size=1,
                            chunk=run.chunk, image_size=run.image_size, observation_size=OBSERVATION_SIZE,
                            max_episode_steps=args.eval_chunks, workers=args.workers)
    started = time.perf_counter()
    try:
        episodes = evaluate_in_simulator(policy, env, np.arange(args.eval_episodes), args.eval_chunks)
    finally:
        env.close()
    success, coverage = episodes["success"], episodes["final_coverage"]
    return {
        "episodes": int(len(success)), "eval_seeds": [seeds[0], seeds[-1]],
        "success_rate": float(success.mean()),
        "success_rate_wilson95": list(wilson_interval(int(success.sum()), len(success))),
        "mean_final_coverage": float(coverage.mean()),
        "mean_final_coverage_t95": mean_interval(coverage.tolist(), bounds=(0.0, 1.0)),
        "per_episode_success": success.astype(int).tolist(),
        "per_episode_final_coverage": [round(float(c), 4) for c in coverage],
        "eval_s": time.perf_counter() - started,
    }


def paired_difference(ours: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Per-seed ``ours - base``: success and final coverage with t 95 % CIs, and the discordant seeds."""
    a, b = np.asarray(ours["per_episode_success"]), np.asarray(base["per_episode_success"])
    success = (a - b).astype(float)
    coverage = np.asarray(ours["per_episode_final_coverage"]) - np.asarray(base["per_episode_final_coverage"])
    return {
        "success_rate_difference": float(success.mean()),
        "success_rate_difference_t95": mean_interval(success.tolist(), bounds=(-1.0, 1.0)),
        "final_coverage_difference": float(coverage.mean()),
        "final_coverage_difference_t95": mean_interval(coverage.tolist(), bounds=(-1.0, 1.0)),
        "seeds_only_ours_succeeded": int(((a == 1) & (b == 0)).sum()),
        "seeds_only_base_succeeded": int(((a == 0) & (b == 1)).sum()),
    }


def stage_eval(run: Run) -> None:
    args = run.args
    evaluations = {}
    for name in POLICIES:
        policy = load_policy_file(run.existing(run.policy_path(name), "bc"), device=args.device)
        evaluations[name] = evaluate(run, policy)
    if not args.no_teacher_eval and run.teacher_files():
        evaluations["teacher"] = evaluate(run, load_policy_file(run.teacher_files()[0], device=args.device))
    evaluations["paired_difference"] = paired_difference(evaluations["real_plus_dreams"], evaluations["real"])
    run.results["eval"] = evaluations


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def summary(results: dict[str, Any]) -> str:
    lines = []
    if "dreams" in results:
        d = results["dreams"]
        lines.append(f"dreams: {d['episodes']} of {d['teacher']}, imagined success {d['imagined_success_rate']}, "
                     f"{d['episodes_kept']} kept ({d['keep']}), {d['bc_samples']} BC samples")
    for name in (*POLICIES, "teacher"):
        entry = results.get("eval", {}).get(name)
        if entry:
            low, high = entry["success_rate_wilson95"]
            lines.append(f"{name:>16}: real success {entry['success_rate']:.3f} [{low:.3f}, {high:.3f}] on "
                         f"{entry['episodes']} held-out seeds, final coverage {entry['mean_final_coverage']:.3f}")
    paired = results.get("eval", {}).get("paired_difference")
    if paired:
        interval = paired["success_rate_difference_t95"]
        shown = "n/a" if interval is None else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"
        lines.append(f"real_plus_dreams - real: {paired['success_rate_difference']:+.3f} {shown} (paired, t 95 %)")
    return "\n".join(lines)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU (under a minute): checks the pipeline, measures nothing")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    parser.add_argument("--work", default="/tmp/cosmos3_gym_dream_bc", help="intermediate files, kept between calls")
    parser.add_argument("--teacher", default=f"file:{TEACHER}", help="the stronger policy that dreams (a policy spec)")
    parser.add_argument("--keep", choices=("successes", "all"), default=None,
                        help="dreams kept for BC (default: successes; all with --smoke)")
    parser.add_argument("--dream-num-steps", type=int, default=None,
                        help="world-model denoising steps (default: the checkpoint's; 1 with --smoke)")
    parser.add_argument("--eval-seed", type=int, default=None,
                        help="first held-out gym-pusht seed (default: the manifest's reporting seeds)")
    parser.add_argument("--demo-seed", type=int, default=DEMO_SEED,
                        help="first demonstration reset seed (default: the manifest's training range)")
    parser.add_argument("--no-teacher-eval", action="store_true", help="do not evaluate the teacher in gym-pusht")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available; cpu with --smoke)")
    parser.add_argument("--seed", type=int, default=0, help="demonstration seeds, BC, dreams")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    for name, default in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {default} ({SMOKE[name]} with --smoke)")
    args = parser.parse_args(argv)
    args.argv = ["benchmarks/recipes/dream_bc_pusht.py", *(sys.argv[1:] if argv is None else argv)]
    for name, default in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.keep = args.keep or ("all" if args.smoke else "successes")
    kind, _, path = args.teacher.partition(":")
    if kind == "file" and not Path(path).exists() and (RECIPES.parents[1] / path).exists():
        args.teacher = f"file:{RECIPES.parents[1] / path}"  # a repository path, from any working directory
    if args.smoke and args.dream_num_steps is None:
        args.dream_num_steps = 1
    args.device = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    stages = [stage.strip() for stage in args.stages.split(",") if stage.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown or not stages:
        parser.error(f"--stages: unknown {unknown}; expected some of {','.join(STAGES)}")
    args.stages = ",".join(stage for stage in STAGES if stage in stages)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_arguments(argv)
    if args.smoke:
        torch.set_num_threads(1)
    from cosmos3_gym.tasks.pusht.sim import require_gym_pusht

    require_gym_pusht()
    run = Run(args)
    stage_functions = {"demos": stage_demos, "dream": stage_dream, "bc": stage_bc, "eval": stage_eval}
    for stage in args.stages.split(","):
        started = time.perf_counter()
        print(f"stage {stage} ...", flush=True)
        stage_functions[stage](run)
        run.results.setdefault("timings", {})[stage] = time.perf_counter() - started
        run.save()  # after every stage: a later failure keeps what was measured
    print(summary(run.results))
    return run.results


if __name__ == "__main__":
    main()
