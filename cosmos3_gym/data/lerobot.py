"""LeRobot datasets (v3.0 and v2.1) read and written with pyarrow and ffmpeg (imageio-ffmpeg), no ``lerobot`` package.

The ``lerobot`` package pins torch below the versions this project supports, so the published on-disk format is read
directly (shared/reference/rl.md section 5)::

    v3.0                                                     v2.1
    meta/info.json      fps, features, data/video path templates (both)
    meta/stats.json     per-feature min/max/mean/std[/q01/q99]   (v2.1: meta/episodes_stats.jsonl, one line each)
    meta/tasks.parquet  task_index (+ the task string as index)  meta/tasks.jsonl
    meta/episodes/chunk-XXX/file-XXX.parquet                     meta/episodes.jsonl
        per episode: length, tasks, dataset_from/to_index, data/{chunk,file}_index,
        videos/<camera>/{chunk_index,file_index,from_timestamp,to_timestamp}
    data/chunk-XXX/file-XXX.parquet  many episodes per file      data/chunk-XXX/episode_XXXXXX.parquet
    videos/<camera>/chunk-XXX/file-XXX.mp4  many per file        videos/chunk-XXX/<camera>/episode_XXXXXX.mp4

``LeRobotDataset`` streams from disk: the metadata is read once, an episode's tabular rows (only the needed columns)
and its frames (one ffmpeg seek-and-decode of its span of the camera's video) are read when the episode is asked
for. It serves the trainers through ``data.read_dataset("lerobot:PATH")`` (its episodes in the layout of
``data.py``), the envs through ``LeRobotInitialStates`` (the first frame and task of every episode), and users
through ``clips`` (training windows: frames on the model's tier canvas, raw actions, task, episode boundaries).

An episode's ``success`` (our layout's optional flag) is LeRobot's per-frame ``next.success`` (any frame set).

Untrusted datasets. info.json's ``data_path`` / ``video_path`` templates are filled by a formatter that knows only
LeRobot's placeholders (``TEMPLATE_FIELDS``: ``{name}`` or ``{name:03d}``; no attribute access, indexing or
conversion), and every path they give must stay inside the dataset folder (no absolute path, no ``..`` leading out;
checked on the path as written, since hub snapshots are links into the hub cache). The construction checks every
episode's files exist, refuses an episode listed twice and reads each data file's parquet footer, so that a bad
dataset fails at once with one line naming the file. Videos are decoded by ffmpeg as local mp4 files only
(``-protocol_whitelist file -f mp4``: no network or other protocol, no other demuxer).

Conventions. LeRobot stores one action per frame (the action taken at that frame); ``data.py`` has ``T + 1`` frames
and the ``T`` actions between them. An episode of ``L`` rows therefore becomes ``L`` frames and its first ``L - 1``
actions (the last row's action leads out of the recording). ``write_lerobot_dataset`` writes the inverse (the last
row repeats the last action) and copies the source's action statistics, so a dataset converted to LeRobot trains
with the same normalisation. Bad datasets raise ``InputError`` naming the file and the field.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import processor
from ..errors import InputError
from .episodes import DatasetInfo, Episode, read_episode_dataset, read_json_object, window_starts

LEROBOT_PREFIX = "lerobot:"
SUPPORTED_VERSIONS = ("v2.1", "v3.0")
V3_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V3_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V3_EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
CHUNKS_SIZE = 1000
STATS_KEYS = ("min", "max", "mean", "std", "q01", "q99")
# The placeholders info.json's path templates may hold, per codebase version (LeRobot's own); nothing else is filled.
TEMPLATE_FIELDS = {
    "v3.0": ("chunk_index", "file_index", "video_key"),
    "v2.1": ("episode_chunk", "episode_index", "video_key"),
}
_INTEGER_SPEC = re.compile(r"^0?\d{0,2}d?$")  # "", "d", "03d", "06d", ...
# What ffmpeg may open: local files, read by the mp4 demuxer only (module docstring).
FFMPEG_INPUT_PARAMS = ("-protocol_whitelist", "file", "-f", "mp4")


def parse_path_template(template, allowed: tuple[str, ...], where: str) -> list[tuple[str, str | None, str]]:
    """A path template's parts ``(literal, field, format_spec)``, refused with ``InputError`` unless every placeholder
    is ``{name}`` or ``{name:0Nd}`` with a name in ``allowed`` (no attribute access, indexing or conversion)."""
    if not isinstance(template, str) or not template:
        raise InputError(f"dataset: {where} must be a path template string, got {template!r}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as error:
        raise InputError(f"dataset: {where} is not a valid path template ({error})") from error
    out = []
    for literal, field, spec, conversion in parts:
        if field is not None:
            shown = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            if field not in allowed or conversion is not None or not _INTEGER_SPEC.match(spec or ""):
                raise InputError(
                    f"dataset: {where} has the placeholder {shown}; only {{name}} or {{name:0Nd}} with a name from "
                    f"{list(allowed)} may appear"
                )
        out.append((literal, field, spec or ""))
    return out


def fill_path_template(parts: list[tuple[str, str | None, str]], values: dict, where: str) -> str:
    """The template's parts with the placeholders replaced by ``values`` (integers, and strings without a spec)."""
    text = []
    for literal, field, spec in parts:
        text.append(literal)
        if field is not None:
            value = values[field]
            if spec and (isinstance(value, bool) or not isinstance(value, int)):
                raise InputError(f"dataset: {where} formats {field!r} as a number ({spec}), but it is {value!r}")
            text.append(format(value, spec) if spec else str(value))
    return "".join(text)


