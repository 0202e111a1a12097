"""Client mode (``cosmos3_gym/executors/client.py``): worker processes running the SPMD engine, on the tiny checkpoint.

The clients use ``ParallelConfig(dp=2)`` (two gloo ranks, requests dealt between them) so that the results cross a
real process group, and fp32 on CPU. References come from an in-process single engine: the dp split only changes
batch composition (summation order), so results agree to ~1e-7 and 1e-5 relative is tight. Starting the workers
(fresh interpreters) dominates the cost, so one client serves the step tests.

The launch-style tests run a user's script the ways users run them (an unguarded file, ``python -``, ``python -c``)
with ``load_engine(..., tp=2)``: workers started by multiprocessing's spawn re-imported such a script and died.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from reference import relative_error

from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.executors.client import Cosmos3EngineClient, start_engine_client
from cosmos3_gym.parallel.mesh import ParallelConfig

BASE = dict(domain="pusht", chunk=4, num_inference_steps=2, fps=15.0, resolution_tier=256)
ENGINE_KWARGS = dict(device="cpu", dtype="fp32", progress=False)


def image(seed: int, size=(200, 280)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def requests() -> list[Cosmos3Request]:
    actions = np.random.default_rng(1).uniform(-1, 1, (4, 2)).astype(np.float32)
    return [
        Cosmos3Request("policy", image(1), "push the T", guidance_scale=2.5, seed=1, **BASE),
        Cosmos3Request("forward_dynamics", image(2), "push", action=actions, guidance_scale=3.0, seed=2, **BASE),
        Cosmos3Request("policy", image(3), "reach", guidance_scale=1.0, seed=3, **BASE),
    ]


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Cosmos3Engine:
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def client(tiny_checkpoint) -> Cosmos3EngineClient:
    client = start_engine_client(tiny_checkpoint, ParallelConfig(dp=2), **ENGINE_KWARGS)
    yield client
    client.close()


def test_step_equals_in_process_engine(client, engine):
    expected = engine.step(requests(), decode=True)
    results = client.step(requests(), decode=True)
    assert len(results) == len(expected)
    for result, reference in zip(results, expected):
        assert (result.mode, result.seed) == (reference.mode, reference.seed)
        assert result.action.shape == reference.action.shape and result.action.dtype == np.float32
        assert relative_error(result.action, reference.action) < 1e-5
        assert relative_error(result.video_latents, reference.video_latents) < 1e-5
        assert relative_error(result.pixels, reference.pixels) < 1e-5
    single = client.step(requests()[0], decode=False)  # one request in, one result out, as on the engine
    assert single.pixels is None and relative_error(single.action, expected[0].action) < 1e-5


def test_bad_request_raises_input_error_and_client_stays_usable(client, engine):
    bad = Cosmos3Request("policy", image(0), "push", **{**BASE, "chunk": 0})
    with pytest.raises(InputError) as in_process:
        engine.step(bad)
    with pytest.raises(InputError) as through_client:
        client.step([requests()[0], bad])
    assert type(through_client.value) is InputError and str(through_client.value) == str(in_process.value)
    assert client.step(requests()[0], decode=False).action.shape == (4, 2)


def test_client_forwards_optimize_offload_and_onload(client, engine):
    """The WorldModelEngine methods run on the workers (not faked here): after optimize (compiled blocks on CPU) and
    an offload, a step still gives the in-process result."""
    assert client.optimize() is client
    client.offload()
    client.onload()
    client.offload()  # the next step onloads by itself
    result = client.step(requests()[0], decode=False)
    assert relative_error(result.action, engine.step(requests()[0], decode=False).action) < 1e-5
    assert (client.device, client.vae, client.is_output_rank) == (torch.device("cpu"), None, True)


def test_close_stops_the_workers_and_is_idempotent(client):
    pids = client.worker_pids
    client.close()
    assert client.worker_exitcodes == [0, 0]  # they exited on the close command
    assert all(gone(pid) for pid in pids)
    client.close()
    assert client.closed
    with pytest.raises(RuntimeError, match="closed"):
        client.step(requests()[0])


def test_bad_checkpoint_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError) as in_process:
        Cosmos3Engine.from_pretrained(tmp_path / "missing", **ENGINE_KWARGS)
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(CheckpointError) as through_client:
        start_engine_client(tmp_path / "missing", ParallelConfig(dp=2), **ENGINE_KWARGS)
    assert str(through_client.value) == str(in_process.value)
    workers = {child.pid for child in psutil.Process().children(recursive=True)} - before
    assert all(gone(pid) for pid in workers)


def test_a_worker_that_fails_at_startup_reports_its_own_exception(tiny_checkpoint):
    """Not a user error: the caller's RuntimeError carries the worker's exception and traceback, not just an exit
    code. (An unknown device string fails inside torch, in the worker.)"""
    with pytest.raises(RuntimeError) as failure:
        start_engine_client(tiny_checkpoint, ParallelConfig(), device="nodevice", dtype="fp32", progress=False)
    message = str(failure.value)
    assert "worker rank 0 raised during startup: RuntimeError" in message
    assert "nodevice" in message and "Traceback (most recent call last)" in message


def test_a_worker_that_dies_before_connecting_reports_its_stderr(tiny_checkpoint, tmp_path, monkeypatch):
    """A worker that cannot even start the engine code (here: an interpreter that prints a traceback and exits) is
    reported with the end of its stderr."""
    import cosmos3_gym.executors.client as client_module

    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                           "echo 'ModuleNotFoundError: No module named cosmos3_gym' >&2\nexit 1\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(client_module.sys, "executable", str(fake_python))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)worker rank \d \(pid \d+\) exited with code 1 during startup; its "
                                           r"stderr ended with:.*ModuleNotFoundError: No module named cosmos3_gym"):
        start_engine_client(tiny_checkpoint, ParallelConfig(dp=2), **ENGINE_KWARGS)
    assert time.monotonic() - start < 10


def test_killed_worker_fails_the_next_step_quickly(tiny_checkpoint):
    client = start_engine_client(tiny_checkpoint, ParallelConfig(dp=2), **ENGINE_KWARGS)
    pids = client.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 .*SIGKILL"):
        client.step(requests()[0])
    assert time.monotonic() - start < 10
    assert all(gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed: worker rank 1"):
        client.step(requests()[0])
    client.close()


class _BrokenPipe:
    """A connection whose worker end is gone: what ``send`` sees when it beats the worker's exit being reaped."""

    def send_bytes(self, message):
        raise BrokenPipeError(32, "Broken pipe")

    def close(self):
        pass


