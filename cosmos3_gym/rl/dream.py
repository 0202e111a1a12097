"""Imagined datasets: roll a policy in the world model and write the episodes as a LeRobot v3.0 dataset
(``cosmos3-gym dream``).

World models make training data as well as scores: fine-tuning a policy on its imagined successes (Ctrl-World) or
labelling imagined videos with inverse dynamics (DreamGen). ``dream(env, policy, episodes, out)`` runs the policy
with ``evaluation.evaluate_policy`` (the same episode accounting: exactly the episodes ``0 .. episodes - 1`` count,
whatever their lengths; a remote policy's failed episodes are dropped) and records every counted episode:

* frames: the start frame and the ``chunk`` generated frames of every step (the env's ``info["frames"]``: make it with
  ``return_frames=True``), at the model's frame size, written as H.264 video (feature ``observation.image``);
* actions: one per frame transition, in raw units (the env's ``action_stats``; without statistics, the normalised
  actions, with statistics of [-1, 1]); ``label_actions="inverse-dynamics"`` replaces the policy's actions by what
  ``agents.InverseDynamicsAgent`` infers from the imagined frames (video-only dreams, DreamGen-style);
* ``next.reward``: the env's reward of a step on the row of the step's last action (0 on the other rows), so the
  rewards of an episode sum to its return; ``next.done`` on its last row; ``next.success`` (when success is
  defined) on the last row of a successful episode; the task string of every episode.

``keep="successes"`` writes only the successful episodes (a reward-filtered dataset). The dataset's action
statistics (``meta/stats.json``) are the recorded actions', with the normalising block (min/max, mean/std or
q01/q99) replaced by the env's, so a policy trained on the dataset normalises as the world model does.

The episodes are first written in this package's episode layout (``data.episodes``, compressed) in a temporary
folder next to ``out``, then converted by ``data.lerobot.write_lerobot_dataset``, which keeps one episode in
memory at a time; the reward and done columns are then added to its data files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..data.lerobot import LEROBOT_PREFIX, write_lerobot_dataset
from ..errors import InputError
from ..evaluation import EpisodeResult, EvalReport, evaluate_policy, load_policy, make_checkpoint_env

__all__ = ["LABELS", "DreamResult", "dream", "dream_checkpoint"]

LABELS = ("policy", "inverse-dynamics")
KEEP = ("all", "successes")
CAMERA = "observation.image"


@dataclass
class DreamResult:
    """What ``dream`` wrote: the dataset folder, the episodes it holds, and the evaluation report of all the counted
    episodes (kept or not)."""

    path: Path
    episodes_written: int
    report: EvalReport
    label_actions: str
    keep: str

    def summary(self) -> str:
        overall = self.report.overall
        rate = "n/a" if overall.success_rate is None else f"{overall.success_rate:.2f}"
        return (
            f"dreamed {overall.episodes} episodes (success rate {rate}, mean return {overall.mean_return:.4g}); "
            f"wrote {self.episodes_written} ({self.keep}, actions from {self.label_actions}) to {self.path}"
        )


def _out_path(out: str | os.PathLike) -> Path:
    text = str(out)
    path = Path(text[len(LEROBOT_PREFIX) :] if text.startswith(LEROBOT_PREFIX) else text).expanduser()
    if (path / "meta" / "info.json").exists():
        raise InputError(f"out: {path} already holds a LeRobot dataset; give a new or empty folder")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InputError(f"out: {path} exists and is not an empty folder; give a new or empty folder")
    return path


class _Recorder:
    """Keeps the running episodes of every slot and writes each finished one to the episode layout."""

    def __init__(self, folder: Path, env: Any, keep: str, label: Callable[[np.ndarray, str], np.ndarray] | None):
        self.folder, self.keep, self.label = folder, keep, label
        self.stats = getattr(env, "action_stats", None)
        self.running: dict[int, dict[str, Any]] = {}
        self.written = 0
        self.frame_hw: tuple[int, int] | None = None
        self.raw_actions: list[np.ndarray] = []
        (folder / "episodes").mkdir(parents=True, exist_ok=True)

    def start(self, episode: int, slot: int, observation: Any, info: dict) -> None:
        image = observation.get("image") if isinstance(observation, dict) else observation
        self.running[episode] = {"start": np.asarray(image), "frames": [], "actions": [], "rewards": []}

    def step(self, episode: int, slot: int, action: np.ndarray, reward: float, info: dict) -> None:
        if "frames" not in info:
            raise InputError("env: dream needs the generated frames; make the env with return_frames=True.")
        record = self.running[episode]
        record["frames"].append(np.asarray(info["frames"], dtype=np.uint8))
        record["actions"].append(np.asarray(action, dtype=np.float32).reshape(len(info["frames"]), -1))
        record["rewards"].append(float(reward))

    def finish(self, result: EpisodeResult) -> None:
        record = self.running.pop(result.episode)
        if result.error is not None or not record["frames"]:
            return  # a policy failure: not a recording of the policy
        if self.keep == "successes" and not result.success:
            return
        generated = np.concatenate(record["frames"])
        self.frame_hw = tuple(generated.shape[1:3])
        start = record["start"]
        if start.shape != generated.shape[1:]:  # an observation_size env observes smaller frames
            from ..data.initial_states import resize_frame

            start = resize_frame(start, self.frame_hw)
        frames = np.concatenate([start[None], generated]).astype(np.uint8)
        actions = np.concatenate(record["actions"])  # normalised [T, dim], as the env took them
        if self.label is not None:
            actions = np.asarray(self.label(frames, result.task), dtype=np.float32)
        raw = actions if self.stats is None else np.asarray(self.stats.denormalize(actions), dtype=np.float32)
        steps = len(record["rewards"])
        per_step = len(actions) // steps
        rewards = np.zeros(len(actions), np.float32)
        rewards[per_step - 1 :: per_step] = record["rewards"]  # each step's reward on its last action's row
        arrays: dict[str, Any] = {
            "frames": frames,
            "actions": raw.astype(np.float32),
            "task": np.array(result.task),
            "rewards": rewards,
        }
        if result.success is not None:
            arrays["success"] = np.array(bool(result.success))
        np.savez_compressed(self.folder / "episodes" / f"episode_{self.written:06d}.npz", **arrays)
        self.raw_actions.append(raw)
        self.written += 1


def _stats_document(raw_actions: list[np.ndarray], stats: Any) -> dict[str, Any]:
    """The recorded actions' statistics, with the normalising block replaced by ``stats``' (module docstring)."""
    values = np.concatenate(raw_actions).astype(np.float64)
    block = {
        "min": values.min(0),
        "max": values.max(0),
        "mean": values.mean(0),
        "std": values.std(0),
        "q01": np.quantile(values, 0.01, 0),
        "q99": np.quantile(values, 0.99, 0),
    }
    if stats is None:  # normalised actions: the identity mapping
        block["min"], block["max"] = -np.ones(values.shape[1]), np.ones(values.shape[1])
    else:
        offset, scale = np.asarray(stats.offset, np.float64), np.asarray(stats.scale, np.float64)
        if stats.mode == "meanstd":
            block["mean"], block["std"] = offset, scale
        elif stats.mode.startswith("quantile"):
            block["q01"], block["q99"] = offset, offset + scale
        else:
            block["min"], block["max"] = offset, offset + scale
    return {"action": {key: np.asarray(value, np.float64).tolist() for key, value in block.items()}}


def _normalization(stats: Any) -> str:
    """The dataset's ``action_normalization`` for the env's statistics (quantile_rot reads as quantile: the block
    written is the one it uses)."""
    if stats is None:
        return "minmax"
    return "quantile" if stats.mode.startswith("quantile") else stats.mode


def _add_reward_columns(root: Path, rewards: list[np.ndarray]) -> None:
    """``next.reward`` (each frame row's reward; the repeated last row 0) and ``next.done`` in every data file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        episodes = table.column("episode_index").to_numpy()
        frames = table.column("frame_index").to_numpy()
        reward = np.zeros(len(table), np.float32)
        done = np.zeros(len(table), bool)
        for i, (episode, frame) in enumerate(zip(episodes, frames)):
            per_action = rewards[int(episode)]
            reward[i] = per_action[frame] if frame < len(per_action) else 0.0
            done[i] = frame == len(per_action)  # L = T + 1 rows: the last row ends the episode
        table = table.append_column("next.reward", pa.array(reward, pa.float32()))
        table = table.append_column("next.done", pa.array(done))
        pq.write_table(table, path)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["next.reward"] = {"dtype": "float32", "shape": [1], "names": None}
    info["features"]["next.done"] = {"dtype": "bool", "shape": [1], "names": None}
    info_path.write_text(json.dumps(info, indent=2))


def dream(
    env: Any,
    policy: Any,
    episodes: int,
    out: str | os.PathLike,
    *,
    label_actions: str = "policy",
    keep: str = "all",
    inverse_dynamics: Any = None,
    seed: int | None = 0,
    max_episode_steps: int | None = None,
    success_return_threshold: float | None = None,
    reward_bounds: tuple[float, float] | None = None,
    source: str = "",
    crf: int = 18,
    progress: bool = True,
) -> DreamResult:
    """Roll ``policy`` in the world-model vector env ``env`` (made with ``return_frames=True``) for ``episodes``
    episodes and write them to ``out`` (a new folder, ``lerobot:PATH`` or ``PATH``) as a LeRobot v3.0 dataset (see
    the module docstring). ``policy``: anything ``evaluation.evaluate_policy`` takes (``evaluation.load_policy`` of a
    spec). ``label_actions``: "policy" or "inverse-dynamics" (``inverse_dynamics``: the labelling agent, default
    ``InverseDynamicsAgent.from_env(env, seed=seed)``). ``keep``: "all" or "successes". ``crf``: the video's H.264
    quality (0: lossless). ``source``: recorded in the dataset's provenance (meta.json of the episode layout)."""
    if label_actions not in LABELS:
        raise InputError(f"label_actions: expected one of {list(LABELS)}, got {label_actions!r}")
    if keep not in KEEP:
        raise InputError(f"keep: expected one of {list(KEEP)}, got {keep!r}")
    path = _out_path(out)
    label = None
    if label_actions == "inverse-dynamics":
        if inverse_dynamics is None:
            from ..agents import InverseDynamicsAgent

            inverse_dynamics = InverseDynamicsAgent.from_env(env, seed=seed)
        agent = inverse_dynamics

        def label(frames: np.ndarray, task: str) -> np.ndarray:
            return agent.label_video(frames)

    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.dream-", dir=path.parent))
    try:
        recorder = _Recorder(scratch, env, keep, label)
        report = evaluate_policy(
            env,
            policy,
            episodes,
            seed=seed,
            video_dir=None,
            success_return_threshold=success_return_threshold,
            progress=progress,
            max_episode_steps=max_episode_steps,
            reward_bounds=reward_bounds,
            recorder=recorder,
            description="dreaming (env steps)",
        )
        if not recorder.written:
            raise InputError(
                f"dream: none of the {len(report.episodes)} episodes is kept ({keep}); nothing to write to {path}"
            )
        settings = getattr(env, "settings", None)
        domain = getattr(settings, "domain", None)
        fps = getattr(settings, "fps", None) or env.metadata.get("render_fps") or 15.0
        stats = recorder.stats
        meta = {
            "domain": domain if isinstance(domain, (str, int)) else "unknown",
            "raw_action_dim": int(recorder.raw_actions[0].shape[1]),
            "fps": float(fps),
            "image_size": list(recorder.frame_hw or ()),
            "action_normalization": _normalization(stats),
            "num_episodes": recorder.written,
            "source": source or f"cosmos3_gym dream ({label_actions} actions, {keep})",
        }
        (scratch / "meta.json").write_text(json.dumps(meta, indent=2))
        (scratch / "stats.json").write_text(json.dumps(_stats_document(recorder.raw_actions, stats), indent=2))
        write_lerobot_dataset(scratch, path, version="v3.0", camera=CAMERA, crf=crf, progress=progress)
        rewards = []
        for episode_file in sorted((scratch / "episodes").glob("episode_*.npz")):
            with np.load(episode_file) as data:
                rewards.append(np.asarray(data["rewards"], np.float32))
        _add_reward_columns(path, rewards)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return DreamResult(path, recorder.written, report, label_actions, keep)


def dream_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    policy: str,
    episodes: int = 10,
    label_actions: str = "policy",
    keep: str = "all",
    num_envs: int = 1,
    seed: int = 0,
    success_return_threshold: float | None = None,
    crf: int = 18,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    **env_settings: Any,
) -> DreamResult:
    """``dream`` on a checkpoint's env (``evaluation.make_checkpoint_env``: its own settings where ``env_settings``
    give none) with the policy of a spec (``policy_specs``; ``ws://`` servers too): the CLI's ``dream``."""
    path = _out_path(out)  # before the model loads
    if label_actions not in LABELS:
        raise InputError(f"label_actions: expected one of {list(LABELS)}, got {label_actions!r}")
    log = log if log is not None else (lambda message: print(message, file=sys.stderr))
    built = make_checkpoint_env(
        checkpoint, num_envs=num_envs, return_frames=True, log=log, command="dream", **env_settings
    )
    env = built.env
    try:
        agent = load_policy(policy, env, seed=seed)
        return dream(
            env,
            agent,
            episodes,
            path,
            label_actions=label_actions,
            keep=keep,
            seed=seed,
            max_episode_steps=built.settings["max_episode_steps"],
            success_return_threshold=success_return_threshold,
            reward_bounds=built.reward_bounds,
            source=f"cosmos3-gym dream --policy {policy} --checkpoint {built.checkpoint}",
            crf=crf,
            progress=progress,
        )
    finally:
        env.close()