def path_inside(root: Path, relative: str, where: str) -> Path:
    """``root / relative``, refused with ``InputError`` when ``relative`` is absolute or leads out of ``root`` (checked
    as written, not through links: a hub snapshot's files are links into the hub cache)."""
    normal = os.path.normpath(relative) if relative else ""
    if (
        not normal
        or "\0" in relative
        or os.path.isabs(relative)
        or normal == os.pardir
        or normal.startswith(os.pardir + os.sep)
    ):
        raise InputError(
            f"dataset: {where} gives the path {relative!r}, which leads outside the dataset folder {root}; expected a "
            f"path inside it"
        )
    return root / normal


def is_lerobot_spec(spec) -> bool:
    """``"lerobot:PATH"``, or a folder with ``meta/info.json``."""
    if isinstance(spec, str) and spec.startswith(LEROBOT_PREFIX):
        return True
    return isinstance(spec, (str, os.PathLike)) and (Path(spec).expanduser() / "meta" / "info.json").is_file()


def strip_prefix(spec) -> Path:
    text = os.fspath(spec)
    return Path(text[len(LEROBOT_PREFIX) :] if text.startswith(LEROBOT_PREFIX) else text).expanduser()


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        raise InputError(f"dataset: cannot read {path} as JSON lines ({error})") from error


