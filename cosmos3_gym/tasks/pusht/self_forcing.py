"""Self-forcing with a consistent target (issue 42 item 3): training samples that start from the world model's own
frame and continue the way the simulator continues *that* frame.

In an env rollout every chunk after the first is conditioned on the model's own last frame, and a model trained only
on real frames compounds its own errors chunk after chunk (exposure bias: the block error grows about linearly with
the chunk count, while restarting each chunk from the real frame keeps it at 2-3 px). Conditioning training on the
model's own frames with the *real* continuation as the target was tried twice (``training/rollout.py``; RESULTS.md,
round 10) and made untouched blocks drift twice as far: the real continuation starts where the real block is, not
where the model put it, so the model learned to move blocks towards a truth it could not see.

Here target and condition agree. The model replays a training episode's actions open loop from one of its real
frames, exactly as the env runs (``replay_actions``: sampler, decode, uint8 hand-over); after each chunk the state is
read off its last frame (the agent's disc and the best-fitting rigid T, as ``readoff.read_state``), gym-pusht is put in
that state, and the simulator's continuation under the episode's next action chunk is the target. The states are
the model's own, the labels the simulator's: a DAgger-style world model. A frame shows no velocity; the agent gets
its velocity in the real episode at that step (the agent follows its actions in the model, and its PD-controlled
velocity carries into the next steps: with it the continuation from a frame's read-off state lands the block 0.65 px
from the real one after a chunk, without it 1.35 px); the block, which friction stops within a step, none.

Each sample is an episode of one chunk in the layout training reads (``episodes.py``): ``frames [chunk + 1]``, the
generated frame then the simulator's, with ``actions``, ``coverage``, ``rewards`` and ``sim_states`` of the
continuation. ``success`` is False whatever the continuation reaches: its actions were chosen for another state, so
policy mode must not imitate them (``WorldModelTrainConfig.policy_episodes="successful"``). A frame whose agent or
block cannot be read, or whose fitted T is less rigid than ``min_rigidity`` (a melted T's pose is a guess), gives no
sample. Needs gym-pusht (the ``sim`` extra).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError
from ...processor import ActionStats
from .compare import replay_actions
from .dataset import map_in_simulator_processes, save_npz
from .geometry import SUCCESS_COVERAGE
from .readoff import read_positions
from .reward import fit_tee
from .sim import SIM_STATE_FIELDS, PushTSim, drawn, require_gym_pusht

__all__ = ["SELF_FORCING_EPISODE_PREFIX", "generate_self_forcing_episodes", "plan_rollouts", "sample_sheet"]

SELF_FORCING_EPISODE_PREFIX = "episode_sf_"  # matches the layout's episode_*.npz, apart from simulated episodes
_AGENT_VELOCITY = slice(2, 4)  # SIM_STATE_FIELDS' agent_vx, agent_vy
FIT_BATCH = 1024  # frames per rigid-T fit: [N, 3, 256, 256] float32 is 0.8 GB at 1024


def plan_rollouts(
    episode_lengths: list[int], rollouts_per_episode: int, depth: int, chunk: int, seed: int
) -> list[tuple[int, int]]:
    """``(episode, start)`` of each rollout: ``rollouts_per_episode`` per episode long enough for ``depth`` generated
    chunks and one continuation chunk, each start drawn uniformly from those that fit (from ``seed`` alone)."""
    for name, value in (("rollouts_per_episode", rollouts_per_episode), ("depth", depth), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"{name}: expected an integer >= 1, got {value!r}.")
    rng = np.random.default_rng([int(seed), 42])
    span = (depth + 1) * chunk
    plan = []
    for episode, length in enumerate(episode_lengths):
        if length >= span:
            plan += [(episode, int(s)) for s in rng.integers(0, length - span + 1, size=rollouts_per_episode)]
    return plan


def generate_self_forcing_episodes(
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    vector_env: Any,
    *,
    stats: ActionStats,
    rollouts_per_episode: int = 2,
    depth: int = 8,
    min_rigidity: float = 0.5,
    seed: int = 0,
    workers: int | None = None,
    fit_device: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write self-forcing samples (module docstring) of the simulated episodes in ``source_dir`` (the layout of
    ``generate_pusht_dataset``, with ``sim_states``) into ``out_dir`` (``episodes/``, ``meta.json`` and the source's
    ``stats.json``). Returns the counts.

    ``vector_env``: the world-model vector env to roll out (``make_pusht_vector_env(..., return_frames=True)``); its
    slots run ``rollouts_per_episode`` rollouts per episode in batches, each ``depth`` chunks from a random real frame
    (``plan_rollouts``), and every chunk's last frame becomes a sample. ``stats``: the model's action statistics
    (the episodes' raw actions are normalised with them). ``workers``: simulator processes for the continuations;
    ``fit_device``: where the rigid T is fitted (the GPU the env runs on)."""
    require_gym_pusht()
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if not 0.0 <= float(min_rigidity) <= 1.0:
        raise InputError(f"min_rigidity: expected a number in [0, 1], got {min_rigidity!r}.")
    paths = sorted((source_dir / "episodes").glob("episode_*.npz"))
    if not paths:
        raise InputError(f"source_dir: no episodes/episode_*.npz in {source_dir}")
    episode_dir = out_dir / "episodes"
    if episode_dir.exists() and any(episode_dir.iterdir()):
        raise InputError(f"out_dir: {out_dir} already holds episodes; give a new or empty folder.")
    episode_dir.mkdir(parents=True, exist_ok=True)
    chunk = int(vector_env.single_action_space.shape[0])
    slots = int(vector_env.num_envs)

    sources = []  # actions, sim_states, sim_seed and task of each episode (frames only at rollout starts)
    for path in paths:
        with np.load(path, allow_pickle=False) as episode:
            if "sim_states" not in episode.files:
                raise InputError(f"source_dir: {path} has no sim_states (simulated by generate_pusht_dataset?)")
            sources.append({key: episode[key] for key in ("actions", "sim_states", "sim_seed", "task")})
    plan = plan_rollouts([len(s["actions"]) for s in sources], rollouts_per_episode, depth, chunk, seed)
    if not plan:
        raise InputError(f"depth: no episode of {source_dir} holds {depth} + 1 chunks of {chunk} actions")
    starts_of: dict[int, list[int]] = {}
    for episode, start in plan:
        starts_of.setdefault(episode, []).append(start)
    start_frames: dict[tuple[int, int], np.ndarray] = {}
    for episode, starts in starts_of.items():
        with np.load(paths[episode], allow_pickle=False) as data:
            frames = data["frames"]
            for start in starts:
                start_frames[(episode, start)] = frames[start]

    from tqdm.auto import tqdm

    jobs: list[tuple] = []
    read_failures = 0
    rigidities: list[tuple[int, float]] = []  # (depth, rigidity of the fitted T) of every generated frame
    batches = range(0, len(plan), slots)
    for batch_index, first in enumerate(tqdm(batches, desc="self-forcing rollouts", disable=not progress)):
        rows = plan[first : first + slots]
        padded = rows + [rows[0]] * (slots - len(rows))  # the env has a fixed slot count; extra slots are dropped
        raw = np.stack([sources[e]["actions"][s : s + depth * chunk] for e, s in padded])
        actions = np.clip(stats.normalize(raw.astype(np.float32)), -1.0, 1.0).reshape(slots, depth, chunk, -1)
        first_frames = np.stack([start_frames[row] for row in padded])
        generated = replay_actions(vector_env, first_frames, actions, seed=int(seed) + batch_index)[: len(rows), :, -1]
        flat = generated.reshape(-1, *generated.shape[2:])  # [rows * depth, H, W, 3], chunk after chunk per row
        agent_xy, block_pose, fit_rigidity = read_off(flat, fit_device)
        readable = (fit_rigidity >= float(min_rigidity)) & np.isfinite(agent_xy).all(axis=1)
        read_failures += int((~readable).sum())
        rigidities += [(k % depth + 1, float(np.nan_to_num(r))) for k, r in enumerate(fit_rigidity)]
        for k in np.flatnonzero(readable):
            (episode, start), d = rows[k // depth], k % depth + 1
            t = start + d * chunk  # the generated frame stands for real frame t
            source = sources[episode]
            state = np.zeros(len(SIM_STATE_FIELDS))
            state[0:2], state[4:7] = agent_xy[k], block_pose[k]
            state[_AGENT_VELOCITY] = source["sim_states"][t][_AGENT_VELOCITY]
            name = f"{SELF_FORCING_EPISODE_PREFIX}{len(jobs):06d}"
            jobs.append(
                (
                    str(episode_dir / f"{name}.npz"),
                    flat[k],
                    state,
                    source["actions"][t : t + chunk],
                    {
                        "task": source["task"],
                        "sim_seed": source["sim_seed"],
                        "source": paths[episode].stem,
                        "t": t,
                        "fit_rigidity": float(fit_rigidity[k]),
                    },
                    d,
                )
            )
    summaries = map_in_simulator_processes(
        _continue_and_write, jobs, workers, fresh_workers=True, desc="simulator continuations", progress=progress
    )
    by_depth = np.bincount([job[-1] for job in jobs], minlength=depth + 1)[1:]
    report = {
        "samples": len(jobs),
        "rollouts": len(plan),
        "depth": int(depth),
        "frames_not_readable": read_failures,
        "samples_by_depth": by_depth.tolist(),
        "min_rigidity": float(min_rigidity),
        # How well a rigid T explains the model's frames, chunk by chunk: the share of samples a stricter
        # min_rigidity would keep (0 for a frame with no block).
        "fit_rigidity_by_depth": {
            str(d): _quantiles([r for depth_of, r in rigidities if depth_of == d]) for d in range(1, depth + 1)
        },
        "mean_final_coverage": float(np.mean([s["final_coverage"] for s in summaries])) if summaries else None,
    }
    meta = json.loads((source_dir / "meta.json").read_text())
    meta.pop("success_rate", None)  # the samples' success is False by construction
    meta.update(
        num_episodes=len(jobs),
        policies={"self_forcing": len(jobs)},
        steps_per_episode=chunk,
        source_dataset=str(source_dir),
        seed=int(seed),
        mean_final_coverage=report["mean_final_coverage"],
        self_forcing=report,
    )
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.copyfile(source_dir / "stats.json", out_dir / "stats.json")
    return report


def read_off(frames: np.ndarray, device: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(agent ``[N, 2]``, NaN where not visible; block pose ``[N, 3]``; rigidity ``[N]`` of the fitted T, NaN where
    no block is visible) of uint8 frames ``[N, H, W, 3]``: ``readoff.read_state``'s reading, with the fit's rigidity,
    fitted on ``device`` ``FIT_BATCH`` frames at a time (a GPU fits thousands in the time a CPU core fits one)."""
    import torch

    agent, pose, rigidity = [], [], []
    for i in range(0, len(frames), FIT_BATCH):
        batch = np.ascontiguousarray(frames[i : i + FIT_BATCH])
        fit = fit_tee(torch.from_numpy(batch).to(device or "cpu"))
        agent.append(read_positions(batch)[0])
        pose.append(fit.pose.double().cpu().numpy())
        rigidity.append(torch.where(fit.valid, fit.rigidity.double(), float("nan")).cpu().numpy())
    return np.concatenate(agent), np.concatenate(pose), np.concatenate(rigidity)


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"frames": 0, "p10": None, "median": None, "p90": None, "at_least_0.9": None}
    array = np.asarray(values)
    p10, median, p90 = np.quantile(array, [0.1, 0.5, 0.9]).tolist()
    return {
        "frames": len(array),
        "p10": p10,
        "median": median,
        "p90": p90,
        "at_least_0.9": float((array >= 0.9).mean()),
    }


_WORKER_SIMS: dict[tuple[int, int], PushTSim] = {}  # one simulator per process and frame size


def _continue_and_write(job) -> dict[str, Any]:
    """Put gym-pusht in the read-off state, step the chunk's actions and write the sample (module docstring)."""
    path, generated, state, actions, fields, depth = job
    size = tuple(generated.shape[:2])
    if size not in _WORKER_SIMS:
        _WORKER_SIMS[size] = PushTSim(size)
    sim = _WORKER_SIMS[size]
    sim.restore(state)
    states, coverage, rewards, frames = [sim.sim_state], [sim.coverage], [], [generated]
    for action in actions:
        frames.append(drawn(sim.step(action)))
        states.append(sim.sim_state)
        coverage.append(sim.coverage)
        rewards.append(sim.reward)
    save_npz(
        path,
        {
            "frames": np.stack(frames).astype(np.uint8, copy=False),
            "actions": np.asarray(actions, np.float32),
            "rewards": np.asarray(rewards, np.float32),
            "coverage": np.asarray(coverage, np.float32),
            "success": np.asarray(False),
            "sim_seed": np.asarray(fields["sim_seed"], np.int64),
            "sim_states": np.stack(states),
            "task": np.asarray(fields["task"]),
            "policy": np.asarray(f"self_forcing(depth={depth}, source={fields['source']}, t={fields['t']})"),
            "fit_rigidity": np.asarray(fields["fit_rigidity"], np.float32),  # of the T fitted to frame 0
        },
    )
    return {"final_coverage": float(coverage[-1]), "reached_success": bool(max(coverage) > SUCCESS_COVERAGE)}


def sample_sheet(dataset_dir: str | os.PathLike, count: int = 6, columns: tuple[int, ...] = (0, 1, 4, 8)) -> np.ndarray:
    """uint8 ``[count * H, len(columns) * W, 3]``: ``count`` self-forcing samples of ``dataset_dir``, spread over it,
    one a row; each row the generated frame (column 0) and the simulator's frames at the other ``columns``."""
    paths = sorted((Path(dataset_dir) / "episodes").glob(f"{SELF_FORCING_EPISODE_PREFIX}*.npz"))
    if not paths:
        raise InputError(f"dataset_dir: no self-forcing samples in {dataset_dir}")
    rows = []
    for path in paths[:: max(1, len(paths) // count)][:count]:
        with np.load(path, allow_pickle=False) as sample:
            frames = sample["frames"]
        rows.append(np.concatenate([frames[min(c, len(frames) - 1)] for c in columns], axis=1))
    return np.concatenate(rows, axis=0)
