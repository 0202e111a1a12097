"""Issue 43: crash-safe saving (cosmos3_gym.storage) and training that survives SIGKILL at any point.

The fault-injection tests run the tiny world model's training in real subprocesses (forked from a forkserver that has
imported the package once, so that each of the dozens of runs starts in a fraction of a second) and SIGKILL them at
random points: from outside after a random delay (anywhere in training, saving or exporting) or from inside at a
random point of the save protocol (``COSMOS3_GYM_STORAGE_FAULT=kill:N``, so kills also land between a file write and
its rename, between a commit and the removal of the previous state, ...). After every kill the next run resumes from
the newest complete step, and the final weights equal an uninterrupted run's bit for bit. Everything runs on CPU.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cosmos3_gym import storage
from cosmos3_gym.checkpoint import load_safetensors_state_dict, validate_checkpoint
from cosmos3_gym.errors import CheckpointError

CHUNK = 4
STEPS, SAVE_EVERY = 40, 2
KILLS = 20
TINY_MODEL = {
    "hidden_size": 32, "head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
    "num_hidden_layers": 1, "rope_scaling": {"mrope_section": [4, 2, 2]},
}


def make_dataset(root: Path) -> Path:
    (root / "episodes").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for episode in range(2):
        frames = rng.integers(0, 255, (9, 32, 32, 3), dtype=np.uint8)
        actions = rng.uniform(-1, 1, (8, 2)).astype(np.float32)
        np.savez(root / "episodes" / f"episode_{episode:06d}.npz", frames=frames, actions=actions,
                 task=np.array("push"))
    stats = {"action": {"min": [-1, -1], "max": [1, 1], "mean": [0, 0], "std": [1, 1]}}
    (root / "stats.json").write_text(json.dumps(stats))
    (root / "meta.json").write_text(json.dumps({"domain": "pusht", "raw_action_dim": 2, "fps": 10.0,
                                                "image_size": [32, 32]}))
    return root


# ---------------------------------------------------------------------------------------------------- the runs


def _record(path: str, **values) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(values) + "\n")
        handle.flush()


def run_training(run: dict, fault: str | None, records: str) -> None:
    """One training process (in a forkserver child): resume, train to ``STEPS``, export. Writes what it did to
    ``records`` (resumed step, every completed save) so that the test can check the next run against it."""
    if fault:
        os.environ[storage.FAULT_ENV_VAR] = fault
    torch.set_num_threads(1)
    from cosmos3_gym.training import WorldModelTrainConfig, WorldModelTrainer
    from cosmos3_gym.training.distributed import init_distributed

    class RecordingTrainer(WorldModelTrainer):
        def save_state(self) -> None:
            super().save_state()
            _record(records, saved=self.step)

    config = WorldModelTrainConfig(
        model=TINY_MODEL, chunk=CHUNK, steps=STEPS, batch_size=2, warmup_steps=4, log_every=1, save_every=SAVE_EVERY,
        ema_decay=0.9, progress=False, device="cpu", cache_dir=run["cache"], resume=True,
        export_ema=run.get("export_ema", True),
    )
    ctx = init_distributed("cpu")
    trainer = RecordingTrainer(run["dataset"], run["out"], config, run["vae"], ctx)
    _record(records, resumed=trainer.step)
    trainer.train()
    trainer.export()
    _record(records, done=True)


# A fork server of this module's own (multiprocessing's is one per process, and may have been started by another test
# module with other modules preloaded): a fresh interpreter that imports the trainer once, then forks one child per
# run and reports the child's pid and, once it has ended, its exit code (negative: the signal that killed it).
FORK_SERVER = """
import importlib, json, os, pickle, sys, traceback
sys.path[:0] = json.loads(sys.argv[1])
for name in json.loads(sys.argv[2]):
    importlib.import_module(name)