def _read_parquet(path: Path, columns: list[str] | None = None, filters=None):
    import pyarrow.parquet as pq

    if not path.is_file():
        raise InputError(f"dataset: missing {path}")
    try:
        schema_names = pq.read_schema(path).names
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ...
        raise InputError(f"dataset: cannot read {path} as parquet ({_first_line(error)})") from error
    missing = [c for c in columns or [] if c not in schema_names]
    if missing:
        raise InputError(f"dataset: {path} lacks the column(s) {missing} (has {schema_names})")
    try:
        return pq.read_table(path, columns=columns, filters=filters)
    except Exception as error:  # a damaged page: pyarrow raises OSError, ArrowInvalid, ...
        raise InputError(f"dataset: cannot read {path} as parquet ({_first_line(error)})") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _matrix(table, column: str, path: Path) -> np.ndarray:
    """A list / fixed-size-list column (or a scalar column) as float32 [rows, dim]."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = table.column(column)
    if pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type) or pa.types.is_large_list(values.type):
        flat = pc.list_flatten(values).to_numpy(zero_copy_only=False)
        rows = len(table)
        if rows and flat.size % rows:
            raise InputError(f"dataset: {path} column {column!r} has rows of different lengths")
        return flat.reshape(rows, -1 if rows else 0).astype(np.float32)
    return values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, 1)


def decode_video(path: Path, start_time: float, count: int, fps: float, field: str) -> np.ndarray:
    """``count`` RGB frames [count, H, W, 3] uint8 from ``start_time`` seconds, checking the stream's fps.

    ffmpeg reads the file as a local mp4 and nothing else (``FFMPEG_INPUT_PARAMS``). It seeks before decoding
    (``-ss`` as an input option is frame-accurate); the seek aims a quarter frame early so rounding of the stored
    timestamps never skips the first frame, and ``-frames:v`` stops the decoder after the span.
    """
    import imageio_ffmpeg

    if not path.is_file():
        raise InputError(f"dataset: missing video {path} ({field})")
    seek = max(start_time - 0.25 / fps, 0.0)
    try:
        reader = imageio_ffmpeg.read_frames(
            str(path.absolute()),
            input_params=[*FFMPEG_INPUT_PARAMS, "-ss", f"{seek:.6f}"],
            output_params=["-frames:v", str(count)],
        )
        meta = next(reader)
        width, height = meta["size"]
        video_fps = float(meta.get("fps") or 0.0)
        frames = [np.frombuffer(chunk, np.uint8).reshape(height, width, 3) for chunk in reader]
    except InputError:
        raise
    except Exception as error:  # imageio-ffmpeg raises OSError / RuntimeError / StopIteration for broken files
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise InputError(f"dataset: cannot decode the video {path} ({field}): {first_line}") from error
    if video_fps and abs(video_fps - fps) > 1e-3 * fps:
        raise InputError(f"dataset: {path} ({field}) is a {video_fps:g} fps video but meta/info.json says fps={fps:g}")
    if len(frames) < count:
        raise InputError(
            f"dataset: {path} ({field}) holds {len(frames)} frames from {start_time:.3f} s, the episode needs {count}"
        )
    return np.stack(frames)


@dataclass(frozen=True)
class LeRobotEpisode:
    """Where one episode lives (from the episodes metadata)."""

    index: int  # episode_index
    length: int  # rows (= frames)
    tasks: tuple[str, ...]
    data_file: Path
    video_file: Path
    video_from_timestamp: float


@dataclass(frozen=True)
class LeRobotClip:
    """One training window: ``chunk + 1`` frames and the ``chunk`` actions between them."""

    pixels: np.ndarray | None  # float32 [3, chunk + 1, H, W] on the tier canvas (None without a tier)
    frames: np.ndarray  # uint8 [chunk + 1, h, w, 3] as recorded
    actions: np.ndarray  # float32 [chunk, raw_action_dim], raw units
    task: str
    episode_index: int
    start: int  # first frame within the episode
    episode_start: bool  # the window begins at the episode's first frame
    episode_end: bool  # the window ends at the episode's last frame


class LeRobotDataset:
    """A LeRobot v3.0 / v2.1 dataset folder, read lazily (see the module docstring).

    ``camera``: the video feature to read (default: the only one; several need a choice). ``action_key`` /
    ``state_key``: the tabular features of the actions and (optionally, returned by ``read_rows``) the state.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        camera: str | None = None,
        action_key: str = "action",
        state_key: str | None = None,
    ):
        self.root = strip_prefix(root)
        if not self.root.is_dir():
            raise InputError(f"dataset: {self.root} is not a directory")
        self.info_path = self.root / "meta" / "info.json"
        if not self.info_path.is_file():
            raise InputError(f"dataset: {self.root} is not a LeRobot dataset (no meta/info.json)")
        info = self.info = read_json_object(self.info_path)
        self.version = info.get("codebase_version")
        if self.version not in SUPPORTED_VERSIONS:
            raise InputError(
                f"dataset: {self.info_path} field 'codebase_version' is {self.version!r}; expected one of "
                f"{list(SUPPORTED_VERSIONS)}"
            )
        for key in ("fps", "features", "data_path"):
            if key not in info:
                raise InputError(f"dataset: {self.info_path} lacks the field {key!r}")
        fps = info["fps"]
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
            raise InputError(f"dataset: {self.info_path} field 'fps' must be a positive number, got {fps!r}")
        self.fps = float(fps)
        features = info["features"]
        videos = sorted(k for k, v in features.items() if isinstance(v, dict) and v.get("dtype") == "video")
        if camera is None:
            if len(videos) != 1:
                raise InputError(
                    f"camera: {self.info_path} has the video features {videos}; name one (--camera)"
                    if videos
                    else f"camera: {self.info_path} 'features' has no video feature (dtype 'video')"
                )
            camera = videos[0]
        if camera not in videos:
            raise InputError(
                f"camera: {camera!r} is not a video feature of {self.info_path} (video features: {videos})"
            )
        self.camera = camera
        video_fps = (features[camera].get("info") or {}).get("video.fps")
        if video_fps is not None and abs(float(video_fps) - self.fps) > 1e-3 * self.fps:
            raise InputError(
                f"dataset: {self.info_path} field features[{camera!r}].info['video.fps'] is {video_fps} but 'fps' is "
                f"{self.fps:g}"
            )
        if "video_path" not in info or not info["video_path"]:
            raise InputError(f"dataset: {self.info_path} lacks the field 'video_path'")
        feature: str | None
        for name, feature in (("action_key", action_key), ("state_key", state_key)):
            if feature is not None and feature not in features:
                raise InputError(
                    f"{name}: {feature!r} is not a feature of {self.info_path} (features: {sorted(features)})"
                )
        self.action_key: str = action_key
        self.state_key: str | None = state_key
        shape = features[action_key].get("shape") or []
        if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
            raise InputError(
                f"dataset: {self.info_path} field features[{action_key!r}].shape must be [dim], got {shape}"
            )
        self.raw_action_dim = int(shape[0])
        self.robot_type = info.get("robot_type")
        self.task_names = self._read_tasks()
        self.episodes = self._read_episodes()
        if not self.episodes:
            raise InputError(f"dataset: {self.root} has no episodes")
        self._checked_videos: set[Path] = set()

    # ------------------------------------------------------------------------------------------------ metadata

    def _read_tasks(self) -> dict[int, str]:
        meta = self.root / "meta"
        if self.version == "v2.1":
            path = meta / "tasks.jsonl"
            rows = _read_jsonl(path)
            try:
                return {int(r["task_index"]): str(r["task"]) for r in rows}
            except (KeyError, TypeError, ValueError) as error:
                raise InputError(f"dataset: {path} lines need 'task_index' and 'task' ({error})") from error
        path = meta / "tasks.parquet"
        table = _read_parquet(path)
        names = table.column_names
        # pandas writes the task strings as the frame's index: a column named by the pandas metadata.
        pandas_meta = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}") or b"{}")
        index_columns = [c for c in pandas_meta.get("index_columns", []) if isinstance(c, str)]
        task_column = next((c for c in ["task", *index_columns, "__index_level_0__"] if c in names), None)
        if task_column is None or "task_index" not in names:
            raise InputError(
                f"dataset: {path} needs the columns 'task_index' and 'task' (or the task as index), has {names}"
            )
        return dict(zip(table.column("task_index").to_pylist(), map(str, table.column(task_column).to_pylist())))

    def _task_list(self, value, path: Path) -> tuple[str, ...]:
        if isinstance(value, str):
            return (value,)
        if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
            return tuple(value)
        raise InputError(f"dataset: {path} field 'tasks' must be a list of strings, got {value!r}")

    def _read_episodes(self) -> list[LeRobotEpisode]:
        info, camera = self.info, self.camera
        allowed = TEMPLATE_FIELDS[str(self.version)]
        templates = {
            key: parse_path_template(info[key], allowed, f"{self.info_path} field {key!r}")
            for key in ("data_path", "video_path")
        }

        def locate(key: str, values: dict, where: str) -> Path:
            field = f"{self.info_path} field {key!r} ({where})"
            return path_inside(self.root, fill_path_template(templates[key], values, field), field)

        def integer(row: dict, key: str, path: Path) -> int:
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise InputError(f"dataset: {path} field {key!r} must be an integer >= 0, got {value!r}")
            return int(value)

        episodes = []
        if self.version == "v2.1":
            path = self.root / "meta" / "episodes.jsonl"
            chunks_size = int(info.get("chunks_size", CHUNKS_SIZE))
            for row in _read_jsonl(path):
                for key in ("episode_index", "length"):
                    if key not in row:
                        raise InputError(f"dataset: {path} has an episode line without the field {key!r}")
                index = integer(row, "episode_index", path)
                fields = dict(episode_chunk=index // chunks_size, episode_index=index, video_key=camera)
                episodes.append(
                    LeRobotEpisode(
                        index=index,
                        length=integer(row, "length", path),
                        tasks=self._task_list(row.get("tasks", []), path),
                        data_file=locate("data_path", fields, f"episode {index}"),
                        video_file=locate("video_path", fields, f"episode {index}"),
                        video_from_timestamp=0.0,
                    )
                )
            return self._checked(episodes, path)
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise InputError(f"dataset: no meta/episodes/chunk-*/file-*.parquet in {self.root}")
        prefix = f"videos/{camera}/"
        columns = [
            "episode_index",
            "length",
            "tasks",
            "data/chunk_index",
            "data/file_index",
            prefix + "chunk_index",
            prefix + "file_index",
            prefix + "from_timestamp",
        ]
        for path in files:
            table = _read_parquet(path, columns)
            for row in table.to_pylist():
                index = integer(row, "episode_index", path)
                data_fields = dict(
                    chunk_index=integer(row, "data/chunk_index", path),
                    file_index=integer(row, "data/file_index", path),
                    video_key=camera,
                )
                video_fields = dict(
                    chunk_index=integer(row, prefix + "chunk_index", path),
                    file_index=integer(row, prefix + "file_index", path),
                    video_key=camera,
                )
                episodes.append(
                    LeRobotEpisode(
                        index=index,
                        length=integer(row, "length", path),
                        tasks=self._task_list(row["tasks"], path),
                        data_file=locate("data_path", data_fields, f"episode {index}"),
                        video_file=locate("video_path", video_fields, f"episode {index}"),
                        video_from_timestamp=float(row[prefix + "from_timestamp"]),
                    )
                )
        return self._checked(episodes, self.root / "meta" / "episodes")

    def _checked(self, episodes: list[LeRobotEpisode], listed_in: Path) -> list[LeRobotEpisode]:
        """The episodes in index order, after checking that none is listed twice, that every episode's data and video
        files exist, and that every data file's parquet footer reads (a damaged file fails here, not hours into
        training)."""
        import pyarrow.parquet as pq

        seen: set[int] = set()
        for episode in episodes:
            if episode.index in seen:
                raise InputError(f"dataset: {listed_in} lists episode {episode.index} more than once")
            seen.add(episode.index)
        checked: set[Path] = set()
        for episode in episodes:
            for path, what in ((episode.data_file, "data"), (episode.video_file, f"video ({self.camera})")):
                if path not in checked and not path.is_file():
                    raise InputError(f"dataset: missing {path}, the {what} file of episode {episode.index}")
                checked.add(path)
        for path in sorted({episode.data_file for episode in episodes}):
            try:
                pq.read_metadata(path)
            except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged footer
                raise InputError(f"dataset: cannot read {path} as parquet ({_first_line(error)})") from error
        return sorted(episodes, key=lambda e: e.index)

    def action_stats_document(self) -> dict:
        """``{"action": {min, max, mean, std[, q01, q99]}}`` for the action feature: meta/stats.json, else (v2.1)
        aggregated from meta/episodes_stats.jsonl, else computed from the action column."""
        path = self.root / "meta" / "stats.json"
        if path.is_file():
            stats = read_json_object(path)
            if self.action_key not in stats:
                raise InputError(f"dataset: {path} has no statistics for the action feature {self.action_key!r}")
            block = stats[self.action_key]
            return {
                "action": {k: np.asarray(block[k], np.float64).reshape(-1).tolist() for k in STATS_KEYS if k in block}
            }
        episode_stats = self.root / "meta" / "episodes_stats.jsonl"
        if episode_stats.is_file():
            return {"action": _aggregate_episode_stats(_read_jsonl(episode_stats), self.action_key, episode_stats)}
        actions = np.concatenate([self.read_rows(i)["actions"] for i in range(len(self))]).astype(np.float64)
        return {"action": _stats_of(actions)}

    # ------------------------------------------------------------------------------------------------ episodes

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def lengths(self) -> list[int]:
        """Frames per episode."""
        return [e.length for e in self.episodes]

    def name(self, i: int) -> str:
        return f"episode_{self.episodes[i].index:06d}"

    def fingerprint(self) -> list:
        """What the latent cache depends on: the camera, the action key and every file's size and mtime."""
        files = sorted({p for e in self.episodes for p in (e.data_file, e.video_file)} | {self.info_path})
        return [
            self.camera,
            self.action_key,
            *[(str(p.relative_to(self.root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()],
        ]

    def read_rows(self, i: int) -> dict:
        """Episode ``i``'s tabular rows: actions [L, D] (and states [L, S] with a state key), its task string."""
        episode = self.episodes[i]
        columns = ["episode_index", "frame_index", "timestamp", self.action_key]
        columns += [self.state_key] if self.state_key else []
        columns += ["task_index"] if not episode.tasks else []
        has_success = "next.success" in self.info["features"]
        columns += ["next.success"] if has_success else []
        table = _read_parquet(episode.data_file, columns, filters=[("episode_index", "=", episode.index)])
        table = table.sort_by("frame_index")
        path = episode.data_file
        if len(table) != episode.length:
            raise InputError(
                f"dataset: {path} has {len(table)} rows of episode {episode.index}, its metadata says length="
                f"{episode.length}"
            )
        timestamps = table.column("timestamp").to_numpy(zero_copy_only=False).astype(np.float64)
        frame_index = table.column("frame_index").to_numpy(zero_copy_only=False)
        if not np.allclose(timestamps, frame_index / self.fps, atol=0.5 / self.fps):
            raise InputError(
                f"dataset: {path} field 'timestamp' of episode {episode.index} does not advance at fps={self.fps:g} "
                f"(meta/info.json)"
            )
        actions = _matrix(table, self.action_key, path)
        if actions.shape[1] != self.raw_action_dim:
            raise InputError(
                f"dataset: {path} column {self.action_key!r} is {actions.shape[1]}-dim, meta/info.json "
                f"says {self.raw_action_dim}"
            )
        if not np.isfinite(actions).all():
            raise InputError(f"dataset: {path} column {self.action_key!r} contains NaN or infinity")
        if episode.tasks:
            task = episode.tasks[0]
        else:
            task = self.task_names.get(int(table.column("task_index")[0].as_py()), "")
        rows = {
            "actions": actions,
            "task": task,
            "success": bool(np.any(table.column("next.success").to_numpy(zero_copy_only=False)))
            if has_success
            else None,
        }
        if self.state_key:
            rows["states"] = _matrix(table, self.state_key, path)
        return rows

    def read_frames(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """uint8 [stop - start, H, W, 3]: frames ``start .. stop - 1`` of episode ``i`` from the camera's video."""
        episode = self.episodes[i]
        stop = episode.length if stop is None else stop
        if not 0 <= start < stop <= episode.length:
            raise InputError(f"frames: [{start}, {stop}) is outside episode {episode.index} ({episode.length} frames)")
        return decode_video(
            episode.video_file,
            episode.video_from_timestamp + start / self.fps,
            stop - start,
            self.fps,
            f"camera {self.camera!r}, episode {episode.index}",
        )

    def load(self, i: int, with_frames: bool = True):
        """Episode ``i`` as ``episodes.Episode``: L frames and the first L - 1 actions (module docstring)."""
        rows = self.read_rows(i)
        frames = self.read_frames(i) if with_frames else None
        return Episode(frames=frames, actions=rows["actions"][:-1], task=rows["task"], success=rows["success"])

    def clips(
        self,
        chunk: int,
        stride: int | None = None,
        resolution_tier: int | None = None,
        episodes: list[int] | None = None,
    ) -> Iterator[LeRobotClip]:
        """Training windows episode by episode (one episode's frames in memory at a time); ``resolution_tier`` adds
        the pixels on the model's tier canvas (``processor.prepare_conditioning``, as the trainers see them)."""
        stride = stride or chunk
        for i in range(len(self)) if episodes is None else episodes:
            episode = self.load(i)
            starts = window_starts(episode.num_actions, chunk, stride)
            pixels = None
            if starts and resolution_tier is not None:
                pixels = (
                    processor.prepare_conditioning(episode.frames, resolution_tier, int(episode.frames.shape[0]))
                    .pixels[0]
                    .numpy()
                )
            for s in starts:
                yield LeRobotClip(
                    pixels=None if pixels is None else pixels[:, s : s + chunk + 1],
                    frames=episode.frames[s : s + chunk + 1],
                    actions=episode.actions[s : s + chunk],
                    task=episode.task,
                    episode_index=self.episodes[i].index,
                    start=s,
                    episode_start=s == 0,
                    episode_end=s + chunk == episode.num_actions,
                )


def _stats_of(values: np.ndarray) -> dict:
    return {
        "min": values.min(0).tolist(),
        "max": values.max(0).tolist(),
        "mean": values.mean(0).tolist(),
        "std": values.std(0).tolist(),
        "q01": np.quantile(values, 0.01, 0).tolist(),
        "q99": np.quantile(values, 0.99, 0).tolist(),
    }


def _aggregate_episode_stats(lines: list[dict], key: str, path: Path) -> dict:
    """Pooled min / max / mean / std of one feature over v2.1's per-episode statistics."""
    blocks = []
    for line in lines:
        block = (line.get("stats") or {}).get(key)
        if block is None or not all(k in block for k in ("min", "max", "mean", "std", "count")):
            raise InputError(f"dataset: {path} has an episode without stats[{key!r}] min/max/mean/std/count")
        blocks.append({k: np.asarray(block[k], np.float64).reshape(-1) for k in ("min", "max", "mean", "std", "count")})
    counts = np.array([b["count"][0] for b in blocks])
    means = np.stack([b["mean"] for b in blocks])
    mean = (counts[:, None] * means).sum(0) / counts.sum()
    second = (counts[:, None] * (np.stack([b["std"] for b in blocks]) ** 2 + means**2)).sum(0) / counts.sum()
    return {
        "min": np.stack([b["min"] for b in blocks]).min(0).tolist(),
        "max": np.stack([b["max"] for b in blocks]).max(0).tolist(),
        "mean": mean.tolist(),
        "std": np.sqrt(np.maximum(second - mean**2, 0.0)).tolist(),
    }


def read_lerobot_dataset(
    spec,
    *,
    camera: str | None = None,
    action_key: str = "action",
    state_key: str | None = None,
    domain: str | int | None = None,
):
    """``episodes.DatasetInfo`` of a LeRobot dataset (its ``episodes`` is the ``LeRobotDataset``).

    The embodiment is ``domain``, else the info.json ``robot_type`` when that is a Cosmos3 embodiment name.
    """
    dataset = LeRobotDataset(spec, camera=camera, action_key=action_key or "action", state_key=state_key)
    if domain is None:
        if dataset.robot_type not in processor.DOMAIN_NAMES:
            raise InputError(
                f"domain: {dataset.info_path} robot_type {dataset.robot_type!r} is not a Cosmos3 embodiment; give the "
                f"domain (--domain, one of {list(processor.DOMAIN_NAMES)} or an integer id)"
            )
        domain = dataset.robot_type
    stats_document = dataset.action_stats_document()
    stats = processor.ActionStats.from_json(stats_document, mode="minmax")
    if stats.dim != dataset.raw_action_dim:
        raise InputError(
            f"dataset: the action statistics of {dataset.root} are {stats.dim}-dim but "
            f"features[{dataset.action_key!r}] is {dataset.raw_action_dim}-dim"
        )
    shape = dataset.info["features"][dataset.camera].get("shape") or []
    names = dataset.info["features"][dataset.camera].get("names") or []
    image_size = list(shape[1:3]) if names and names[0] in ("channels", "channel") else list(shape[:2])
    meta = {
        "domain": domain,
        "raw_action_dim": dataset.raw_action_dim,
        "fps": dataset.fps,
        "image_size": image_size,
        "action_normalization": "minmax",
        "num_episodes": len(dataset),
        "source": f"{LEROBOT_PREFIX}{dataset.root}",
        "camera": dataset.camera,
        "codebase_version": dataset.version,
    }
    return DatasetInfo(
        root=dataset.root,
        meta=meta,
        domain=domain,
        raw_action_dim=dataset.raw_action_dim,
        fps=dataset.fps,
        action_normalization="minmax",
        stats=stats,
        stats_document=stats_document,
        episode_paths=(),
        episodes=dataset,
    )


# ----------------------------------------------------------------------------------------------------------------
# Writer: our episode layout (data.py) -> LeRobot
# ----------------------------------------------------------------------------------------------------------------


def _pix_fmt(height: int, width: int, crf: int) -> str:
    # 4:2:0 needs even sizes; crf 0 is lossless in 4:4:4 (the colour conversion still rounds by a unit or two).
    return "yuv420p" if height % 2 == 0 and width % 2 == 0 and crf > 0 else "yuv444p"


class _VideoWriter:
    """One H.264 mp4 fed episode by episode (one episode's frames in memory at a time); opened on the first frames."""

    def __init__(self, path: Path, fps: float, crf: int):
        self.path, self.fps, self.crf = path, fps, crf
        self.writer: Generator[None, np.ndarray | None, None] | None = None

    def write(self, frames: np.ndarray) -> None:
        import imageio_ffmpeg

        if self.writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            height, width = frames.shape[1:3]
            self.writer = imageio_ffmpeg.write_frames(
                str(self.path),
                (width, height),
                fps=self.fps,
                codec="libx264",
                pix_fmt_out=_pix_fmt(height, width, self.crf),
                quality=None,
                macro_block_size=1,
                # a keyframe every second keeps ffmpeg's seek to an episode's start short
                output_params=["-crf", str(self.crf), "-g", str(max(int(round(self.fps)), 1))],
            )
            self.writer.send(None)
        for frame in frames:
            self.writer.send(np.ascontiguousarray(frame))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _rows_table(
    episode_index: int, first_index: int, actions: np.ndarray, fps: float, task_index: int, success: bool | None
):
    import pyarrow as pa

    rows, dim = actions.shape
    extra = {}
    if success is not None:  # LeRobot's per-frame flag: set on the last frame of a successful episode
        extra["next.success"] = pa.array(np.arange(rows) == rows - 1 if success else np.zeros(rows, bool))
    return pa.table(
        {
            **extra,
            "action": pa.FixedSizeListArray.from_arrays(pa.array(actions.reshape(-1), pa.float32()), dim),
            "timestamp": pa.array(np.arange(rows) / fps, pa.float32()),
            "frame_index": pa.array(np.arange(rows), pa.int64()),
            "episode_index": pa.array(np.full(rows, episode_index), pa.int64()),
            "index": pa.array(first_index + np.arange(rows), pa.int64()),
            "task_index": pa.array(np.full(rows, task_index), pa.int64()),
        }
    )


def write_lerobot_dataset(
    source_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    version: str = "v3.0",
    camera: str = "observation.image",
    episodes_per_file: int = 100,
    crf: int = 18,
    progress: bool = True,
) -> Path:
    """Convert a dataset in our layout (``data.episodes``; e.g. a task's generated dataset) to LeRobot.

    v3.0 puts ``episodes_per_file`` episodes in each data parquet and each mp4; v2.1 writes one of each per episode.
    Videos are H.264 at ``crf`` (0: lossless 4:4:4). ``robot_type`` is the source's domain, so the trainers find the
    embodiment without ``--domain``. Returns ``out_dir``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    if version not in SUPPORTED_VERSIONS:
        raise InputError(f"version: expected one of {list(SUPPORTED_VERSIONS)}, got {version!r}")
    if isinstance(episodes_per_file, bool) or not isinstance(episodes_per_file, int) or episodes_per_file < 1:
        raise InputError(f"episodes_per_file: expected an integer >= 1, got {episodes_per_file!r}")
    if is_lerobot_spec(source_dir):
        raise InputError(f"source_dir: {source_dir} is not a dataset in our episode layout (episodes.py)")
    source = read_episode_dataset(source_dir)
    out = Path(out_dir)
    if (out / "meta" / "info.json").exists():
        raise InputError(f"out_dir: {out} already holds a LeRobot dataset; give a new or empty folder")
    (out / "meta").mkdir(parents=True, exist_ok=True)
    fps = source.fps
    tasks: dict[str, int] = {}
    episode_rows: list[dict] = []
    episode_stats: list[dict] = []
    image_hw = None
    with_success = False
    total = 0
    per_file = episodes_per_file if version == "v3.0" else 1
    groups = [list(range(i, min(i + per_file, len(source.episodes)))) for i in range(0, len(source.episodes), per_file)]
    bar = tqdm(total=len(source.episodes), desc="writing LeRobot dataset", disable=not progress)
    for file_index, group in enumerate(groups):
        if version == "v3.0":
            fields = dict(chunk_index=file_index // CHUNKS_SIZE, file_index=file_index % CHUNKS_SIZE)
            data_path, video_path = V3_DATA_PATH.format(**fields), V3_VIDEO_PATH.format(video_key=camera, **fields)
        else:
            fields = dict(episode_chunk=group[0] // CHUNKS_SIZE, episode_index=group[0])
            data_path, video_path = V21_DATA_PATH.format(**fields), V21_VIDEO_PATH.format(video_key=camera, **fields)
        video = _VideoWriter(out / video_path, fps, crf)
        tables, offset = [], 0
        for i in group:
            episode = source.episodes.load(i)
            frames = episode.frames
            if image_hw is None:
                image_hw = frames.shape[1:3]
            elif frames.shape[1:3] != image_hw:
                raise InputError(
                    f"dataset: {source.episode_paths[i]} frames are {frames.shape[1:3]}, earlier ones "
                    f"{image_hw}; a LeRobot camera has one size"
                )
            # One action per frame: the last frame repeats the last action (the reader drops it again).
            actions = np.concatenate([episode.actions, episode.actions[-1:]]).astype(np.float32)
            task_index = tasks.setdefault(episode.task, len(tasks))
            if i == 0:
                with_success = episode.success is not None
            elif (episode.success is not None) != with_success:
                raise InputError(
                    f"dataset: {source.episode_paths[i]} has {'no ' * (episode.success is None)}"
                    f"'success' array unlike episode 0; all episodes must agree"
                )
            tables.append(_rows_table(i, total, actions, fps, task_index, episode.success))
            length = len(actions)
            row = {"episode_index": i, "tasks": [episode.task], "length": length}
            if version == "v3.0":
                row.update(
                    {
                        "data/chunk_index": file_index // CHUNKS_SIZE,
                        "data/file_index": file_index % CHUNKS_SIZE,
                        "dataset_from_index": total,
                        "dataset_to_index": total + length,
                        f"videos/{camera}/chunk_index": file_index // CHUNKS_SIZE,
                        f"videos/{camera}/file_index": file_index % CHUNKS_SIZE,
                        f"videos/{camera}/from_timestamp": offset / fps,
                        f"videos/{camera}/to_timestamp": (offset + length) / fps,
                        "meta/episodes/chunk_index": 0,
                        "meta/episodes/file_index": 0,
                    }
                )
            episode_rows.append(row)
            stats = {k: np.asarray(v).tolist() for k, v in _stats_of(actions.astype(np.float64)).items()}
            episode_stats.append({"episode_index": i, "stats": {"action": {**stats, "count": [length]}}})
            video.write(frames)
            offset += length
            total += length
            bar.update()
        video.close()
        (out / data_path).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(tables), out / data_path)
    bar.close()

    assert image_hw is not None  # read_episode_dataset refuses a dataset without episodes
    height, width = (int(v) for v in image_hw)
    features = {
        camera: {
            "dtype": "video",
            "shape": [height, width, 3],
            "names": ["height", "width", "channels"],
            "info": {
                "video.height": height,
                "video.width": width,
                "video.codec": "h264",
                "video.pix_fmt": _pix_fmt(height, width, crf),
                "video.is_depth_map": False,
                "video.fps": fps,
                "video.channels": 3,
                "has_audio": False,
            },
        },
        "action": {"dtype": "float32", "shape": [source.raw_action_dim], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    if with_success:
        features["next.success"] = {"dtype": "bool", "shape": [1], "names": None}
    info = {
        "codebase_version": version,
        "robot_type": source.domain if isinstance(source.domain, str) else None,
        "total_episodes": len(episode_rows),
        "total_frames": total,
        "total_tasks": len(tasks),
        "chunks_size": CHUNKS_SIZE,
        "fps": fps,
        "splits": {"train": f"0:{len(episode_rows)}"},
        "data_path": V3_DATA_PATH if version == "v3.0" else V21_DATA_PATH,
        "video_path": V3_VIDEO_PATH if version == "v3.0" else V21_VIDEO_PATH,
        "features": features,
    }
    if version == "v2.1":
        info.update(total_chunks=len(groups) // CHUNKS_SIZE + 1, total_videos=len(episode_rows))
    (out / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    action_stats = {**source.stats_document["action"], "count": [total]}
    if version == "v3.0":
        (out / "meta" / "stats.json").write_text(json.dumps({"action": action_stats}, indent=2))
        task_table = pa.table(
            {"task_index": pa.array(list(tasks.values()), pa.int64()), "task": pa.array(list(tasks), pa.string())}
        )
        # pandas metadata: lerobot reads meta/tasks.parquet with pandas and takes the task strings from the index.
        pandas_meta = {
            "index_columns": ["task"],
            "column_indexes": [],
            "columns": [
                {
                    "name": "task_index",
                    "field_name": "task_index",
                    "pandas_type": "int64",
                    "numpy_type": "int64",
                    "metadata": None,
                },
                {
                    "name": "task",
                    "field_name": "task",
                    "pandas_type": "unicode",
                    "numpy_type": "object",
                    "metadata": None,
                },
            ],
            "pandas_version": "2.2.0",
        }
        pq.write_table(
            task_table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), out / "meta" / "tasks.parquet"
        )
        episodes_path = out / V3_EPISODES_PATH.format(chunk_index=0, file_index=0)
        episodes_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(episode_rows), episodes_path)
    else:
        lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
        (out / "meta" / "episodes.jsonl").write_text(lines(episode_rows))
        (out / "meta" / "tasks.jsonl").write_text(lines({"task_index": v, "task": k} for k, v in tasks.items()))
        (out / "meta" / "episodes_stats.jsonl").write_text(lines(episode_stats))
    return out