def test_a_broken_pipe_to_a_dead_worker_names_how_it_ended(tiny_checkpoint):
    client = start_engine_client(tiny_checkpoint, ParallelConfig(dp=2), **ENGINE_KWARGS)
    pids = client.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    client._workers[1].connection = _BrokenPipe()
    client._check_open = lambda: None  # the window in which the send fails before the worker's exit is reaped
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL .*could not send"):
        client.step(requests()[0])
    assert all(gone(pid) for pid in pids)
    client.close()


# A user's script as CleanRL-style scripts are written: no ``if __name__ == "__main__":`` guard. It exits without
# close(): the client's finalizer must stop the workers.
UNGUARDED_SCRIPT = """
import json, sys
import numpy as np
from cosmos3_gym import Cosmos3Request, load_engine

engine = load_engine(sys.argv[1], tp=2, device="cpu", dtype="fp32", progress=False)
frame = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
result = engine.step(Cosmos3Request("policy", frame, "push", domain="pusht", chunk=4, num_inference_steps=2,
                                    resolution_tier=256, seed=1), decode=False)
print(json.dumps({"pids": engine.worker_pids, "action": result.action.tolist()}), flush=True)
"""


@pytest.fixture(scope="module")
def tp2_reference_action(tiny_checkpoint) -> np.ndarray:
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, **ENGINE_KWARGS)
    frame = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    return engine.step(Cosmos3Request("policy", frame, "push", domain="pusht", chunk=4, num_inference_steps=2,
                                      resolution_tier=256, seed=1), decode=False).action


