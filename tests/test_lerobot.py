"""LeRobot datasets (cosmos3_gym.data.lerobot): the published v3.0 / v2.1 layouts written from our episodes, read
back, trained on (train-vae and train through the CLI), used as env start frames, and bad datasets refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_training import CHUNK, FPS, TASK, TINY_MODEL, make_dataset

from cosmos3_gym import cli
from cosmos3_gym.data.initial_states import load_initial_states
from cosmos3_gym.data.lerobot import LeRobotDataset, _aggregate_episode_stats, write_lerobot_dataset
from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.errors import InputError
from cosmos3_gym.training.data import read_dataset

CAMERA = "observation.images.top"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lerobot")


@pytest.fixture(scope="module")
def source(work) -> Path:
    root = make_dataset(work / "source", num_episodes=3, steps=12, size=32)
    for i, path in enumerate(sorted((root / "episodes").glob("*.npz"))):  # the optional success flag: 0 and 2 succeed
        episode = dict(np.load(path))
        np.savez(path, **episode, success=np.array(i != 1))
    return root


@pytest.fixture(scope="module")
def v3(work, source) -> Path:
    # Lossless video, two episodes per file: episode 1 starts mid-file, episode 2 opens the second file.
    return write_lerobot_dataset(source, work / "v3", camera=CAMERA, episodes_per_file=2, crf=0, progress=False)


@pytest.fixture(scope="module")
def v21(work, source) -> Path:
    return write_lerobot_dataset(source, work / "v21", version="v2.1", camera=CAMERA, crf=0, progress=False)


def test_v3_follows_the_published_layout(v3):
    info = json.loads((v3 / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == FPS and info["total_episodes"] == 3
    assert info["total_frames"] == 3 * 13 and info["robot_type"] == "pusht"
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert info["features"][CAMERA]["dtype"] == "video" and info["features"]["action"]["shape"] == [2]
    for path in ("meta/stats.json", "meta/tasks.parquet", "meta/episodes/chunk-000/file-000.parquet",
                 "data/chunk-000/file-000.parquet", "data/chunk-000/file-001.parquet",
                 f"videos/{CAMERA}/chunk-000/file-000.mp4", f"videos/{CAMERA}/chunk-000/file-001.mp4"):
        assert (v3 / path).is_file(), path
    episodes = pq.read_table(v3 / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["dataset_from_index"] for e in episodes] == [0, 13, 26]
    assert [e["dataset_to_index"] for e in episodes] == [13, 26, 39]
    assert [e["data/file_index"] for e in episodes] == [0, 0, 1]
    assert [e[f"videos/{CAMERA}/from_timestamp"] for e in episodes] == [0.0, 1.3, 0.0]
    assert [e[f"videos/{CAMERA}/to_timestamp"] for e in episodes] == [1.3, 2.6, 1.3]
    assert episodes[1]["tasks"] == [TASK]
    rows = pq.read_table(v3 / "data/chunk-000/file-000.parquet")
    assert rows.column("index").to_pylist() == list(range(26))
    assert rows.column("episode_index").to_pylist() == [0] * 13 + [1] * 13
    tasks = pq.read_table(v3 / "meta/tasks.parquet")
    assert tasks.column("task").to_pylist() == [TASK] and tasks.column("task_index").to_pylist() == [0]


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_episodes_read_back_as_written(version, v3, v21, source):
    root = v3 if version == "v3.0" else v21
    if version == "v2.1":
        assert (root / f"videos/chunk-000/{CAMERA}/episode_000002.mp4").is_file()
        assert (root / "data/chunk-000/episode_000002.parquet").is_file()
        assert not (root / "meta/stats.json").exists()  # v2.1: per-episode statistics only
    ours, theirs = read_dataset(source), read_dataset(f"lerobot:{root}")
    assert theirs.meta["codebase_version"] == version and theirs.domain == "pusht" and theirs.fps == FPS
    for key in ("min", "max"):  # (v2.1 pools its per-episode statistics: min / max are exact)
        np.testing.assert_allclose(theirs.stats_document["action"][key], ours.stats_document["action"][key],
                                   rtol=1e-6)
    for i in range(3):
        a, b = ours.episodes.load(i), theirs.episodes.load(i)
        assert b.task == a.task == TASK and b.success == a.success == (i != 1)
        np.testing.assert_array_equal(b.actions, a.actions)
        assert b.frames.shape == a.frames.shape
        # Lossless 4:4:4 H.264: only the RGB <-> YUV conversion rounds.
        assert np.abs(b.frames.astype(int) - a.frames.astype(int)).max() <= 3
    # A span from the middle of the shared file: the seek lands on the right frame.
    np.testing.assert_array_equal(theirs.episodes.read_frames(1, 5, 8), theirs.episodes.load(1).frames[5:8])


def test_clips_carry_tier_pixels_actions_and_episode_boundaries(v3):
    dataset = LeRobotDataset(f"lerobot:{v3}")
    clips = list(dataset.clips(chunk=CHUNK, stride=CHUNK, resolution_tier=256))
    assert len(clips) == 3 * 3  # 12 actions per episode, 4 per window
    first, last = clips[0], clips[2]
    assert first.episode_start and not first.episode_end and last.episode_end and last.start == 8
    assert first.frames.shape == (CHUNK + 1, 32, 32, 3) and first.actions.shape == (CHUNK, 2)
    assert first.pixels.shape[:2] == (3, CHUNK + 1) and first.task == TASK
    np.testing.assert_array_equal(clips[4].actions, dataset.load(1).actions[4:8])


def test_initial_states_from_a_lerobot_dataset(v3):
    states = load_initial_states(f"lerobot:{v3}")
    assert len(states) == 3
    state = states[2]
    assert state.frame.shape == (32, 32, 3) and state.task == TASK
    np.testing.assert_array_equal(state.frame, LeRobotDataset(v3).read_frames(2, 0, 1)[0])


def test_train_vae_and_train_from_a_lerobot_dataset(v3, work):
    dataset = f"lerobot:{v3}"
    vae = work / "vae"
    assert cli.main([
        "train-vae", "--dataset", dataset, "--camera", CAMERA, "--out", str(vae), "--steps", "2", "--batch-size",
        "1", "--base-dim", "4", "--decoder-base-dim", "8", "--frames-per-clip", "5", "--stats-clips", "1",
        "--device", "cpu",
    ]) == 0
    checkpoint = work / "checkpoint"
    assert cli.main([
        "train", "--dataset", dataset, "--camera", CAMERA, "--vae", str(vae), "--out", str(checkpoint), "--steps",
        "2", "--batch-size", "2", "--chunk", str(CHUNK), "--model", json.dumps(TINY_MODEL), "--device", "cpu",
        "--config", json.dumps({"progress": False, "save_every": 0, "log_every": 1}),
    ]) == 0
    log = [json.loads(line) for line in (checkpoint / "training" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(np.isfinite(r["loss"]) for r in log)
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["domain"] == "pusht" and meta["raw_action_dim"] == 2 and meta["source"] == dataset
    stats = json.loads((checkpoint / "action_stats.json").read_text())
    assert stats["action"]["max"] == json.loads((v3 / "meta/stats.json").read_text())["action"]["max"]
    Cosmos3Engine.from_pretrained(checkpoint, device="cpu", progress=False).close()


def _copy(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root, tmp_path / root.name))


def test_bad_datasets_name_the_file_and_field(v3, v21, tmp_path):
    with pytest.raises(InputError, match="camera: 'observation.images.wrist' is not a video feature.*info.json"):
        LeRobotDataset(v3, camera="observation.images.wrist")
    with pytest.raises(InputError, match="action_key: 'actions' is not a feature"):
        read_dataset(f"lerobot:{v3}", action_key="actions")
    with pytest.raises(InputError, match="camera: only LeRobot datasets"):
        read_dataset(v3.parent / "source", camera=CAMERA)

    # A data file without the action column.
    broken = _copy(v3, tmp_path)
    path = broken / "data/chunk-000/file-001.parquet"
    pq.write_table(pq.read_table(path).drop(["action"]), path)
    with pytest.raises(InputError, match=r"file-001.parquet lacks the column\(s\) \['action'\]"):
        LeRobotDataset(broken).load(2, with_frames=False)

    # info.json says 20 fps, the videos are 10 fps.
    broken = tmp_path / "fps"
    shutil.copytree(v21, broken)
    info = json.loads((broken / "meta/info.json").read_text())
    info["fps"] = 20.0
    info["features"][CAMERA]["info"]["video.fps"] = 20.0
    (broken / "meta/info.json").write_text(json.dumps(info))
    dataset = LeRobotDataset(broken)
    with pytest.raises(InputError, match="'timestamp' of episode 0 does not advance at fps=20"):
        dataset.read_rows(0)
    with pytest.raises(InputError, match=r"episode_000000.mp4 \(camera .*\) is a 10 fps video but .*fps=20"):
        dataset.read_frames(0)
    info["features"][CAMERA]["info"]["video.fps"] = 10.0
    (broken / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(InputError, match=r"features\['observation.images.top'\].info\['video.fps'\] is 10.0"):
        LeRobotDataset(broken)

    # An unreadable video.
    broken = tmp_path / "video"
    shutil.copytree(v3, broken)
    (broken / f"videos/{CAMERA}/chunk-000/file-001.mp4").write_bytes(b"not an mp4")
    with pytest.raises(InputError, match=r"cannot decode the video .*file-001.mp4 \(camera 'observation.images.top'"):
        LeRobotDataset(broken).read_frames(2)

    # Episode metadata without a required column; an unknown format version.
    broken = tmp_path / "episodes"
    shutil.copytree(v3, broken)
    path = broken / "meta/episodes/chunk-000/file-000.parquet"
    pq.write_table(pq.read_table(path).drop([f"videos/{CAMERA}/from_timestamp"]), path)
    with pytest.raises(InputError, match="file-000.parquet lacks the column.*from_timestamp"):
        LeRobotDataset(broken)
    info = json.loads((broken / "meta/info.json").read_text())
    (broken / "meta/info.json").write_text(json.dumps({**info, "codebase_version": "v1.6"}))
    with pytest.raises(InputError, match="codebase_version"):
        LeRobotDataset(broken)
    # No robot_type that names an embodiment: the domain must be given.
    broken = tmp_path / "robot"
    shutil.copytree(v3, broken)
    (broken / "meta/info.json").write_text(json.dumps({**info, "robot_type": "koch"}))
    with pytest.raises(InputError, match="domain: .*robot_type 'koch'"):
        read_dataset(f"lerobot:{broken}")
    assert read_dataset(f"lerobot:{broken}", domain="pusht").domain == "pusht"


def test_v21_statistics_pool_the_episodes_exactly():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 3)) * (i + 1) + i for i, n in enumerate((5, 11, 7))]
    lines = [{"episode_index": i, "stats": {"action": {
        "min": p.min(0).tolist(), "max": p.max(0).tolist(), "mean": p.mean(0).tolist(), "std": p.std(0).tolist(),
        "count": [len(p)]}}} for i, p in enumerate(parts)]
    pooled = _aggregate_episode_stats(lines, "action", Path("episodes_stats.jsonl"))
    everything = np.concatenate(parts)
    for key, expected in (("min", everything.min(0)), ("max", everything.max(0)), ("mean", everything.mean(0)),
                          ("std", everything.std(0))):
        np.testing.assert_allclose(pooled[key], expected, rtol=1e-10, err_msg=key)
    del lines[1]["stats"]["action"]["count"]
    with pytest.raises(InputError, match="episodes_stats.jsonl has an episode without stats"):
        _aggregate_episode_stats(lines, "action", Path("episodes_stats.jsonl"))


# --------------------------------------------------------------------------------------------------- hostile datasets


def _with_info(root: Path, tmp_path: Path, name: str, **changes) -> Path:
    broken = Path(shutil.copytree(root, tmp_path / name))
    info = json.loads((broken / "meta/info.json").read_text())
    (broken / "meta/info.json").write_text(json.dumps({**info, **changes}))
    return broken


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("key, template, expected", [
    ("data_path", "/etc/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet", "leads outside the dataset folder"),
    ("video_path", "../../videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
     "leads outside the dataset folder"),
    ("data_path", "data/{chunk_index.__class__}/file-{file_index:03d}.parquet", "placeholder {chunk_index.__class__}"),
    ("data_path", "data/{x.__class__}/file.parquet", r"placeholder \{x.__class__\}"),
    ("video_path", "videos/{video_key[0]}/file-{file_index:03d}.mp4", r"placeholder \{video_key\[0\]\}"),
    ("data_path", "data/chunk-{chunk_index!r}/file-{file_index:03d}.parquet", r"placeholder \{chunk_index!r\}"),
    ("data_path", "data/chunk-{chunk_index:{file_index}}/x.parquet", "placeholder"),
])
def test_path_templates_stay_in_the_dataset_and_fill_only_the_documented_fields(v3, tmp_path, key, template,
                                                                                 expected):
    """Issue 43: the templates were joined to the root unconfined and filled with str.format (attribute access on its
    arguments worked)."""
    broken = _with_info(v3, tmp_path, "hostile", **{key: template})
    with pytest.raises(InputError, match=f"dataset: .*info.json field '{key}'.*{expected}") as excinfo:
        LeRobotDataset(broken)
    _one_line(excinfo)


def test_a_camera_name_cannot_lead_out_of_the_dataset(v21, tmp_path):
    broken = Path(shutil.copytree(v21, tmp_path / "camera"))
    info = json.loads((broken / "meta/info.json").read_text())
    info["features"]["../../../outside"] = info["features"][CAMERA]
    (broken / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(InputError, match="'video_path' .*leads outside the dataset folder") as excinfo:
        LeRobotDataset(broken, camera="../../../outside")
    _one_line(excinfo)


def test_a_duplicated_episode_line_is_refused(v21, tmp_path):
    broken = Path(shutil.copytree(v21, tmp_path / "duplicated"))
    lines = (broken / "meta/episodes.jsonl").read_text().splitlines()
    (broken / "meta/episodes.jsonl").write_text("\n".join([*lines, lines[0]]) + "\n")
    with pytest.raises(InputError, match="episodes.jsonl lists episode 0 more than once") as excinfo:
        LeRobotDataset(broken)
    _one_line(excinfo)


@pytest.mark.parametrize("which", ["data", "video"])
def test_a_missing_episode_file_fails_the_construction(v21, tmp_path, which):
    broken = Path(shutil.copytree(v21, tmp_path / "missing"))
    path = (broken / "data/chunk-000/episode_000002.parquet" if which == "data"
            else broken / f"videos/chunk-000/{CAMERA}/episode_000002.mp4")
    path.unlink()
    with pytest.raises(InputError, match=f"missing .*{path.name}, the {which}.* file of episode 2") as excinfo:
        LeRobotDataset(broken)
    _one_line(excinfo)


def test_a_corrupt_parquet_page_gives_one_line_naming_the_file(v3, tmp_path):
    broken = Path(shutil.copytree(v3, tmp_path / "page"))
    path = broken / "data/chunk-000/file-000.parquet"
    data = bytearray(path.read_bytes())
    data[4:64] = b"\xff" * 60  # the first column chunk's page header, behind the magic bytes
    path.write_bytes(bytes(data))
    dataset = LeRobotDataset(broken)  # the footer is intact
    with pytest.raises(InputError, match=r"dataset: cannot read .*file-000.parquet as parquet") as excinfo:
        dataset.read_rows(0)
    _one_line(excinfo)
    # A damaged footer fails the construction itself.
    path.write_bytes(bytes(data[:-20]))
    with pytest.raises(InputError, match=r"cannot read .*file-000.parquet as parquet") as excinfo:
        LeRobotDataset(broken)
    _one_line(excinfo)


def test_ffmpeg_reads_only_local_mp4_files(v3, tmp_path, monkeypatch):
    """Issue 43: untrusted mp4 files went to ffmpeg without a protocol whitelist or a fixed demuxer: a "video" that is
    an HLS playlist makes ffmpeg open whatever it lists (other files, URLs)."""
    import imageio_ffmpeg

    calls = []
    read_frames = imageio_ffmpeg.read_frames

    def spy(path, *args, **kwargs):
        calls.append((path, kwargs["input_params"]))
        return read_frames(path, *args, **kwargs)

    monkeypatch.setattr(imageio_ffmpeg, "read_frames", spy)
    dataset = LeRobotDataset(v3)
    assert dataset.read_frames(0, 0, 2).shape[0] == 2
    path, params = calls[-1]
    assert Path(path).is_absolute()
    assert params[params.index("-protocol_whitelist") + 1] == "file" and params[params.index("-f") + 1] == "mp4"
    assert params.index("-f") < params.index("-ss")  # input options, before -i

    broken = Path(shutil.copytree(v3, tmp_path / "playlist"))
    secret = tmp_path / "secret.mp4"
    shutil.copyfile(v3 / f"videos/{CAMERA}/chunk-000/file-000.mp4", secret)
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10.0,\nfile://{secret}\n#EXT-X-ENDLIST\n"
    (broken / f"videos/{CAMERA}/chunk-000/file-000.mp4").write_text(playlist)
    with pytest.raises(InputError, match="cannot decode the video .*file-000.mp4") as excinfo:
        LeRobotDataset(broken).read_frames(0, 0, 2)
    _one_line(excinfo)


def test_a_truncated_episode_file_of_our_layout_gives_one_line(source, tmp_path):
    from cosmos3_gym.data.episodes import load_episode

    broken = tmp_path / "episode_000000.npz"
    data = (source / "episodes" / "episode_000000.npz").read_bytes()
    broken.write_bytes(data[: len(data) // 2])  # a raw zipfile.BadZipFile before issue 43
    with pytest.raises(InputError, match="cannot read .*episode_000000.npz as an .npz file") as excinfo:
        load_episode(broken, 2)
    _one_line(excinfo)
