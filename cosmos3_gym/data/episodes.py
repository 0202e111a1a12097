"""Episode datasets in our layout: the dataset and episode types, the reader and the training-window starts.

The types every dataset reader gives (``DatasetInfo``, ``Episode``) live here, apart from ``data.py`` (the training
windows and their latent cache) and ``lerobot.py`` (LeRobot datasets), so both can use them without importing
each other. Layout::

    DATASET/
      meta.json    {"domain": DOMAIN, "raw_action_dim": 2, "fps": 10.0, "image_size": [H, W],
                    "action_normalization": "minmax", "num_episodes": N, "source": "...", "policies": {...}}
      stats.json   action statistics as processor.ActionStats.from_json reads them:
                   {"action": {"min": [...], "max": [...], "mean": [...], "std": [...], "q01": [...], "q99": [...]}}
      episodes/episode_000000.npz
                   frames uint8 [T+1, H, W, 3]; actions float32 [T, raw_action_dim] (RAW units, not normalised);
                   task (0-d str array); optional: success (0-d bool), rewards [T], coverage [T+1], policy

Action ``t`` takes frame ``t`` to frame ``t + 1``.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import processor
from ..errors import InputError

EPISODES_DIR = "episodes"
EPISODE_GLOB = "episode_*.npz"


@dataclass(frozen=True)
class DatasetInfo:
    """meta.json, the action statistics and the episode files of a dataset."""

    root: Path
    meta: dict
    domain: str | int
    raw_action_dim: int
    fps: float
    action_normalization: str
    stats: processor.ActionStats
    stats_document: dict
    episode_paths: tuple[Path, ...]  # our layout's episode files (empty for a LeRobot dataset)
    # The episodes, read on demand: ``NpzEpisodes`` (our layout) or ``lerobot.LeRobotDataset``. Both give
    # ``len``, ``name(i)``, ``lengths`` (frames), ``load(i, with_frames)`` -> Episode, ``read_frames(i, start, stop)``
    # and ``fingerprint()`` (what the latent cache depends on).
    episodes: Any = None


@dataclass(frozen=True)
class Episode:
    frames: np.ndarray | None  # uint8 [T+1, H, W, 3]; None when loaded without frames
    actions: np.ndarray  # float32 [T, raw_action_dim], raw units
    task: str
    success: bool | None = None  # the optional 'success' array; None when the file has none

    @property
    def num_actions(self) -> int:
        return int(self.actions.shape[0])


class NpzEpisodes:
    """The episodes of our layout (one .npz per episode), read on demand."""

    def __init__(self, paths: tuple[Path, ...], raw_action_dim: int):
        self.paths, self.raw_action_dim = paths, raw_action_dim
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, i: int) -> str:
        return self.paths[i].stem

    def load(self, i: int, with_frames: bool = True) -> Episode:
        return load_episode(self.paths[i], self.raw_action_dim, with_frames=with_frames)

    @property
    def lengths(self) -> list[int]:
        if self._lengths is None:
            self._lengths = [self.load(i, with_frames=False).num_actions + 1 for i in range(len(self))]
        return self._lengths

    def read_frames(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        frames = self.load(i).frames
        assert frames is not None  # loaded with its frames
        return frames[start:stop]

    def fingerprint(self) -> list:
        return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in self.paths]


def read_episode_dataset(dataset_dir: str | os.PathLike, *, domain: str | int | None = None) -> DatasetInfo:
    """Read and check a dataset in our layout (module docstring): meta.json, stats.json and the episode files;
    ``InputError`` names the bad file and field. ``domain`` overrides meta.json's."""
    root = Path(dataset_dir).expanduser()
    if not root.is_dir():
        raise InputError(f"dataset: {root} is not a directory")
    meta_path = root / "meta.json"
    meta = read_json_object(meta_path)
    for key in ("domain", "raw_action_dim", "fps"):
        if key not in meta:
            raise InputError(f"dataset: {meta_path} lacks the field {key!r}")
    raw_action_dim = meta["raw_action_dim"]
    if isinstance(raw_action_dim, bool) or not isinstance(raw_action_dim, int) or raw_action_dim < 1:
        raise InputError(
            f"dataset: {meta_path} field 'raw_action_dim' must be a positive integer, got {raw_action_dim!r}"
        )
    fps = meta["fps"]
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise InputError(f"dataset: {meta_path} field 'fps' must be a positive number, got {fps!r}")
    mode = meta.get("action_normalization", "minmax")
    if mode not in processor.ACTION_NORMALIZATION_MODES:
        raise InputError(
            f"dataset: {meta_path} field 'action_normalization' must be one of "
            f"{list(processor.ACTION_NORMALIZATION_MODES)}, got {mode!r}"
        )
    stats_path = root / "stats.json"
    if not stats_path.is_file():
        raise InputError(f"dataset: missing {stats_path} (action statistics)")
    stats_document = read_json_object(stats_path)
    stats = processor.ActionStats.from_json(stats_document, mode=mode)
    if stats.dim != raw_action_dim:
        raise InputError(
            f"dataset: {stats_path} has {stats.dim}-dim statistics but meta.json says raw_action_dim={raw_action_dim}"
        )
    episode_paths = tuple(sorted((root / EPISODES_DIR).glob(EPISODE_GLOB)))
    if not episode_paths:
        raise InputError(f"dataset: no {EPISODES_DIR}/{EPISODE_GLOB} files in {root}")
    return DatasetInfo(
        root=root,
        meta=meta,
        domain=meta["domain"] if domain is None else domain,
        raw_action_dim=raw_action_dim,
        fps=float(fps),
        action_normalization=mode,
        stats=stats,
        stats_document=stats_document,
        episode_paths=episode_paths,
        episodes=NpzEpisodes(episode_paths, raw_action_dim),
    )


