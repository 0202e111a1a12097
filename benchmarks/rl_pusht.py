"""RL in the PushT world model that transfers to the real simulator (issue 17): behaviour cloning, then GRPO in
gym-pusht and GRPO in the world model from the same BC policy with the same env-step budget, all checked in
gym-pusht on held-out seeds.

    python benchmarks/rl_pusht.py --tiny                          # CPU dry run of every stage (about a minute)
    python benchmarks/rl_pusht.py --out $OUT                      # one GPU + 16 CPU cores, all stages
    python benchmarks/rl_pusht.py --stages grpo_wm,eval --resume  # continue a GRPO run from its checkpoint

Device calls of under 10 minutes each (one H100/H200, 16 cores): the first writes its small files (policies,
starts, results, GRPO checkpoints: a few MB) into ``$OUT/rl_work``, which comes back; copy that folder to
``runs/rl_pusht_work`` (git-ignored) and carry it into the next, which works on a writable copy of it under
``$OUT`` (so its GRPO checkpoint comes back too, for ``--resume``)::

    python benchmarks/rl_pusht.py --out $OUT --work $OUT/rl_work --stages demos,bc                      # ~4 min
    cp -r runs/rl_pusht_work $OUT/rl_work && chmod -R u+w $OUT/rl_work &&
    python benchmarks/rl_pusht.py --out $OUT --work $OUT/rl_work --stages dagger,eval_bc,grpo_sim       # ~6 min
    # (the same copy, from the second call's folder)
    python benchmarks/rl_pusht.py --out $OUT --work $OUT/rl_work --stages grpo_wm,eval                  # ~6 min

Stages (``--stages``, comma-separated, in this order):

1. ``demos``: ``--demo-episodes`` scripted-pusher demonstrations in gym-pusht (``sim.pusht_demos``; seeds 0..,
   ``--workers`` processes): 96 x 96 observations and the next 8 normalised actions of every ``--demo-stride``-th
   step for BC, and the simulator state of every step, from which ``--start-stride``-spaced steps become the RL
   start states (``DemoStartStates``: rollouts start mid-task too). A share of the episodes executes noisy actions
   (``--execution-noise`` px, DART) labelled with the clean scripted ones, so BC sees how to recover.
2. ``bc``: ``PixelGaussianPolicy`` fitted to the demonstrations (``rl.bc``; the data set on the GPU, L1 loss,
   ``--bc-steps`` or as many as fit in ``--bc-seconds``).
3. ``dagger``: ``--dagger-rounds`` rounds of DAgger (``rl.dagger``) from the BC policy in gym-pusht: each round
   ``--dagger-episodes`` episodes from fresh gym-pusht seeds (after the demonstrations' seeds), every visited state
   labelled with the scripted pusher's chunk planned from the true state, then ``--dagger-steps`` steps of BC on all
   labels so far. The result becomes ``bc`` (what GRPO starts from and is paired with); the demonstrations-only
   policy stays as ``bc_demos``. ``--dagger-rounds 0`` skips it.
4. ``eval_bc``: the BC policy in gym-pusht from ``--eval-episodes`` held-out starts (gym-pusht seeds
   ``--eval-seed``.., none used in training) for ``--eval-chunks`` chunks: success (coverage >= 0.95 at some step,
   gym-pusht's success) with a Wilson 95 % CI and mean final coverage with a t 95 % CI.
5. ``grpo_sim``: GRPO (``rl.grpo``) in ``PushTSimVectorEnv`` (gym-pusht, ``--num-envs`` slots in groups of
   ``--group-size`` sharing a start, ``--horizon`` chunks) for ``--iterations`` iterations. Starts
   (``--rl-starts``): the states the BC policy itself visits before each chunk (``policy``, the default: mid-task,
   off the demonstrations' path), demonstration steps, or fresh gym-pusht resets (whole tasks). The defaults are
   the best setting measured (RESULTS.md, issue 17, sessions 17-18): policy starts, horizon 4, 128 envs, log std
   -3.5, lr 1e-5, 2 epochs, coverage weight 10, 400 iterations (~200k env steps). From the DAgger policy on 1000
   fresh seeds: +15 to +18 points in gym-pusht, +5 to +7 in the world model (~1400 s on an H200: split it into
   calls with ``--grpo-seconds`` and ``--resume``).
6. ``grpo_wm``: the same GRPO in ``cosmos3_gym/PushT-v0`` (the built-in world model on ``--device``), the same
   starts (frames rendered from the same simulator states), the reward ``pusht_geometric`` (coverage of a rigid T
   fitted to the imagined frame; 0 for deformed blocks), success at 0.95. Every ``--guard-every`` iterations the
   iteration's action chunks are replayed from the same starts in gym-pusht: imagined vs replayed-real success,
   false-success rate and the correlation of imagined score and real coverage, per iteration.
7. ``eval``: both GRPO policies on the same held-out starts as BC, with the paired difference to BC (per seed,
   t 95 % CI).

Writes ``rl_pusht.json`` (card, commit, command; ``policies``: ``bc``, ``bc_demos``, ``grpo_simulator``,
``grpo_world_model`` -> repo-relative policy files; every stage's numbers and wall clock; per-iteration histories;
each GRPO stage's ``loop_speed``: env steps/s of the whole loop and of its env steps, after the first iterations;
``snapshots``: the checkpoints ``--bc-snapshot-steps``, ``--dagger-snapshots`` and ``--grpo-snapshot-iterations``
saved as ``rl_pusht_snapshot_*``)
and ``rl_pusht.png`` (curves) to ``--out`` (default ``$OUT`` or benchmarks/results/rl), and the policy files (under
1 MB each) to ``<out>/policies/`` (commit them as ``benchmarks/results/rl/policies/``). Intermediate files
(demonstrations, GRPO checkpoints) and a copy of the results and policies go to ``--work`` (default
/tmp/cosmos3_gym_rl_pusht; a few MB), which stages run separately share (the results of earlier stages are read
back from ``--out``, else from ``--work``); the demonstrations for BC (GBs) go to ``--scratch`` and are needed only
by the ``bc`` stage.
Needs gym-pusht (the ``sim`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_arguments, check_results_target, provenance, results_dir, write_results  # noqa: E402

from cosmos3_gym.evaluation import mean_interval, wilson_interval  # noqa: E402
from cosmos3_gym.rl.bc import BCConfig, train_bc  # noqa: E402
from cosmos3_gym.rl.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from cosmos3_gym.rl.plots import line_chart  # noqa: E402
from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig, load_policy_file, save_policy_file  # noqa: E402

STAGES = ("demos", "bc", "dagger", "eval_bc", "grpo_sim", "grpo_wm", "eval")
WORLDS = {"grpo_sim": "grpo_simulator", "grpo_wm": "grpo_world_model"}
RESULTS_NAME = "rl_pusht.json"
STEADY_AFTER = 5  # GRPO iterations left out of the loop's speed: the first ones compile and capture CUDA graphs
RESET_STARTS = 2048  # gym-pusht resets GRPO draws its starts from with --rl-starts resets
REPO_POLICY_DIR = "benchmarks/results/rl/policies"
FULL = dict(demo_episodes=1000, demo_max_steps=300, demo_stride=1, start_stride=8, bc_steps=40000, bc_batch_size=256,
            dagger_rounds=4, dagger_episodes=512, dagger_steps=3000, policy_start_episodes=512, eval_episodes=200,
            eval_chunks=38, num_envs=128, group_size=8, horizon=4, iterations=400, minibatch_size=256, workers=16)
TINY = dict(demo_episodes=3, demo_max_steps=24, demo_stride=4, start_stride=8, bc_steps=4, bc_batch_size=8,
            dagger_rounds=2, dagger_episodes=2, dagger_steps=2, policy_start_episodes=2, eval_episodes=3, eval_chunks=2,
            num_envs=4, group_size=2, horizon=2, iterations=2, minibatch_size=8, workers=2)
TINY_POLICY = dict(channels=(8, 8, 8, 8), hidden=16)


# ---------------------------------------------------------------------------------------------------------------
# Context shared by the stages
# ---------------------------------------------------------------------------------------------------------------


class Run:
    def __init__(self, args):
        self.args = args
        check_results_target(RESULTS_NAME, args.out, args.overwrite)  # before any stage runs
        self.out = results_dir(args.out, "rl")
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(args.scratch)
        # Policies and results live in --work (stages run in separate processes, even machines with a fresh --out,
        # share it) and are copied to --out after every stage.
        self.policy_dir = self.work / "policies"
        self.results_path = self.work / RESULTS_NAME
        earlier = self.out / RESULTS_NAME if (self.out / RESULTS_NAME).is_file() else self.results_path
        self.results: dict[str, Any] = json.loads(earlier.read_text()) if earlier.is_file() else {}
        self.results.setdefault("policies", {})
        self.results.setdefault("timings", {})
        # "provenance" and "settings" are this call's; every call's command stays listed here.
        self.results.setdefault("calls", []).append(
            {"command": " ".join(["benchmarks/rl_pusht.py", *args.argv]), "stages": args.stages})
        from cosmos3_gym.processor import ActionStats
        from cosmos3_gym.tasks.pusht.env import load_pusht_assets

        self.assets = load_pusht_assets(args.assets)
        self.action_stats = ActionStats.from_json(self.assets.checkpoint / "action_stats.json", mode="minmax")
        self.image_size = tuple(self.assets.meta.get("image_size", (256, 256)))
        self.chunk = int(self.assets.meta.get("chunk", 8))

    def policy_path(self, name: str) -> Path:
        return self.policy_dir / f"rl_pusht_{name}.safetensors"

    def existing_policy(self, name: str) -> Path:
        path = self.policy_path(name)
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run the stage that trains it first with the same --work (in another "
                             f"call: bring that call's --work folder along and pass it as --work).")
        return path

    def snapshot(self, policy: PixelGaussianPolicy, name: str, **where: Any) -> None:
        """A checkpoint of this training run (``--bc-snapshot-steps``, ``--dagger-snapshots``,
        ``--grpo-snapshot-iterations``): its policy file,
        listed under ``snapshots`` in the results in the order written (issue 42 ranks a run's checkpoints)."""
        path = self.policy_path(f"snapshot_{name}")
        save_policy_file(policy, path, trained_by=f"benchmarks/rl_pusht.py (snapshot {name})", seed=self.args.seed,
                         **where)
        snapshots = self.results.setdefault("snapshots", [])
        snapshots[:] = [s for s in snapshots if s["name"] != name]  # a stage run again replaces its snapshots
        snapshots.append({"name": name, "policy": f"{REPO_POLICY_DIR}/{path.name}", **where})

    def record_policy(self, key: str, name: str) -> None:
        self.results["policies"][key] = f"{REPO_POLICY_DIR}/{self.policy_path(name).name}"

    def save(self) -> None:
        self.results["provenance"] = provenance(["benchmarks/rl_pusht.py", *self.args.argv])
        self.results["settings"] = {key: value for key, value in vars(self.args).items() if key != "argv"}
        self.results_path.write_text(json.dumps(self.results, indent=2, default=str))
        write_results(self.results, RESULTS_NAME, str(self.out), self.args.overwrite, args=self.args,
                      inputs=sorted(self.policy_dir.glob("*.safetensors")))
        if self.policy_dir.is_dir():
            (self.out / "policies").mkdir(exist_ok=True)
            for path in self.policy_dir.glob("*.safetensors"):
                shutil.copy2(path, self.out / "policies" / path.name)

    def starts(self):
        from cosmos3_gym.tasks.pusht.starts import DemoStartStates

        path = self.work / "starts.npz"
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run the 'demos' stage first (with the same --work; in another call: "
                             f"bring that call's --work folder along and pass it as --work).")
        return DemoStartStates.load(path)

    def rl_starts(self):
        """GRPO's starts: ``--rl-starts demos`` (every ``--start-stride``-th step of the demonstrations: mid-task
        too), ``resets`` (``RESET_STARTS`` fresh gym-pusht resets after the DAgger seeds: whole tasks, for rollouts
        as long as an episode) or ``policy`` (the states the BC policy visits before each chunk in
        ``--policy-start-episodes`` episodes from the first of those resets: its own mid-task states, where it
        fails; rolled once per BC policy and kept in ``--work``)."""
        from cosmos3_gym.tasks.pusht.replay import policy_rollout_starts
        from cosmos3_gym.tasks.pusht.starts import DemoStartStates

        if self.args.rl_starts == "demos":
            return self.starts()
        first = reset_starts_first_seed(self.args)
        if self.args.rl_starts == "resets":
            return DemoStartStates.from_seeds(range(first, first + RESET_STARTS), image_size=self.image_size)
        bc = self.existing_policy("bc")
        episodes = min(self.args.policy_start_episodes, RESET_STARTS)
        # "gym-pusht resets": the rollouts start by gym-pusht's own reset (sim.starts.put_in_start); caches from
        # before that, when they started from restored states, do not match.
        setting = f"{first},{episodes},{self.args.eval_chunks},gym-pusht resets"
        key = hashlib.sha256(bc.read_bytes() + setting.encode()).hexdigest()
        path = self.work / f"policy_starts_{key[:12]}.npz"  # the same policy, seeds and length: the same states
        if path.is_file():
            return DemoStartStates.load(path)
        resets = DemoStartStates.from_seeds(range(first, first + episodes), image_size=self.image_size)
        env = self.sim_env(resets, episodes, 1, self.args.eval_chunks)
        try:
            starts = policy_rollout_starts(load_policy_file(bc, device=self.args.device), env, np.arange(episodes),
                                           self.args.eval_chunks, image_size=self.image_size)
        finally:
            env.close()
        starts.save(path)
        print(f"policy starts: {starts.description}", flush=True)
        return starts

    def eval_starts(self, first_seed: int | None = None):
        from cosmos3_gym.tasks.pusht.starts import DemoStartStates

        first_seed = self.args.eval_seed if first_seed is None else first_seed
        return DemoStartStates.from_seeds(range(first_seed, first_seed + self.args.eval_episodes),
                                          image_size=self.image_size)

    def sim_env(self, starts, num_envs: int, group_size: int, max_episode_steps: int):
        from cosmos3_gym.tasks.pusht.sim_vector_env import PushTSimVectorEnv

        return PushTSimVectorEnv(num_envs, starts=starts, action_stats=self.action_stats, group_size=group_size,
                                 chunk=self.chunk, image_size=self.image_size, observation_size=(96, 96),
                                 max_episode_steps=max_episode_steps, workers=self.args.workers)

    def new_policy(self) -> PixelGaussianPolicy:
        extra = TINY_POLICY if self.args.tiny else {}
        return PixelGaussianPolicy(PolicyConfig(chunk=self.chunk, **extra)).to(self.args.device)


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


def stage_demos(run: Run) -> None:
    from cosmos3_gym.tasks.pusht.demos import generate_demonstrations
    from cosmos3_gym.tasks.pusht.starts import DemoStartStates

    args = run.args
    demos = generate_demonstrations(
        args.demo_episodes, action_stats=run.action_stats, seed=args.seed, max_steps=args.demo_max_steps,
        stride=args.demo_stride, chunk=run.chunk, image_size=run.image_size, workers=args.workers,
        noise_levels=(0.0,), execution_noise=args.execution_noise, progress=not args.no_progress)
    run.scratch.mkdir(parents=True, exist_ok=True)
    np.save(run.scratch / "demo_observations.npy", demos["observations"])
    np.save(run.scratch / "demo_action_chunks.npy", demos["action_chunks"])
    # Starts: every start_stride-th step of the demonstrations (noisy ones too: they are real states).
    episodes = [e for e in demos["episodes"] if e["steps"] > 0]
    starts = DemoStartStates.from_episodes(episodes, stride=args.start_stride, image_size=run.image_size)
    starts.save(run.work / "starts.npz")
    run.results["demos"] = {
        "episodes": args.demo_episodes, "seeds": [args.seed, args.seed + args.demo_episodes - 1],
        "scripted_success_rate": demos["success_rate"],
        "scripted_mean_final_coverage": float(np.mean([e["final_coverage"] for e in demos["episodes"]])),
        "mean_steps": float(np.mean([e["steps"] for e in demos["episodes"]])),
        "bc_samples": int(len(demos["observations"])), "rl_starts": len(starts),
        "execution_noise_px": list(args.execution_noise),
        "success_rate_by_execution_noise": {
            str(level): float(np.mean([e["success"] for e in demos["episodes"] if e["execution_noise"] == level]))
            for level in sorted({e["execution_noise"] for e in demos["episodes"]})},
    }


def stage_bc(run: Run) -> None:
    args = run.args
    if not (run.scratch / "demo_observations.npy").is_file():
        raise SystemExit(f"{run.scratch / 'demo_observations.npy'} is missing: run the 'demos' stage first, in the "
                         f"same call or with the same --scratch.")
    observations = np.load(run.scratch / "demo_observations.npy")
    chunks = np.load(run.scratch / "demo_action_chunks.npy")
    torch.manual_seed(args.seed)
    policy = run.new_policy()
    config = BCConfig(steps=args.bc_steps, batch_size=args.bc_batch_size, loss=args.bc_loss,
                      max_seconds=args.bc_seconds, seed=args.seed)
    snapshot_steps = set(args.bc_snapshot_steps)

    def after_step(step: int) -> None:
        if step in snapshot_steps:
            run.snapshot(policy, f"bc_step{step}", stage="bc", bc_steps=step)

    started = time.perf_counter()
    losses = train_bc(policy, observations, chunks, config, progress=not args.no_progress, on_step=after_step)
    train_s = time.perf_counter() - started
    save_policy_file(policy, run.policy_path("bc"), trained_by="benchmarks/rl_pusht.py (bc)", samples=len(chunks),
                     steps=len(losses))
    run.record_policy("bc", "bc")
    every = max(1, len(losses) // 50)
    run.results["bc"] = {"loss": losses[::every] + [losses[-1]], "final_loss": losses[-1],
                         "samples": int(len(chunks)), "steps": len(losses), "config": asdict(config),
                         "train_s": train_s, "ms_per_step": 1000 * train_s / len(losses)}


def stage_dagger(run: Run) -> None:
    """DAgger from the BC policy (``rl.dagger``): the result replaces ``bc`` (the policy GRPO starts from and is paired
    with); the demonstrations-only policy stays as ``bc_demos``."""
    from cosmos3_gym.tasks.pusht.dagger import DAggerConfig, train_dagger
    from cosmos3_gym.tasks.pusht.starts import DemoStartStates

    args = run.args
    if args.dagger_rounds == 0:
        print("dagger: --dagger-rounds 0; skipped", flush=True)
        return
    demos_only = run.policy_path("bc_demos")
    if not demos_only.is_file():
        shutil.copy2(run.existing_policy("bc"), demos_only)
    policy = load_policy_file(demos_only, device=args.device)
    first_seed = dagger_first_seed(args)
    episodes = args.dagger_episodes
    starts = DemoStartStates.from_seeds(range(first_seed, first_seed + args.dagger_rounds * episodes),
                                        image_size=run.image_size)
    config = DAggerConfig(rounds=args.dagger_rounds, chunks=args.eval_chunks, seed=args.seed,
                          bc=BCConfig(steps=args.dagger_steps, batch_size=args.bc_batch_size, learning_rate=3e-4,
                                      loss=args.bc_loss, seed=args.seed))
    env = run.sim_env(starts, episodes, 1, args.eval_chunks)
    started = time.perf_counter()
    try:
        history = train_dagger(policy, env, lambda r: np.arange(r * episodes, (r + 1) * episodes), config,
                               progress=not args.no_progress,
                               on_round=lambda r: after_dagger_round(run, policy, r))
    finally:
        env.close()
    save_policy_file(policy, run.policy_path("bc"), trained_by="benchmarks/rl_pusht.py (bc, then dagger)",
                     dagger_rounds=args.dagger_rounds, samples=history[-1]["samples"])
    run.record_policy("bc_demos", "bc_demos")
    run.results.setdefault("bc", {})["dagger"] = {
        "config": asdict(config), "seeds": [first_seed, first_seed + args.dagger_rounds * episodes - 1],
        "history": history, "train_s": time.perf_counter() - started}


def after_dagger_round(run: Run, policy: PixelGaussianPolicy, record: dict) -> None:
    print(f"dagger round {record['round']}: rollout success {record['rollout_success_rate']:.3f} coverage "
          f"{record['rollout_mean_final_coverage']:.3f}, {record['samples']} samples, loss {record['final_loss']:.4f}",
          flush=True)
    if run.args.dagger_snapshots:
        run.snapshot(policy, f"dagger_round{record['round'] + 1}", stage="dagger", dagger_rounds=record["round"] + 1,
                     samples=record["samples"])


def dagger_first_seed(args) -> int:
    """DAgger's rollout seeds follow the demonstrations' (never the held-out evaluation seeds)."""
    return args.seed + args.demo_episodes


def reset_starts_first_seed(args) -> int:
    """``--rl-starts resets`` follow DAgger's seeds."""
    return dagger_first_seed(args) + args.dagger_rounds * args.dagger_episodes


def evaluate(run: Run, name: str, first_seed: int | None = None) -> dict[str, Any]:
    """The policy file ``name`` in gym-pusht from the held-out starts (``--eval-seed``.., or ``first_seed``..):
    success and final coverage with CIs."""
    from cosmos3_gym.tasks.pusht.replay import evaluate_in_simulator

    args = run.args
    first_seed = args.eval_seed if first_seed is None else first_seed
    policy = load_policy_file(run.existing_policy(name), device=args.device)
    env = run.sim_env(run.eval_starts(first_seed), args.eval_episodes, 1, args.eval_chunks)
    try:
        started = time.perf_counter()
        episodes = evaluate_in_simulator(policy, env, np.arange(args.eval_episodes), args.eval_chunks)
        seconds = time.perf_counter() - started
    finally:
        env.close()
    success = episodes["success"]
    coverage = episodes["final_coverage"]
    return {
        "episodes": int(len(success)),
        "eval_seeds": [first_seed, first_seed + args.eval_episodes - 1],
        "success_rate": float(success.mean()),
        "success_rate_wilson95": list(wilson_interval(int(success.sum()), len(success))),
        "mean_final_coverage": float(coverage.mean()),
        "mean_final_coverage_t95": mean_interval(coverage.tolist()),
        "mean_max_coverage": float(episodes["max_coverage"].mean()),
        "per_episode_success": success.astype(int).tolist(),
        "per_episode_final_coverage": [round(float(c), 4) for c in coverage],
        "eval_s": seconds,
    }


def paired_difference(run: Run, key: str) -> dict[str, Any]:
    """Per-seed difference of ``key``'s evaluation and BC's: success and final coverage, t 95 % CIs."""
    ours, bc = run.results[key]["eval"], run.results["bc"]["eval"]
    success = np.asarray(ours["per_episode_success"], float) - np.asarray(bc["per_episode_success"], float)
    coverage = np.asarray(ours["per_episode_final_coverage"]) - np.asarray(bc["per_episode_final_coverage"])
    return {
        "success_rate_difference": float(success.mean()),
        "success_rate_difference_t95": mean_interval(success.tolist()),
        "final_coverage_difference": float(coverage.mean()),
        "final_coverage_difference_t95": mean_interval(coverage.tolist()),
    }


def stage_eval_bc(run: Run) -> None:
    run.results.setdefault("bc", {})["eval"] = evaluate(run, "bc")
    # The same from the demonstrations' own start seeds: far above the held-out rate means the policy memorised
    # (more demos); as low means it cannot even follow its training data (capacity, labels, or the env/demo match).
    training = evaluate(run, "bc", first_seed=run.args.seed)
    run.results["bc"]["eval_on_demo_seeds"] = {key: value for key, value in training.items()
                                               if not key.startswith("per_episode")}


def world_model_env(run: Run, starts, guard_horizon: int):
    """``cosmos3_gym/PushT-v0`` (or, with --tiny, the tiny random checkpoint) with the demonstration starts."""
    from cosmos3_gym.envs.vector_env import WorldModelVectorEnv
    from cosmos3_gym.tasks.pusht.starts import DemoStartStates

    args = run.args
    common = dict(reward_model=f"pusht_geometric?min_iou={args.min_iou}", success_threshold=0.95,
                  max_episode_steps=guard_horizon, imagination_samples=args.imagination_samples,
                  imagination_reduce=args.imagination_reduce,
                  observation_size=(96, 96), device=args.device)
    if "group_size" in inspect.signature(WorldModelVectorEnv.__init__).parameters:
        common["group_size"] = args.group_size  # starts are passed per slot anyway; this adds info["group"]
    if args.tiny:
        from cosmos3_gym.testing import cached_tiny_checkpoint

        size = (64, 64)  # the tiny model's frame size at tier 256
        wm_starts = DemoStartStates(starts.sim_states, episodes=starts.episodes, steps=starts.steps, image_size=size)
        return WorldModelVectorEnv(args.num_envs, checkpoint=cached_tiny_checkpoint(), domain="pusht",
                                   raw_action_dim=2, chunk=run.chunk, num_steps=1, guidance_scale=1.0,
                                   resolution_tier=256, fps=10.0, initial_states=wm_starts, **common)
    from cosmos3_gym.tasks.pusht.env import make_pusht_vector_env

    return make_pusht_vector_env(args.num_envs, assets_dir=args.assets, initial_states=starts, **common)


def stage_grpo(run: Run, stage: str) -> None:
    from cosmos3_gym.tasks.pusht.replay import replay_in_simulator

    args = run.args
    key = WORLDS[stage]
    starts = run.rl_starts()
    config = GRPOConfig(iterations=args.iterations, group_size=args.group_size, horizon=args.horizon,
                        learning_rate=args.learning_rate, update_epochs=args.update_epochs,
                        minibatch_size=args.minibatch_size, kl_coef=args.kl_coef, entropy_coef=args.entropy_coef,
                        coverage_weight=args.coverage_weight,
                        advantage_normalization=args.advantage_normalization, guard_every=args.guard_every,
                        seed=args.seed)
    started = time.perf_counter()
    # Simulator workers fork before anything touches CUDA.
    replay_env = run.sim_env(starts, args.num_envs, 1, args.horizon) if stage == "grpo_wm" else None
    env = run.sim_env(starts, args.num_envs, args.group_size, args.horizon) if stage == "grpo_sim" else None
    reference = start_policy(run)
    if stage == "grpo_wm":
        env = world_model_env(run, starts, args.horizon)
    guard = (lambda s, a, n: replay_in_simulator(replay_env, s, a, n)) if replay_env is not None else None
    setup_s = time.perf_counter() - started
    checkpoint = run.work / f"{key}_checkpoint.safetensors"
    earlier_s = 0.0  # a resumed run's training time before this call, so train_s covers the whole history
    try:
        if args.resume and checkpoint.is_file():
            earlier_s = run.results.get(key, {}).get("train_s", 0.0)
            trainer = GRPOTrainer.load(checkpoint, env, device=args.device, reference=reference, guard=guard)
            print(f"{key}: resumed at iteration {trainer.iteration}", flush=True)
        else:
            policy = start_policy(run)
            trainer = GRPOTrainer(policy, env, config, reference=reference, num_starts=len(starts), guard=guard)
        snapshot_iterations = set(args.grpo_snapshot_iterations)
        started = time.perf_counter()
        ended = [started]  # when each iteration of this call ended: the whole loop's wall clock per iteration

        def on_iteration(record: dict) -> None:
            print(_iteration_line(key, record), flush=True)
            if trainer.iteration in snapshot_iterations:
                run.snapshot(trainer.policy, f"{key}_it{trainer.iteration}", stage=stage,
                             grpo_iterations=trainer.iteration, env_steps=record["env_steps_total"])
            ended.append(time.perf_counter())

        history = trainer.train(args.iterations, checkpoint_path=checkpoint, progress=not args.no_progress,
                                max_seconds=args.grpo_seconds, on_iteration=on_iteration)
        train_s = earlier_s + time.perf_counter() - started
    finally:
        env.close()
        if replay_env is not None:
            replay_env.close()
    save_policy_file(trainer.policy, run.policy_path(key), trained_by=f"benchmarks/rl_pusht.py ({stage})",
                     iterations=trainer.iteration, world=key.removeprefix("grpo_"),
                     env_steps=history[-1]["env_steps_total"])
    run.record_policy(key, key)
    run.results[key] = {
        "world": "gym-pusht" if stage == "grpo_sim" else "cosmos3_gym/PushT-v0 (reward pusht_geometric)",
        "starts": starts.description,
        "config": asdict(config),
        "history": history,
        "env_steps": history[-1]["env_steps_total"],
        "train_s": train_s,
        "setup_s": setup_s,
        "env_s": float(sum(r["env_s"] for r in history)),
        "update_s": float(sum(r["update_s"] for r in history)),
        "guard_s": float(sum(r.get("guard_s", 0.0) for r in history)),
        "loop_speed": loop_speed(history[len(history) - len(ended) + 1:], np.diff(ended)),
    }
    speed = run.results[key]["loop_speed"]
    if speed["env_steps"]:
        print(f"{key}: {speed['loop_env_steps_per_s']:.0f} env steps/s for the whole loop, "
              f"{speed['env_only_env_steps_per_s']:.0f} for its env steps ({speed['iterations']} iterations after "
              f"{speed['skipped']})", flush=True)
    guarded = [r for r in history if r.get("guard")]
    if guarded:  # the world model's reward, checked against gym-pusht over every replayed episode
        imagined = sum(r["imagined_successes"] for r in guarded)
        false = sum(r["false_successes"] for r in guarded)
        run.results[key]["reward_check"] = {
            "replayed_episodes": sum(r["episodes"] for r in guarded),
            "imagined_success_rate": float(np.mean([r["imagined_success_rate"] for r in guarded])),
            "replayed_success_rate": float(np.mean([r["replayed_success_rate"] for r in guarded])),
            "imagined_successes": imagined,
            "false_successes": false,
            "false_success_rate": false / imagined if imagined else None,
            "mean_score_coverage_pearson": float(np.nanmean([r["score_coverage_pearson"] for r in guarded]))
            if any(np.isfinite(r["score_coverage_pearson"]) for r in guarded) else None,
            "mean_score_coverage_mae": float(np.mean([r["score_coverage_mae"] for r in guarded])),
        }


def loop_speed(records: list[dict], iteration_s: np.ndarray, warmup: int = STEADY_AFTER) -> dict[str, Any]:
    """Env steps per second of the whole GRPO loop (rollout, update, guard, checkpoint and logging: each iteration's
    wall clock) and of its env steps alone, over this call's iterations after the first ``warmup`` (compile and graph
    capture; all of them if there are no more)."""
    steady = slice(warmup, None) if len(records) > warmup else slice(None)
    steps = sum(r["env_steps"] for r in records[steady])
    return {"iterations": len(records[steady]), "skipped": len(records) - len(records[steady]),
            "env_steps": steps, "iteration_s": [float(t) for t in iteration_s],
            "loop_env_steps_per_s": steps / float(np.sum(iteration_s[steady])) if steps else None,
            "env_only_env_steps_per_s": steps / sum(r["env_s"] for r in records[steady]) if steps else None}


def start_policy(run: Run) -> PixelGaussianPolicy:
    """The BC policy GRPO starts from (and stays near, as the KL reference), its exploration noise set to
    ``--initial-log-std`` (BC leaves it at ``PolicyConfig.initial_log_std``)."""
    policy = load_policy_file(run.existing_policy("bc"), device=run.args.device)
    with torch.no_grad():
        policy.log_std.fill_(run.args.initial_log_std)
    return policy


def _iteration_line(key: str, record: dict) -> str:
    line = (f"{key} it {record['iteration']}: success {record['success_rate']:.2f} return {record['mean_return']:.3f}"
            f" informative groups {record['informative_groups']:.2f} kl {record['kl_to_reference']:.3f} "
            f"env {record['env_s']:.1f}s update {record['update_s']:.1f}s")
    if record.get("guard"):
        line += (f" | imagined {record['imagined_success_rate']:.2f} vs replayed-real "
                 f"{record['replayed_success_rate']:.2f}")
    return line


def stage_eval(run: Run) -> None:
    for key in run.args.eval_policies:
        if not run.policy_path(key).is_file():
            print(f"eval: no {key} policy yet; skipped", flush=True)
            continue
        run.results.setdefault(key, {})["eval"] = evaluate(run, key)
        if "eval" in run.results.get("bc", {}):
            run.results[key]["vs_bc"] = paired_difference(run, key)


# ---------------------------------------------------------------------------------------------------------------


def plot(run: Run) -> None:
    panels = []
    series = []
    for key, label in (("grpo_simulator", "GRPO in gym-pusht"), ("grpo_world_model", "GRPO in world model")):
        history = run.results.get(key, {}).get("history")
        if history:
            steps = [r["env_steps_total"] for r in history]
            series.append({"label": f"{label}: training success", "x": steps, "y": [r["success_rate"] for r in
                                                                                     history]})
            guarded = [r for r in history if r.get("guard")]
            if guarded:
                series.append({"label": "world model rollouts replayed in gym-pusht",
                               "x": [r["env_steps_total"] for r in guarded],
                               "y": [r["replayed_success_rate"] for r in guarded], "dashed": True})
    if series:
        panels.append({"title": "success per iteration (imagined vs real)", "xlabel": "env steps (chunks)",
                       "ylabel": "success rate", "series": series})
    history = run.results.get("grpo_world_model", {}).get("history", [])
    guarded = [r for r in history if r.get("guard")]
    if guarded:
        panels.append({"title": "guard: world-model reward vs replay", "xlabel": "iteration", "ylabel": "",
                       "series": [
                           {"label": "false-success rate", "x": [r["iteration"] for r in guarded],
                            "y": [r["false_success_rate"] for r in guarded]},
                           {"label": "imagined score", "x": [r["iteration"] for r in guarded],
                            "y": [r["imagined_final_score"] for r in guarded]},
                           {"label": "replayed real coverage", "x": [r["iteration"] for r in guarded],
                            "y": [r["replayed_final_coverage"] for r in guarded]}]})
    evals = [(key, run.results.get(key, {}).get("eval")) for key in ("bc", "grpo_simulator", "grpo_world_model")]
    evals = [(key, e) for key, e in evals if e]
    if evals:
        panels.append({"title": "held-out gym-pusht success (Wilson 95 %)", "xlabel": "policy (bc, sim, wm)",
                       "ylabel": "success rate", "series": [
                           {"label": f"{key}: {e['success_rate']:.3f}", "x": [i, i, i],
                            "y": [e["success_rate_wilson95"][0], e["success_rate"], e["success_rate_wilson95"][1]]}
                           for i, (key, e) in enumerate(evals)]})
    if panels:
        path = line_chart(run.out / "rl_pusht.png", panels,
                          title="PushT: BC -> GRPO in gym-pusht / in the world model")
        run.results["plot"] = path.name


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny sizes and the tiny random model")
    add_output_arguments(parser)
    parser.add_argument("--work", default="/tmp/cosmos3_gym_rl_pusht",
                        help="policies, starts, results, GRPO checkpoints (a few MB), shared by stages and calls")
    parser.add_argument("--scratch", default="/tmp/cosmos3_gym_rl_pusht_scratch",
                        help="the demonstrations for BC (GBs), from the demos stage to the bc stage")
    parser.add_argument("--assets", default=None, help="PushT world model folder (default: the built-in one)")
    parser.add_argument("--resume", action="store_true", help="continue GRPO from its checkpoint in --work")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=None, help="simulator processes (default 16; --tiny 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-seed", type=int, default=100_000, help="first held-out gym-pusht seed")
    for name, default in FULL.items():
        if name != "workers":
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {default}")
    parser.add_argument("--execution-noise", type=_floats, default=(0.0, 8.0, 16.0),
                        help="comma-separated px stds of the noise demonstrations execute (DART; one per episode)")
    parser.add_argument("--bc-loss", choices=("l1", "mse"), default="l1")
    parser.add_argument("--bc-snapshot-steps", type=_ints, default=(),
                        help="comma-separated BC steps after which the policy is also saved as a snapshot "
                             "(rl_pusht_snapshot_bc_step<N>): checkpoints of one run")
    parser.add_argument("--dagger-snapshots", action="store_true",
                        help="save the policy after every DAgger round as a snapshot "
                             "(rl_pusht_snapshot_dagger_round<R>)")
    parser.add_argument("--grpo-snapshot-iterations", type=_ints, default=(),
                        help="comma-separated GRPO iterations after which the policy is also saved as a snapshot "
                             "(rl_pusht_snapshot_grpo_simulator_it<N>, ..._grpo_world_model_it<N>)")
    parser.add_argument("--bc-seconds", type=float, default=None,
                        help="BC wall-clock budget: fewer than --bc-steps if they would not fit (default 120; --tiny "
                             "none)")
    # 3e-4 moved the BC policy out of any trust region in the first update (clip fraction 0.8, approx KL 1.6 on the
    # H200 run of 2026-11-26): fine-tuning a cloned policy takes a smaller step.
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="GRPO's Adam step")
    parser.add_argument("--update-epochs", type=int, default=2)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    parser.add_argument("--coverage-weight", type=float, default=10.0,
                        help="return = 1[success] + this x final coverage (10: almost only coverage, which the world "
                             "model imagines faithfully and its successes do not)")
    parser.add_argument("--advantage-normalization", choices=("group", "batch", "none"), default="group",
                        help="GRPO's advantage: return minus group mean over the group's std, the batch's std or 1")
    parser.add_argument("--initial-log-std", type=float, default=-3.5,
                        help="GRPO: the start policy's (and KL reference's) log std of its Gaussian, in the [-1, 1] "
                             "action space (-3.5: sampled rollouts succeed about as often as the mean action; BC "
                             "saves -2.5, about 21 table px)")
    parser.add_argument("--rl-starts", choices=("demos", "resets", "policy"), default="policy",
                        help="GRPO's starts: steps of the demonstrations (mid-task too), fresh gym-pusht resets "
                             "(whole tasks: pair with --horizon as long as an episode) or the states the BC policy "
                             "visits in episodes from those resets (its own mid-task states)")
    parser.add_argument("--grpo-seconds", type=float, default=None,
                        help="GRPO stages stop after the last iteration expected to finish within this many seconds "
                             "(policy, checkpoint and results still written; --resume continues the run)")
    parser.add_argument("--guard-every", type=int, default=10)
    parser.add_argument("--imagination-samples", type=int, default=1,
                        help="grpo_wm: score each chunk by this many imagined samples of it (the env's "
                             "imagination_samples; K times the world-model work)")
    parser.add_argument("--imagination-reduce", choices=("mean", "min"), default="mean",
                        help="grpo_wm: the samples' mean score, or their minimum (pessimistic)")
    parser.add_argument("--min-iou", type=float, default=0.8,
                        help="world-model frames whose block fits a rigid T worse than this score 0")
    parser.add_argument("--eval-policies", default=",".join(WORLDS.values()),
                        help=f"comma-separated GRPO policies the eval stage measures, of {','.join(WORLDS.values())}")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name, value in (TINY if args.tiny else FULL).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.bc_seconds is None and not args.tiny:
        args.bc_seconds = 120.0
    stages = [stage.strip() for stage in args.stages.split(",") if stage.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown {unknown}; expected some of {list(STAGES)}")
    args.eval_policies = [key.strip() for key in args.eval_policies.split(",") if key.strip()]
    if not set(args.eval_policies) <= set(WORLDS.values()):
        parser.error(f"--eval-policies: expected some of {list(WORLDS.values())}, got {args.eval_policies}")
    if args.num_envs % args.group_size:
        parser.error("--num-envs must be a multiple of --group-size")
    if args.eval_seed < reset_starts_first_seed(args) + RESET_STARTS:
        parser.error("--eval-seed: held-out seeds must not overlap the demonstration, DAgger and GRPO start seeds")
    bounds = (GRPOConfig.min_log_std, GRPOConfig.max_log_std)
    if args.grpo_seconds is not None and not args.grpo_seconds > 0:
        parser.error(f"--grpo-seconds: expected a positive number of seconds, got {args.grpo_seconds}")
    if not bounds[0] <= args.initial_log_std <= bounds[1]:
        parser.error(f"--initial-log-std: expected a value in GRPO's log std range {list(bounds)}, got "
                     f"{args.initial_log_std}")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the simulator worker processes

    run = Run(args)
    named_stages = {"demos": stage_demos, "bc": stage_bc, "dagger": stage_dagger, "eval_bc": stage_eval_bc,
                    "eval": stage_eval}
    for stage in STAGES:
        if stage not in stages:
            continue
        print(f"== stage {stage}", flush=True)
        started = time.perf_counter()
        named_stages.get(stage, lambda r: stage_grpo(r, stage))(run)
        run.results["timings"][f"{stage}_s"] = time.perf_counter() - started
        run.save()
    plot(run)
    run.save()
    print_summary(run.results)
    return run.results


def _comma_separated(kind: type, minimum: float, expected: str):
    """An argparse type: comma-separated ``kind`` values, none below ``minimum``."""
    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            values = ()
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected comma-separated {expected}, got {text!r}")
        return values
    return parse


_ints = _comma_separated(int, 1, "positive integers")
_floats = _comma_separated(float, 0, "non-negative numbers")


def print_summary(results: dict) -> None:
    for key in ("bc", "grpo_simulator", "grpo_world_model"):
        entry = results.get(key, {})
        if "eval" in entry:
            e = entry["eval"]
            low, high = e["success_rate_wilson95"]
            line = f"{key:17s} real success {e['success_rate']:.3f} [{low:.3f}, {high:.3f}], final coverage " \
                   f"{e['mean_final_coverage']:.3f}"
            if "vs_bc" in entry:
                d = entry["vs_bc"]
                ci = d["success_rate_difference_t95"] or (float("nan"), float("nan"))
                line += f", vs BC {d['success_rate_difference']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"
            if "env_steps" in entry:
                line += f", trained {entry['train_s']:.0f} s for {entry['env_steps']} env steps"
            print(line)


if __name__ == "__main__":
    main()