@pytest.mark.parametrize("style", ["file", "stdin", "dash_c"])
def test_unguarded_scripts_start_tp2_workers_and_leave_none(style, tiny_checkpoint, tp2_reference_action, tmp_path):
    """``python script.py``, ``python - < script`` and ``python -c script``: the workers start (they never import the
    caller's __main__), the tp=2 result equals the single-process one, and at exit no worker and no leaked
    semaphore (resource_tracker warning) is left."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    if style == "file":
        script = tmp_path / "unguarded.py"
        script.write_text(UNGUARDED_SCRIPT)
        command, stdin = [sys.executable, str(script), str(tiny_checkpoint)], None
    elif style == "stdin":
        command, stdin = [sys.executable, "-", str(tiny_checkpoint)], UNGUARDED_SCRIPT
    else:
        command, stdin = [sys.executable, "-c", UNGUARDED_SCRIPT, str(tiny_checkpoint)], None
    run = subprocess.run(command, input=stdin, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resource_tracker" not in run.stderr and "leaked" not in run.stderr, run.stderr[-3000:]
    printed = json.loads(run.stdout.strip().splitlines()[-1])
    assert relative_error(printed["action"], tp2_reference_action) < 1e-5
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in printed["pids"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in printed["pids"])


def test_gym_make_with_cfg_2_runs_the_env_on_worker_processes(tiny_checkpoint):
    """gym.make(..., cfg_parallel=2) starts the workers itself (load_engine); its first step equals the in-process
    env's."""
    import gymnasium as gym

    import cosmos3_gym  # noqa: F401  (registers the env ids)

    image = np.random.default_rng(3).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    kwargs = dict(checkpoint=tiny_checkpoint, domain="pusht", task="push", chunk=4, num_steps=2,
                  guidance_scale=2.0, resolution_tier=256, initial_states=[image], device="cpu")
    frames = []
    for parallel in ({}, {"cfg_parallel": 2}):
        env = gym.make("cosmos3_gym/WorldModel-v0", **kwargs, **parallel)
        try:
            env.reset(seed=0)
            obs, *_ = env.step(np.full((4, 2), 0.25, dtype=np.float32))
            frames.append(obs["image"].astype(int))
            if parallel:
                assert type(env.unwrapped.engine).__name__ == "Cosmos3EngineClient"
        finally:
            env.close()
    assert np.abs(frames[0] - frames[1]).max() <= 1  # uint8 frames; fp32 differences below one level


def _listening_tcp_sockets() -> list[tuple[str, int, int]]:
    """(address, port, socket inode) of every TCP socket in LISTEN state, from /proc/net/tcp and /proc/net/tcp6."""
    import ipaddress

    found = []
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != "0A":  # TCP_LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word in host order
            found.append((str(ipaddress.ip_address(raw)), int(port, 16), inode))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net")
def test_workers_listen_on_loopback_only(tiny_checkpoint):
    """Issue 43: with MASTER_ADDR=127.0.0.1, torch's TCPStore still listened on [::]:PORT, an unauthenticated store
    any host could reach. While a tp=2 engine runs, no socket of ours listens outside loopback."""
    client = start_engine_client(tiny_checkpoint, ParallelConfig(tp=2), **ENGINE_KWARGS)
    try:
        rendezvous = Path(client._rendezvous_dir)
        assert rendezvous.is_dir() and rendezvous.stat().st_mode & 0o077 == 0  # only this user can open it
        client.step(requests()[0])  # the ranks talk to each other
        ours = {inode: pid for pid in (os.getpid(), *client.worker_pids) for inode in _socket_inodes(pid)}
        listening = [(address, port, ours[inode]) for address, port, inode in _listening_tcp_sockets()
                     if inode in ours]
        assert listening, "the gloo ranks listen on loopback; finding none means the sockets were not read"
        exposed = [entry for entry in listening if not _is_loopback(entry[0])]
        assert not exposed, f"listening outside loopback (address, port, pid): {exposed}"
    finally:
        client.close()
    assert not rendezvous.exists()