def read_json_object(path: Path) -> dict:
    """A dataset's JSON file that must hold an object (meta.json, LeRobot's info.json and stats.json)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise InputError(f"dataset: cannot read {path} as JSON ({error})") from error
    if not isinstance(value, dict):
        raise InputError(f"dataset: {path} must hold a JSON object")
    return value


def load_episode(path: Path, raw_action_dim: int, *, with_frames: bool = True) -> Episode:
    """One episode file, checked against the layout in the module docstring (frames only when read)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            actions, task = data["actions"], data["task"]
            frames = data["frames"] if with_frames else None
            success = bool(data["success"]) if "success" in data.files else None
    except KeyError as error:
        raise InputError(f"dataset: {path} lacks the array {error.args[0]!r}") from error
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:  # a truncated or damaged archive
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise InputError(f"dataset: cannot read {path} as an .npz file ({first_line})") from error
    if actions.ndim != 2 or actions.shape[1] != raw_action_dim:
        raise InputError(f"dataset: {path} 'actions' must be [T, {raw_action_dim}], got shape {actions.shape}")
    if frames is not None and (frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3):
        raise InputError(f"dataset: {path} 'frames' must be uint8 [T+1, H, W, 3], got {frames.dtype} {frames.shape}")
    if frames is not None and frames.shape[0] != actions.shape[0] + 1:
        raise InputError(
            f"dataset: {path} has {frames.shape[0]} frames and {actions.shape[0]} actions; expected T+1 frames for "
            f"T actions"
        )
    actions = actions.astype(np.float32)
    if not np.isfinite(actions).all():
        raise InputError(f"dataset: {path} 'actions' contains NaN or infinity")
    if task.shape != () or task.dtype.kind not in "US":
        raise InputError(f"dataset: {path} 'task' must be a 0-d string array, got {task.dtype} {task.shape}")
    return Episode(frames=frames, actions=actions, task=str(task), success=success)


def window_starts(num_actions: int, chunk: int, stride: int) -> list[int]:
    """First frames of the windows of an episode with ``num_actions`` actions (empty when shorter than chunk)."""
    return list(range(0, num_actions - chunk + 1, stride))