commands, replies = sys.stdin.buffer, sys.stdout.buffer
while line := commands.readline():
    module, function, args = pickle.loads(bytes.fromhex(line.decode()))
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDWR), 0)
        os.dup2(os.open(os.devnull, os.O_RDWR), 1)
        code = 0
        try:
            getattr(importlib.import_module(module), function)(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    replies.write(b"%d\\n" % pid)
    replies.flush()
    replies.write(b"%d\\n" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    replies.flush()
"""


class ForkServer:
    def __init__(self, preload: list[str]):
        import subprocess
        import sys

        self.process = subprocess.Popen(
            [sys.executable, "-c", FORK_SERVER, json.dumps(sys.path), json.dumps(preload)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    def _reply(self, timeout: float | None) -> int | None:
        import select

        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.process.stdout.readline()
        assert line, "the fork server died"
        return int(line)

    def run(self, function, args: tuple, kill_after: float | None = None) -> int:
        """Run ``function(*args)`` in a forked child, SIGKILLed after ``kill_after`` seconds if still running;
        returns its exit code (-9: killed)."""
        import pickle

        self.process.stdin.write(pickle.dumps((function.__module__, function.__name__, args)).hex().encode() + b"\n")
        self.process.stdin.flush()
        pid = self._reply(60)
        assert pid is not None, "the fork server did not fork"
        code = self._reply(kill_after)
        if code is None:
            os.kill(pid, signal.SIGKILL)
            code = self._reply(60)
        assert code is not None, "a training run hung"
        return code

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


@pytest.fixture(scope="module")
def forkserver():
    server = ForkServer(["cosmos3_gym.training.world_model", "cosmos3_gym.training", __name__])
    yield server
    server.close()


def attempt(server: ForkServer, run: dict, records: Path, *, fault: str | None = None,
            kill_after: float | None = None) -> int:
    """One training run in a new process, SIGKILLed from outside after ``kill_after`` seconds if still running;
    returns its exit code (-9: killed)."""
    return server.run(run_training, (run, fault, str(records)), kill_after)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def state_tensors(out: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    folder = storage.snapshot_path(out / "training" / "state", step)
    return {name: load_file(folder / f"{name}.safetensors") for name in ("model", "ema", "optimizer")}


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"{what}: {different[:5]} differ"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, forkserver, tiny_checkpoint):
    """The dataset, the VAE and one uninterrupted reference run (which also fills the shared latent cache)."""
    root = tmp_path_factory.mktemp("crash")
    base = {"dataset": str(make_dataset(root / "dataset")), "vae": str(tiny_checkpoint / "vae"),
            "cache": str(root / "latent_cache")}
    reference = {**base, "out": str(root / "reference")}
    assert attempt(forkserver, reference, root / "reference.jsonl") == 0
    return root, base, Path(reference["out"])


def test_training_killed_at_random_points_resumes_to_the_uninterrupted_weights(setup, forkserver):
    root, base, reference = setup
    run = {**base, "out": str(root / "killed")}
    state_dir = Path(run["out"]) / "training" / "state"
    rng = random.Random(43)
    kills, training_kills, attempts, last_saved = 0, 0, 0, 0
    while kills < KILLS:
        attempts += 1
        assert attempts <= 3 * KILLS, "the kills never landed"
        found = storage.latest_snapshot(state_dir)
        expected = found[0] if found else 0
        assert expected >= last_saved, "a completed save was lost"
        records = root / f"killed_{attempts}.jsonl"
        if rng.random() < 0.6:  # at a random one of the points of training (each step) and saving (each phase)
            code = attempt(forkserver, run, records, fault=f"kill:{rng.randint(1, 24)}")
        else:  # at a random time (every step and save phase slowed by 20 ms, so kills land in saves too)
            code = attempt(forkserver, run, records, fault="sleep:0.02", kill_after=rng.uniform(0.05, 0.6))
        done = read_records(records)
        if done:  # (a kill during the start-up leaves no record)
            assert done[0] == {"resumed": expected}, (attempts, done, expected)
        saved = [r["saved"] for r in done if "saved" in r]
        last_saved = max([last_saved, *saved])
        if code == -signal.SIGKILL:
            kills += 1
            training_kills += expected < STEPS
        else:
            assert code == 0 and done[-1] == {"done": True}
    assert training_kills >= 10, training_kills  # most kills landed before the training was complete
    records = root / "killed_final.jsonl"
    assert attempt(forkserver, run, records) == 0
    assert read_records(records)[-1] == {"done": True}

    final = Path(run["out"])
    straight, resumed = state_tensors(reference, STEPS), state_tensors(final, STEPS)
    for name in straight:
        assert_same_tensors(straight[name], resumed[name], name)
    for component in ("transformer", "vae"):
        assert_same_tensors(load_safetensors_state_dict(reference / component),
                            load_safetensors_state_dict(final / component), component)
    log = [json.loads(line) for line in (final / "training" / "log.jsonl").read_text().splitlines()]
    reference_log = [json.loads(line) for line in (reference / "training" / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in log] == [(r["step"], r["loss"]) for r in reference_log]
    assert len(storage.snapshots(final / "training" / "state")) == 2  # the newest and the previous one
    storage.verify_manifest(final)


def test_export_killed_at_every_point_keeps_a_complete_checkpoint(setup, forkserver):
    root, base, reference = setup
    out = root / "export"
    shutil.copytree(reference / "training", out / "training")  # trained to the end: only the export runs
    run = {**base, "out": str(out)}
    assert attempt(forkserver, {**run, "export_ema": False}, root / "export_old.jsonl") == 0
    old = load_safetensors_state_dict(out / "transformer")
    new = load_safetensors_state_dict(reference / "transformer")
    assert not all(torch.equal(old[k], new[k]) for k in old)  # raw weights, not the EMA's
    kills = 0
    for point in range(1, 100):
        code = attempt(forkserver, run, root / f"export_{point}.jsonl", fault=f"kill:{point}")
        if code == 0:
            break
        assert code == -signal.SIGKILL
        kills += 1
        # Before the commit the old checkpoint is intact; after it a reader is told to finish the save; finished,
        # the checkpoint is the new one. Never a mixture.
        try:
            validate_checkpoint(out)
            in_place = load_safetensors_state_dict(out / "transformer")
            assert all(torch.equal(in_place[k], old[k]) for k in old) or \
                all(torch.equal(in_place[k], new[k]) for k in new), point
        except CheckpointError as error:
            assert "interrupted save" in str(error) and "\n" not in str(error)
            copy = root / f"recovered_{point}"
            shutil.copytree(out, copy, ignore=shutil.ignore_patterns("training"))
            assert storage.finish_interrupted_save(copy)
            validate_checkpoint(copy)
            storage.verify_manifest(copy)
            assert_same_tensors(load_safetensors_state_dict(copy / "transformer"), new, f"recovered at {point}")
            shutil.rmtree(copy)
    assert kills >= 10
    assert_same_tensors(load_safetensors_state_dict(out / "transformer"), new, "transformer")
    assert json.loads((out / "meta.json").read_text())["weights"] == "ema"
    storage.verify_manifest(out)
    assert not (out / storage.STAGING_DIR).exists()


# ---------------------------------------------------------------------------------------------------- the protocol


def _fill(values: dict[str, bytes]):
    def fill(folder: Path) -> None:
        for name, data in values.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
    return fill


def test_resume_falls_back_from_a_damaged_state_and_names_the_file(tmp_path, caplog):
    parent = tmp_path / "state"
    storage.save_snapshot(parent, 2, _fill({"model.safetensors": b"two" * 100}))
    storage.save_snapshot(parent, 4, _fill({"model.safetensors": b"four" * 100}))
    storage.save_snapshot(parent, 6, _fill({"model.safetensors": b"six" * 100}))
    assert [step for step, _ in storage.snapshots(parent)] == [6, 4]  # the previous good one is kept
    assert storage.latest_snapshot(parent)[0] == 6

    damaged = parent / "step-000000006" / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[10] ^= 0x01  # one flipped bit
    damaged.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="cosmos3_gym.storage"):
        assert storage.latest_snapshot(parent)[0] == 4
    assert any(str(damaged) in r.getMessage() for r in caplog.records)
    assert any("falling back" in r.getMessage() for r in caplog.records)

    (parent / "step-000000004" / "model.safetensors").write_bytes(b"four" * 50)  # truncated
    with pytest.raises(CheckpointError) as excinfo:
        storage.latest_snapshot(parent)
    assert str(damaged) in str(excinfo.value) and "\n" not in str(excinfo.value)
    # A staging folder a crash left behind is neither resumed from nor kept.
    (parent / ".step-000000008.partial").mkdir()
    storage.save_snapshot(parent, 8, _fill({"model.safetensors": b"eight"}))
    assert not (parent / ".step-000000008.partial").exists() and storage.latest_snapshot(parent)[0] == 8


def _train_tiny(tmp_path: Path, tiny_checkpoint: Path, **overrides):
    from cosmos3_gym.training import WorldModelTrainConfig, train_world_model

    values = dict(model=TINY_MODEL, chunk=CHUNK, steps=4, batch_size=2, warmup_steps=0, log_every=1, save_every=2,
                  ema_decay=0.9, progress=False, device="cpu", cache_dir=str(tmp_path / "cache"))
    values.update(overrides)
    dataset = tmp_path / "dataset"
    if not dataset.exists():
        make_dataset(dataset)
    return train_world_model(dataset, tmp_path / "out", WorldModelTrainConfig(**values), tiny_checkpoint / "vae")


def test_resume_refuses_damaged_state_files_with_one_line_errors(tmp_path, tiny_checkpoint, caplog):
    """Issue 43: a truncated state file gave a raw SafetensorError, a bad state.json a JSONDecodeError, flipped bits
    loaded silently; a crash between the two renames of the old protocol made --resume restart at step 0."""
    _train_tiny(tmp_path, tiny_checkpoint)
    state = tmp_path / "out" / "training" / "state"
    assert [step for step, _ in storage.snapshots(state)] == [4, 2]
    newest = state / "step-000000004"
    text = (newest / "state.json").read_text()
    (newest / "state.json").write_text("{not json" + text[9:])  # same size, other bytes
    with caplog.at_level("INFO"):
        _train_tiny(tmp_path, tiny_checkpoint, steps=6, resume=True)
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(newest / "state.json") in m and "sha256" in m for m in messages)
    assert any("continuing from step 2" in m for m in messages)  # the previous good state, said so
    assert [step for step, _ in storage.snapshots(state)] == [6, 4]

    for step, damage in ((6, lambda p: p.write_bytes(p.read_bytes()[:-100])), (4, lambda p: p.write_bytes(b"x"))):
        damage(storage.snapshot_path(state, step) / "model.safetensors")
    with pytest.raises(CheckpointError) as excinfo:
        _train_tiny(tmp_path, tiny_checkpoint, steps=8, resume=True)
    message = str(excinfo.value)
    assert str(state / "step-000000006" / "model.safetensors") in message and "\n" not in message


def test_an_export_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, tiny_checkpoint, monkeypatch):
    """Issue 43: export_checkpoint deleted the previous transformer/ and vae/ before writing the new ones."""
    from cosmos3_gym.training import export as export_module

    _train_tiny(tmp_path, tiny_checkpoint)
    out = tmp_path / "out"
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and "training" not in p.parts}

    def broken_validate(path):
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "validate_checkpoint", broken_validate)
    with pytest.raises(OSError, match="disk full"):
        _train_tiny(tmp_path, tiny_checkpoint, steps=6, resume=True)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and "training" not in p.parts}
    assert after == before


def test_single_files_are_replaced_atomically_and_checked(tmp_path):
    path = tmp_path / "policy.safetensors"
    storage.save_safetensors(path, {"w": torch.arange(6.0)}, {"kind": "x"})
    tensors, metadata = storage.load_safetensors(path, what="policy file")
    assert torch.equal(tensors["w"], torch.arange(6.0)) and metadata["kind"] == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["policy.safetensors"]  # no temporary left behind
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="policy file: .*policy.safetensors does not match the checksum"):
        storage.load_safetensors(path, what="policy file")
    path.write_bytes(bytes(data[:20]))
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        storage.load_safetensors(path, what="policy file")
    save_file({"w": torch.zeros(2)}, str(path))  # a file of an earlier version, without a checksum, still loads
    assert storage.load_safetensors(path)[0]["w"].shape == (2,)


def test_replace_entries_rolls_a_committed_save_forward_and_discards_an_uncommitted_one(tmp_path):
    folder = tmp_path / "model"
    storage.replace_entries(folder, _fill({"config.json": b"1", "weights/a.bin2": b"old"}))
    (folder / "train_log.jsonl").write_text("kept")
    # Crash after the commit, before the entries moved: a reader refuses it, the next save (or finish) completes it.
    journal = folder / storage.STAGING_DIR
    (journal / "ready" / "weights").mkdir(parents=True)
    (journal / "ready" / "weights" / "b.bin2").write_bytes(b"new")
    (journal / "ready" / "config.json").write_bytes(b"2")
    storage.write_manifest(journal / "ready")
    with pytest.raises(CheckpointError, match="interrupted save"):
        storage.check_no_interrupted_save(folder)
    assert storage.finish_interrupted_save(folder)
    assert (folder / "config.json").read_bytes() == b"2" and not (folder / "weights" / "a.bin2").exists()
    assert (folder / "train_log.jsonl").read_text() == "kept"
    storage.verify_manifest(folder)
    # Crash before the commit: the staged files are dropped and nothing in place changed.
    (journal / "new").mkdir(parents=True)
    (journal / "new" / "config.json").write_bytes(b"3")
    assert storage.finish_interrupted_save(folder)
    assert (folder / "config.json").read_bytes() == b"2" and not journal.exists()


def test_a_damaged_latent_cache_entry_is_encoded_again(tmp_path, tiny_checkpoint, caplog):
    _train_tiny(tmp_path, tiny_checkpoint, steps=1, save_every=0)
    (entry,) = [p for p in (tmp_path / "cache").rglob("episode_000000.safetensors")]
    good = storage.load_safetensors(entry)[0]["latents"]
    data = bytearray(entry.read_bytes())
    data[-3] ^= 0x40  # a flipped bit in the latents: loaded silently before issue 43
    entry.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        _train_tiny(tmp_path, tiny_checkpoint, steps=1, save_every=0)
    assert any(str(entry) in r.getMessage() and "encoding episode episode_000000 again" in r.getMessage()
               for r in caplog.records)
    # Written again with a good checksum (the host-side resize may round a unit differently off its thread pool).
    assert torch.allclose(storage.load_safetensors(entry)[0]["latents"], good, atol=1e-2)


# ---------------------------------------------------------------------------------------------------- every artifact


def _reward_model(seed: int):
    from cosmos3_gym.rewards import ClassifierRewardModel

    torch.manual_seed(seed)
    return ClassifierRewardModel(input_size=16, channels=(4, 8))


def _light_decoder(seed: int):
    from cosmos3_gym.models.light_decoder import LightDecoder, LightDecoderConfig

    torch.manual_seed(seed)
    return LightDecoder(LightDecoderConfig(channels=(8, 4), blocks=(1, 1)))


def _load_reward_model(path):
    from cosmos3_gym.rewards import ClassifierRewardModel

    return ClassifierRewardModel.load(path)


def _load_light_decoder(path):
    from cosmos3_gym.models.light_decoder import LightDecoder

    return LightDecoder.from_pretrained(path)


@pytest.mark.parametrize("build, save, load", [
    (_reward_model, lambda model, path: model.save(path), _load_reward_model),
    (_light_decoder, lambda model, path: model.save_pretrained(path), _load_light_decoder),
], ids=["reward_model", "light_decoder"])
def test_model_folders_are_replaced_whole_and_checked_on_load(tmp_path, monkeypatch, build, save, load):
    """Issue 43: the VAE, light-decoder and reward-model saves wrote in place (a crash left a half-new model)."""
    import safetensors.torch

    folder = tmp_path / "model"
    save(build(0), folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert "MANIFEST.json" in before
    real_save_file = safetensors.torch.save_file

    def crash(*args, **kwargs):
        real_save_file(*args, **kwargs)
        raise OSError("killed after the weights were written")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="killed"):
        save(build(1), folder)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the old model, whole
    first = load(folder).state_dict()
    save(build(1), folder)
    assert not all(torch.equal(first[k], v) for k, v in load(folder).state_dict().items())

    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x08
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{weights} does not match its sha256") as excinfo:
        load(folder)
    assert "\n" not in str(excinfo.value)


def test_policy_files_are_written_atomically_and_checked_on_load(tmp_path, tiny_ppo_model):
    from cosmos3_gym.agents import load_sb3_policy, save_sb3_policy
    from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig, load_policy_file, save_policy_file

    path = save_policy_file(PixelGaussianPolicy(PolicyConfig(image_size=16, channels=(4, 4), hidden=8)),
                            tmp_path / "bc.safetensors", env_steps=3)
    assert load_policy_file(path).metadata["env_steps"] == 3
    sb3 = save_sb3_policy(tiny_ppo_model, tmp_path / "ppo.safetensors")
    load_sb3_policy(sb3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bc.safetensors", "ppo.safetensors"]  # no temporaries
    assert storage.load_safetensors(sb3)[0].keys()  # its checksum verifies
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="policy file: .*bc.safetensors does not match the checksum"):
        load_policy_file(path)


def test_a_state_left_by_the_old_two_rename_protocol_is_resumed(tmp_path, tiny_checkpoint, caplog):
    """Issue 43: a crash between ``state -> state.old`` and ``state.tmp -> state`` left no ``state/``; --resume
    silently restarted at step 0 (and the next save deleted state.old)."""
    _train_tiny(tmp_path, tiny_checkpoint)
    state = tmp_path / "out" / "training" / "state"
    shutil.copytree(state / "step-000000004", tmp_path / "out" / "training" / "state.old")
    shutil.rmtree(state)
    with caplog.at_level("INFO"):
        _train_tiny(tmp_path, tiny_checkpoint, steps=6, resume=True)
    assert any("continuing from step 4" in r.getMessage() and "state.old" in r.getMessage() for r in caplog.records)
    assert [step for step, _ in storage.snapshots(state)] == [6]
