"""RL in imagination on PushT: PPO trained only inside the world model, evaluated in the real simulator, against
random actions and against PPO trained in the real simulator for the same number of env steps.

    python benchmarks/recipes/rl_imagination_pusht.py --smoke      # CPU, under a minute: checks the pipeline only
    python benchmarks/recipes/rl_imagination_pusht.py --timesteps 512 --num-envs 8 --eval-episodes 16 --threads 2  # CPU
    python benchmarks/recipes/rl_imagination_pusht.py --timesteps 16384 --num-envs 64 --n-steps 16 --eval-points 8 \\
        --eval-episodes 64 --device cuda                             # GPU

Needs gym-pusht (the ``sim`` extra). Writes ``rl_imagination_pusht_<cpu|gpu>.json`` (e.g. ``..._h100.json``),
the two trained policies next to it (``<results stem>_world_model_policy.safetensors`` and
``<results stem>_simulator_policy.safetensors``; their names are in the JSON under ``agents.<world>.policy_file``)
and, where matplotlib is installed, ``rl_imagination_pusht_<card>.png`` (the learning curves) to ``--out`` (default
``$OUT`` or benchmarks/results/). matplotlib is not a dependency of the project: without it the plot is skipped
(the JSON says so) and the curves are in the JSON.

The policy files are safetensors (``cosmos3_gym.agents.save_sb3_policy``; SB3's own .zip would pickle): load one with
``cosmos3_gym.agents.SB3PolicyAgent.from_file`` or rank it against the other policies in the world model and the
simulator with ``benchmarks/recipes/fidelity_pusht.py --policies ...,ppo:PATH`` / ``cosmos3-gym eval-real``.

**The two training worlds share one interface.** Both agents see the PushT world-model env's spaces: observation
``{"image": uint8 [s, s, 3]}`` (the 256 x 256 frame downscaled to ``--obs-size`` with the env's ``resize_frame``)
and one action per step: a chunk of 8 normalised 2-D targets in [-1, 1]. Episodes are ``--chunks-per-episode``
chunks (terminated early at 0.95 coverage) and start from the same states: the world model from the frames shipped
with it (``initial_states.npz``), the simulator from those frames' gym-pusht seeds.

* **Imagination**: ``cosmos3_gym/PushT-v0`` as a vector env of ``--num-envs`` slots (one batched engine call per
  step) behind ``SB3VecEnv``; the reward is the shipped reward model's estimate of coverage on the chunk's last
  generated frame.
* **Simulator**: ``cosmos3_gym.tasks.pusht.sim_env.PushTSimEnv`` (gym-pusht; actions de-normalised with the checkpoint's
  action statistics exactly as ``cosmos3_gym.tasks.pusht.compare`` runs a policy) in an SB3 ``DummyVecEnv`` (or
  ``SubprocVecEnv``) of ``--num-envs`` envs; the reward is the true coverage after the chunk.

PPO (SB3 ``MultiInputPolicy``: NatureCNN on the image) with the same hyper-parameters and seed in both worlds is
trained for ``--timesteps`` env steps (chunks), rounded up to whole PPO rollouts of ``--n-steps`` x ``--num-envs``
so that each of the ``--eval-points`` segments ends on a rollout boundary; both runs take exactly the same number
of steps. After every segment (and before training) the policy (deterministic: its mean action; ``--stochastic-eval``
samples) is evaluated **in the real simulator** by ``compare.simulate_policy`` on ``--eval-episodes`` held-out starts
(gym-pusht seeds ``--eval-seed`` ..., none of them a training start) for ``--chunks-per-episode`` chunks, as are
uniformly random actions. Numbers per curve point:

* ``final_coverage`` / ``max_coverage``: mean (95 % normal CI) over the held-out episodes of the true coverage of
  the target after the last step / at its best step; ``success_rate`` (coverage > 0.95 at some step) with a normal
  and a Wilson 95 % CI.
* ``train_env``: the episodes the agent finished in its training world during that segment: mean return and mean
  last score. For the imagination agent the score is the reward model's coverage estimate on world-model frames,
  so ``train_env.mean_final_score`` next to the real ``final_coverage`` shows how far imagination flatters it.
* Wall clock: ``train_s`` (PPO ``learn``, all of it), split into ``env_s`` (inside the env's reset / step: the
  world model or the simulator) and ``ppo_s`` (the rest: policy inference and updates); ``eval_s`` of each point.

At CPU sizes (a few hundred chunks) PPO barely moves from its initial policy, so the curves mostly measure the
pipeline and its cost per step (the world model takes about a second per slot-chunk on 2 CPU cores, the simulator
about 10 ms per chunk); learning needs the GPU sizes. On a CPU shared with other processes pass ``--threads 1``:
with more torch threads than free cores, PPO's many small updates slow down tenfold (spinning threads).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]  # the repository, benchmarks/, recipes/

from common import add_output_arguments, provenance, result_topic, results_dir, write_results  # noqa: E402
from fidelity_pusht_chunks import coverage_summary  # noqa: E402

from cosmos3_gym.agents import SB3PolicyAgent, save_sb3_policy  # noqa: E402
from cosmos3_gym.statistics import wilson_interval  # noqa: E402
from cosmos3_gym.tasks.pusht import episodes as pusht  # noqa: E402
from cosmos3_gym.tasks.pusht.compare import PolicyRun, simulate_policy  # noqa: E402
from cosmos3_gym.tasks.pusht.sim_env import make_pusht_sim_env, pusht_sim_env_arguments  # noqa: E402

SMOKE = dict(timesteps=16, num_envs=2, n_steps=4, batch_size=8, n_epochs=1, eval_points=2, eval_episodes=2,
             chunks_per_episode=2, obs_size=48)
WORLDS = ("world_model", "simulator")


# ---------------------------------------------------------------------------------------------------------------
# Training worlds
# ---------------------------------------------------------------------------------------------------------------


def training_log_wrapper():
    from stable_baselines3.common.vec_env import VecEnvWrapper

    class TrainingLog(VecEnvWrapper):
        """Times the wrapped env's reset / step, counts steps on a tqdm bar and records each finished episode's
        return and last ``score`` (``info["score"]``: the reward model's estimate or the true coverage)."""

        def __init__(self, venv, bar=None):
            super().__init__(venv)
            self.env_seconds = 0.0
            self.bar = bar
            self.episodes: list[dict[str, float]] = []
            self._returns = np.zeros(self.num_envs)

        def reset(self):
            started = time.perf_counter()
            observations = self.venv.reset()
            self.env_seconds += time.perf_counter() - started
            self._returns[:] = 0.0
            return observations

        def step_wait(self):
            started = time.perf_counter()
            observations, rewards, dones, infos = self.venv.step_wait()
            self.env_seconds += time.perf_counter() - started
            self._returns += rewards
            for i in np.flatnonzero(dones):
                self.episodes.append({"return": float(self._returns[i]),
                                      "final_score": float(infos[i].get("score", math.nan)),
                                      "length": int(infos[i].get("elapsed_steps", 0))})
                self._returns[i] = 0.0
            if self.bar is not None:
                self.bar.update(self.num_envs)
            return observations, rewards, dones, infos

    return TrainingLog


def make_world_model_vec_env(engine, assets_dir: Path, num_envs: int, chunks: int, obs_size: int):
    """``cosmos3_gym/PushT-v0`` with ``num_envs`` slots as an SB3 VecEnv (SAME_STEP autoreset)."""
    from gymnasium.vector import AutoresetMode

    from cosmos3_gym.envs.sb3 import SB3VecEnv
    from cosmos3_gym.tasks.pusht.env import make_pusht_vector_env

    vector_env = make_pusht_vector_env(num_envs, assets_dir=assets_dir, engine=engine, max_episode_steps=chunks,
                                       observation_size=(obs_size, obs_size), autoreset_mode=AutoresetMode.SAME_STEP)
    return SB3VecEnv(vector_env)


def make_simulator_vec_env(assets_dir: Path, num_envs: int, chunks: int, obs_size: int, subprocess: bool):
    """``PushTSimEnv`` x ``num_envs`` as an SB3 ``DummyVecEnv`` (or ``SubprocVecEnv``)."""
    from functools import partial

    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    factories = [partial(make_pusht_sim_env, str(assets_dir), max_episode_steps=chunks,
                         observation_size=(obs_size, obs_size)) for _ in range(num_envs)]
    return SubprocVecEnv(factories) if subprocess else DummyVecEnv(factories)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation in the real simulator
# ---------------------------------------------------------------------------------------------------------------


def summarise_coverage(coverage: np.ndarray) -> dict[str, Any]:
    """Coverage ``[episodes, steps + 1]`` -> final / max coverage and success, with 95 % CIs."""
    summary = coverage_summary(coverage)
    successes = int((coverage > pusht.SUCCESS_COVERAGE).any(axis=1).sum())
    summary["success_rate_wilson95"] = list(wilson_interval(successes, len(coverage)))
    return summary


def evaluate_in_simulator(run: PolicyRun, agent, eval_seeds: list[int], chunks: int, chunk: int, image_size,
                          stats, seed: int) -> tuple[dict[str, Any], float]:
    """``run`` (acting with ``agent`` for kind "ppo") on the held-out starts, as ``compare.py`` runs policies."""
    started = time.perf_counter()
    _, _, coverage = simulate_policy(run, eval_seeds, chunks, chunk, image_size, stats, agent, seed)
    return summarise_coverage(coverage), time.perf_counter() - started


# ---------------------------------------------------------------------------------------------------------------
# One PPO run
# ---------------------------------------------------------------------------------------------------------------


def train_and_evaluate(world: str, vec_env, args, segments: int, steps_per_segment: int, evaluate,
                       policy_path: Path) -> dict:
    """PPO in ``vec_env`` for ``segments`` x ``steps_per_segment`` env steps, evaluated in the simulator before
    training and after each segment; the trained policy is saved to ``policy_path``."""
    from stable_baselines3 import PPO
    from tqdm.auto import tqdm

    bar = tqdm(total=segments * steps_per_segment, desc=f"PPO in the {world.replace('_', ' ')}", unit="step",
               disable=args.no_progress)
    env = training_log_wrapper()(vec_env, bar)
    model = PPO(
        "MultiInputPolicy", env, n_steps=args.n_steps, batch_size=min(args.batch_size, args.n_steps * args.num_envs),
        n_epochs=args.n_epochs, learning_rate=args.learning_rate, gamma=args.gamma, seed=args.seed,
        device=args.device, verbose=0,
        policy_kwargs=dict(net_arch=[args.hidden], features_extractor_kwargs=dict(cnn_output_dim=args.hidden)),
    )
    initial_weights = {key: value.detach().cpu().clone() for key, value in model.policy.state_dict().items()}
    curve = []
    point = {"env_steps": 0, "train_s": 0.0, "env_s": 0.0, "ppo_s": 0.0}
    point.update(evaluate(model))
    curve.append(point)
    total = {"train_s": 0.0, "env_s": 0.0, "eval_s": point["eval_s"]}
    try:
        for _ in range(segments):
            episodes_before, env_before = len(env.episodes), env.env_seconds
            started = time.perf_counter()
            model.learn(total_timesteps=steps_per_segment, reset_num_timesteps=False)
            train_s = time.perf_counter() - started
            env_s = env.env_seconds - env_before
            finished = env.episodes[episodes_before:]
            point = {
                "env_steps": int(model.num_timesteps),
                "train_s": train_s,
                "env_s": env_s,
                "ppo_s": train_s - env_s,
                "train_env": {
                    "episodes": len(finished),
                    "mean_return": float(np.mean([e["return"] for e in finished])) if finished else math.nan,
                    "mean_final_score": float(np.mean([e["final_score"] for e in finished])) if finished else math.nan,
                },
            }
            point.update(evaluate(model))
            curve.append(point)
            total["train_s"] += train_s
            total["env_s"] += env_s
            total["eval_s"] += point["eval_s"]
            print(f"{world}: {point['env_steps']} steps, real final coverage "
                  f"{point['final_coverage']['mean']:.3f}, train {train_s:.0f} s (env {env_s:.0f} s)", flush=True)
    finally:
        bar.close()
        env.close()
    save_sb3_policy(model, policy_path, world=world, env_steps=int(model.num_timesteps), seed=args.seed,
                    trained_by="benchmarks/recipes/rl_imagination_pusht.py")
    print(f"wrote {policy_path}", flush=True)
    return {
        "policy_file": policy_path.name,
        "curve": curve,
        "num_timesteps": int(model.num_timesteps),
        "train_s": total["train_s"],
        "train_env_s": total["env_s"],
        "train_ppo_s": total["train_s"] - total["env_s"],
        "eval_s": total["eval_s"],
        "train_s_per_env_step": total["train_s"] / max(1, model.num_timesteps),
        "initial_weights": initial_weights,
    }


# ---------------------------------------------------------------------------------------------------------------


def card_name(device: str) -> str:
    """"cpu", or the GPU's model in lower case (e.g. "h100") for the results file name."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower().replace("nvidia", "")
    match = re.search(r"[a-z]+\d+[a-z]*", name)
    return match.group(0) if match else re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "gpu"


def plot_curves(results: dict, path: Path) -> str:
    """The learning curves as a PNG; returns its path, or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("final_coverage", "max_coverage")):
        for world, label in (("world_model", "PPO in the world model"), ("simulator", "PPO in the simulator")):
            curve = results["agents"][world]["curve"]
            steps = [p["env_steps"] for p in curve]
            mean = np.array([p[metric]["mean"] for p in curve])
            low = np.array([p[metric]["ci95_low"] for p in curve])
            high = np.array([p[metric]["ci95_high"] for p in curve])
            ax.plot(steps, mean, marker="o", label=label)
            ax.fill_between(steps, low, high, alpha=0.2)
        random = results["random"][metric]
        ax.axhline(random["mean"], color="gray", linestyle="--", label="random actions")
        ax.set_xlabel("env steps (chunks) of training")
        ax.set_ylabel(f"{metric.replace('_', ' ')} in the real simulator")
        ax.legend(fontsize=8)
    fig.suptitle("PushT: PPO in imagination vs in the simulator (95 % CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the installed built-in one)")
    parser.add_argument("--timesteps", type=int, default=512, help="env steps (chunks) of PPO in each world")
    parser.add_argument("--num-envs", type=int, default=8, help="parallel envs (world-model slots) in each world")
    parser.add_argument("--chunks-per-episode", type=int, default=8, help="episode length in chunks (both worlds)")
    parser.add_argument("--obs-size", type=int, default=64, help="side of the observed image (both worlds)")
    parser.add_argument("--eval-points", type=int, default=4, help="evaluations during training (plus one before)")
    parser.add_argument("--eval-episodes", type=int, default=16, help="held-out simulator starts per evaluation")
    parser.add_argument("--eval-seed", type=int, default=20_000, help="first gym-pusht seed of the held-out starts")
    parser.add_argument("--stochastic-eval", action="store_true", help="sample actions when evaluating")
    parser.add_argument("--n-steps", type=int, default=8, help="PPO rollout length per env")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-epochs", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--hidden", type=int, default=64, help="CNN feature and MLP width")
    parser.add_argument("--subproc", action="store_true", help="simulator envs in SubprocVecEnv processes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, under a minute)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    add_output_arguments(parser)
    parser.add_argument("--results-name", default=None, help="default: rl_imagination_pusht_<cpu|gpu>.json")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    for name in ("timesteps", "num_envs", "chunks_per_episode", "eval_points", "eval_episodes", "n_steps",
                 "batch_size", "n_epochs", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_episodes < 2:
        parser.error("--eval-episodes must be >= 2 (confidence intervals)")
    if args.threads:
        torch.set_num_threads(args.threads)
    pusht.require_gym_pusht()

    from cosmos3_gym.engine import Cosmos3Engine
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets

    started_all = time.perf_counter()
    assets = load_pusht_assets(args.assets)
    sim_arguments = pusht_sim_env_arguments(assets.root)
    stats, chunk, image_size = sim_arguments["action_stats"], sim_arguments["chunk"], sim_arguments["image_size"]
    train_seeds = sim_arguments["start_seeds"]
    eval_seeds = list(range(args.eval_seed, args.eval_seed + args.eval_episodes))
    if set(eval_seeds) & set(train_seeds):
        parser.error(f"--eval-seed: held-out starts {sorted(set(eval_seeds) & set(train_seeds))} are training starts")

    rollout = args.n_steps * args.num_envs
    iterations = max(1, math.ceil(args.timesteps / (args.eval_points * rollout)))
    steps_per_segment = iterations * rollout
    settings = {key: getattr(args, key) for key in (
        "timesteps", "num_envs", "chunks_per_episode", "obs_size", "eval_points", "eval_episodes", "eval_seed",
        "stochastic_eval", "n_steps", "batch_size", "n_epochs", "learning_rate", "gamma", "hidden", "subproc",
        "smoke", "device", "seed")}
    settings.update({
        "timesteps_actual": args.eval_points * steps_per_segment,
        "steps_per_eval_point": steps_per_segment,
        "ppo_updates_per_eval_point": iterations,
        "chunk": chunk,
        "steps_per_episode": args.chunks_per_episode * chunk,
        "image_size": list(image_size),
        "threads": torch.get_num_threads(),
        "policy": "SB3 PPO MultiInputPolicy (NatureCNN on the image)",
    })
    timings: dict[str, float] = {}
    random_run = PolicyRun("random", "random")
    ppo_run = PolicyRun("ppo", "ppo")  # the policy in training, acting through an SB3PolicyAgent, not a file

    card = card_name(args.device)
    name = args.results_name or f"rl_imagination_pusht_{card}.json"
    out = results_dir(args.out, result_topic(name))

    def policy_path(world: str) -> Path:
        return out / f"{Path(name).stem}_{world}_policy.safetensors"

    def evaluate(model) -> dict[str, Any]:
        agent = SB3PolicyAgent(model, deterministic=not args.stochastic_eval)
        summary, seconds = evaluate_in_simulator(ppo_run, agent, eval_seeds, args.chunks_per_episode, chunk,
                                                 image_size, stats, args.seed)
        return {**summary, "eval_s": seconds}

    random_summary, timings["random_eval_s"] = evaluate_in_simulator(
        random_run, None, eval_seeds, args.chunks_per_episode, chunk, image_size, stats, args.seed)
    print(f"random actions: real final coverage {random_summary['final_coverage']['mean']:.3f}", flush=True)

    started = time.perf_counter()
    engine = Cosmos3Engine.from_pretrained(assets.checkpoint, device=args.device, progress=False)
    timings["engine_load_s"] = time.perf_counter() - started
    agents: dict[str, dict] = {}
    try:
        world_model_env = make_world_model_vec_env(engine, assets.root, args.num_envs, args.chunks_per_episode,
                                                   args.obs_size)
        spaces = {"observation": str(world_model_env.observation_space), "action": str(world_model_env.action_space)}
        agents["world_model"] = train_and_evaluate("world_model", world_model_env, args, args.eval_points,
                                                   steps_per_segment, evaluate, policy_path("world_model"))
    finally:
        engine.close()
    sim_env = make_simulator_vec_env(assets.root, args.num_envs, args.chunks_per_episode, args.obs_size, args.subproc)
    if str(sim_env.observation_space) != spaces["observation"] or str(sim_env.action_space) != spaces["action"]:
        raise RuntimeError(f"the simulator's spaces {sim_env.observation_space} / {sim_env.action_space} differ from "
                           f"the world model's {spaces}")
    agents["simulator"] = train_and_evaluate("simulator", sim_env, args, args.eval_points, steps_per_segment,
                                             evaluate, policy_path("simulator"))
    first, second = (agents[world].pop("initial_weights") for world in WORLDS)
    same_start = first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    timings["total_s"] = time.perf_counter() - started_all
    for world in WORLDS:
        timings[f"{world}_train_s"] = agents[world]["train_s"]
        timings[f"{world}_eval_s"] = agents[world]["eval_s"]

    results: dict[str, Any] = {
        "settings": settings,
        "assets": str(assets.root),
        "spaces": spaces,
        "starts": {"train": "the shipped start frames (world model) and their gym-pusht seeds (simulator)",
                   "num_train_starts": len(train_seeds), "eval_sim_seeds": eval_seeds},
        "rewards": {"world_model": "reward model's coverage estimate on the chunk's last generated frame",
                    "simulator": "gym-pusht's true coverage after the chunk's last step"},
        "same_initial_policy": bool(same_start),
        "random": random_summary,
        "agents": agents,
        "timings": timings,
    }
    results = {"provenance": provenance(["benchmarks/recipes/rl_imagination_pusht.py",
                                         *(sys.argv[1:] if argv is None else argv)]), **results}
    path = write_results(results, name, str(out), args.overwrite, args=args)
    results["plot"] = plot_curves(results, path.with_suffix(".png"))
    write_results(results, name, str(out), args.overwrite, args=args)
    print_summary(results)
    return results


def print_summary(results: dict) -> None:
    def cell(summary: dict) -> str:
        return f"{summary['final_coverage']['mean']:.3f} / {summary['max_coverage']['mean']:.3f} / " \
               f"{summary['success_rate']['mean']:.2f}"

    print("real-simulator final coverage / max coverage / success rate")
    print(f"  random actions: {cell(results['random'])}")
    for world in WORLDS:
        entry = results["agents"][world]
        for point in entry["curve"]:
            print(f"  PPO in {world:11s} @ {point['env_steps']:6d} steps: {cell(point)}")
        print(f"  PPO in {world}: train {entry['train_s']:.0f} s (env {entry['train_env_s']:.0f} s, PPO "
              f"{entry['train_ppo_s']:.0f} s), eval {entry['eval_s']:.0f} s")


if __name__ == "__main__":
    main()
