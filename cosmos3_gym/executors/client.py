"""Client mode: an SPMD engine of ``config.world_size`` ranks run by worker processes this module starts.

``load_engine(path, tp=2, cfg_parallel=2)`` outside torchrun lands here (vLLM's executor/worker split). The caller's
process stays light: no model, no process group. Each rank is a fresh ``python -m cosmos3_gym.executors.worker``
process (``executors/worker.py``) with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
OMP_NUM_THREADS=1, NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless already set). Workers never
import the caller's ``__main__``, so this works from unguarded scripts, ``python -``, ``python -c`` and notebooks.
Each worker connects back to a ``multiprocessing.connection.Listener`` (a Unix socket; a random authentication key,
handed over on the worker's stdin) and builds its rank with ``Cosmos3Engine.from_pretrained(path, parallel=config,
...)``. Every command (step, optimize, offload, onload, close) goes to every rank; rank 0's reply carries the results
(every rank computes the same ones).

Security model: the workers are reachable only from this machine, and only by their user. They rendezvous through
a ``torch.distributed`` file store in a private temporary folder (mode 0700, removed when the engine closes), never
through torch's TCP store, which listens on every interface without authentication, and gloo / NCCL open their
sockets on the loopback interface only (GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo on Linux); the client's
command channel is an authenticated Unix socket. Engines that span machines are started explicitly by torchrun (or
Ray, ``executors/ray_replicas.py``), whose rendezvous must run on a network that only the cluster's hosts can reach.

Failure handling, so that a caller never hangs on a dead engine: the client waits on the workers' connections with a
short timeout and checks their exit codes in between. A worker that exits (killed, crashed) or raises anything but
``InputError`` fails the current or next call with a ``RuntimeError`` naming the rank, its exit code or exception
with the worker's traceback (or, for a worker that died before it could report, the last lines of its stderr), after
all workers have been terminated (then killed). ``InputError`` (bad request, bad checkpoint at startup:
``CheckpointError``) is raised again in the caller with the same type and message; after a bad request the workers
stay usable (the SPMD engine raises it on every rank before any collective). Workers also exit on their own when the
client's end of their connection closes (the caller died). ``close()``, garbage collection and interpreter exit stop
the workers.
"""

from __future__ import annotations

import codecs
import multiprocessing
import multiprocessing.connection
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..parallel.mesh import ParallelConfig
from .messages import RENDEZVOUS_ENV_VAR, USER_ERRORS, receive, send
from .remote import RemoteEngine

# After one rank reports a bad request, how long the others may take to report theirs before the ranks are declared
# out of step (the SPMD engine raises on all ranks together; a rank that did not would be waiting in a collective).
_DIVERGENCE_TIMEOUT_S = 60.0
_SHUTDOWN_GRACE_S = 10.0
_PEER_DEATH_WAIT_S = 2.0
_POLL_S = 0.2  # how often a waiting client checks that its workers are alive
_STDERR_TAIL_BYTES = 8192  # what an error message quotes of a worker's stderr (its traceback)
# The directory that holds this package, put on the workers' path so that they import the same cosmos3_gym.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def start_engine_client(path_or_id: str | Path, config: ParallelConfig, **engine_kwargs) -> Cosmos3EngineClient:
    """Start ``config.world_size`` workers that each build their rank of the SPMD engine; returns once all have
    loaded the checkpoint. ``engine_kwargs`` go to ``Cosmos3Engine.from_pretrained`` on every worker."""
    return Cosmos3EngineClient(path_or_id, config, engine_kwargs)


class _Worker:
    """One worker process: its ``Popen``, its connection once it has connected, and the tail of its stderr (which
    is passed through to this process's stderr as it comes, so that warnings and progress bars show where the caller
    looks, a notebook included)."""

    def __init__(self, rank: int, address, authkey: bytes, env: dict[str, str]):
        self.rank = rank
        self.connection: multiprocessing.connection.Connection | None = None
        self.stderr_tail = bytearray()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cosmos3_gym.executors.worker", str(address)],
            env=env,
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.process.stdin is not None  # stdin=PIPE
        try:
            self.process.stdin.write(authkey.hex().encode() + b"\n")
            self.process.stdin.close()
        except BrokenPipeError:
            pass  # it exited already: the client reports how, with its stderr
        self._pump = threading.Thread(target=self._pump_stderr, name=f"cosmos3-worker-{rank}-stderr", daemon=True)
        self._pump.start()

    def _pump_stderr(self) -> None:
        # Raw chunks, not lines: a progress bar's carriage returns pass through as they are.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stderr = self.process.stderr
        assert stderr is not None  # stderr=PIPE
        while chunk := os.read(stderr.fileno(), 65536):
            self.stderr_tail += chunk
            del self.stderr_tail[:-_STDERR_TAIL_BYTES]
            try:
                sys.stderr.write(decoder.decode(chunk))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # this process's stderr is closed (interpreter exit): keep only the tail
        stderr.close()

    @property
    def conn(self) -> multiprocessing.connection.Connection:
        """The connection of a connected worker (``_accept_all`` connects every worker before any command)."""
        assert self.connection is not None
        return self.connection

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def describe_exit(self, context: str = "") -> str:
        """How the worker ended, then ``context`` (e.g. " during startup"), then the last lines it wrote to stderr
        (its traceback, if it printed one)."""
        self._pump.join(timeout=2.0)  # the rest of its stderr
        exitcode = self.process.returncode
        if exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
            except ValueError:
                how = f"was killed by signal {-exitcode} (exit code {exitcode})"
        else:
            how = f"exited with code {exitcode}"
        # A worker that exited on its own may have printed why (a traceback before it could report one).
        lines = self.stderr_tail.decode(errors="replace").strip().splitlines()[-30:] if exitcode > 0 else []
        tail = "\n".join(lines)
        return f"worker rank {self.rank} (pid {self.pid}) {how}{context}" + (
            f"; its stderr ended with:\n{tail}\n" if tail else ""
        )


class Cosmos3EngineClient(RemoteEngine):
    """The caller's handle on the workers; implements ``WorldModelEngine`` (``engine_protocol.py``). A context
    manager."""

    def __init__(self, path_or_id: str | Path, config: ParallelConfig, engine_kwargs: dict[str, Any]):
        if not isinstance(config, ParallelConfig):
            raise InputError(f"config: expected a ParallelConfig, got {type(config).__name__}")
        self.config = config
        self.preset = engine_kwargs.get("preset")  # as Cosmos3Engine.preset: the envs and agents on it take it
        self._lock = threading.Lock()
        self._failure: str | None = None  # why the client stopped, for the error of later calls
        authkey = secrets.token_bytes(32)
        self._listener = multiprocessing.connection.Listener(authkey=authkey)
        self._workers: list[_Worker] = []
        # The ranks' rendezvous: a file store in a folder only this user can open (module docstring).
        self._rendezvous_dir = tempfile.mkdtemp(prefix="cosmos3-gym-rendezvous-")
        # Stops the workers on close(), on garbage collection and at interpreter exit (it must not refer to self).
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, True, self._rendezvous_dir)
        try:
            env = _worker_environment(config.world_size, os.path.join(self._rendezvous_dir, "store"))
            for rank in range(config.world_size):
                self._workers.append(
                    _Worker(rank, self._listener.address, authkey, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                )
            self._accept_all(authkey)
            for worker in self._workers:
                self._send(worker, ("load", str(path_or_id), config, engine_kwargs), "startup")
        except BaseException as error:
            self._stop(f"starting the workers failed: {error}")
            raise
        finally:
            self._listener.close()
        facts = self._receive_all("startup")[0]
        self._action_dim: int = facts["action_dim"]
        self._temporal_compression: int = facts["temporal_compression"]

    # ------------------------------------------------------------------ the engine API (WorldModelEngine)

    def step(self, requests, *, decode: bool | None = None):
        """Run one request (returns a ``Cosmos3Result``) or a list (returns a list, in order) on the workers."""
        return self._command("step", requests, decode)[0]

    def optimize(self, **options) -> Cosmos3EngineClient:
        """``Cosmos3Engine.optimize(**options)`` on every rank (compile, CUDA graphs, overlap); returns self."""
        self._command("optimize", options)
        return self

    def offload(self) -> None:
        """Every worker moves its model shard to host memory (frees the GPUs between rollouts)."""
        self._command("offload")

    def onload(self) -> None:
        self._command("onload")

    def close(self) -> None:
        """Stop the workers (idempotent): ask them to exit, then terminate and kill any that do not."""
        with self._lock:
            if self._finalizer.alive:
                self._failure = "close() was called"
                self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    @property
    def worker_exitcodes(self) -> list[int | None]:
        """Exit code of each rank's worker, None while it runs (negative: killed by that signal)."""
        return [worker.exitcode for worker in self._workers]

    def __repr__(self) -> str:
        state = f"closed ({self._failure})" if self.closed else f"workers {self.worker_pids}"
        return f"Cosmos3EngineClient({self.config}, {state})"

    # ------------------------------------------------------------------ talking to the workers

    def _command(self, name: str, *args) -> list[Any]:
        with self._lock:
            self._check_open()
            for worker in self._workers:
                self._send(worker, (name, *args), name)
            return self._receive_all(name)

    def _send(self, worker: _Worker, message, what: str) -> None:
        try:
            send(worker.conn, message)
        except (OSError, ValueError) as error:
            self._send_failed(worker, what, error)

    def _accept_all(self, authkey: bytes) -> None:
        """Wait until every worker has connected (and authenticated); a worker that exits first fails the start
        with its stderr. ``Listener.accept`` has no timeout, so it runs on a thread."""
        accepted: queue.Queue = queue.Queue()
        done = threading.Event()

        def accept() -> None:
            while not done.is_set():
                try:
                    connection = self._listener.accept()
                except multiprocessing.AuthenticationError:
                    continue  # not one of our workers
                except OSError:
                    return
                accepted.put(connection)

        thread = threading.Thread(target=accept, name="cosmos3-client-accept", daemon=True)
        thread.start()
        try:
            pending = {worker.rank for worker in self._workers}
            while pending:
                try:
                    connection = accepted.get(timeout=_POLL_S)
                except queue.Empty:
                    for worker in self._workers:
                        if worker.rank in pending and worker.exitcode is not None:
                            self._fail(worker.describe_exit(" during startup"))
                    continue
                _, rank, _ = receive(connection)
                self._workers[rank].connection = connection
                pending.discard(rank)
        finally:
            # Closing the listener does not wake a thread blocked in accept (Linux): connect once to release it.
            done.set()
            try:
                multiprocessing.connection.Client(self._listener.address, authkey=authkey).close()
            except OSError:
                pass
            thread.join(timeout=5.0)
            self._listener.close()

    def _receive_all(self, what: str) -> list[Any]:
        """Each rank's reply to the current command, in rank order; raises (after stopping the workers if they are
        no longer usable) if a rank failed."""
        replies: dict[int, tuple] = {}
        first_user_error_at = None
        try:
            while len(replies) < len(self._workers):
                pending = [worker for worker in self._workers if worker.rank not in replies]
                ready = multiprocessing.connection.wait([worker.conn for worker in pending], timeout=_POLL_S)
                # Replies first: a worker that reports its error and then exits should be reported by its error.
                for worker in pending:
                    if worker.conn in ready or worker.conn.poll():
                        try:
                            replies[worker.rank] = receive(worker.conn)
                        except (EOFError, OSError):
                            pass  # it died; its exit code is reported below
                crashes = [
                    (rank, reply)
                    for rank, reply in sorted(replies.items())
                    if reply[0] == "error" and reply[1] not in USER_ERRORS
                ]
                if crashes:
                    # A rank whose peer died fails in its next collective; name the dead peer as the cause.
                    deadline = time.monotonic() + _PEER_DEATH_WAIT_S
                    silent = [worker for worker in self._workers if worker.rank not in replies]
                    while time.monotonic() < deadline and all(worker.exitcode is None for worker in silent):
                        time.sleep(0.05)
                for worker in self._workers:
                    if worker.rank not in replies and worker.exitcode is not None:
                        consequence = f" (then rank {crashes[0][0]} raised: {crashes[0][1][2]})" if crashes else ""
                        self._fail(worker.describe_exit(f" during {what}{consequence}"))
                if crashes:
                    rank, (_, kind, message, worker_traceback) = crashes[0]
                    self._fail(f"worker rank {rank} raised during {what}: {kind}: {message}\n{worker_traceback}")
                user_errors = [reply for reply in replies.values() if reply[0] == "error"]
                if user_errors and what == "startup":
                    break  # nothing to keep in step: the engine is not coming up
                if user_errors:
                    first_user_error_at = first_user_error_at or time.monotonic()
                    if time.monotonic() - first_user_error_at > _DIVERGENCE_TIMEOUT_S:
                        self._fail(
                            f"worker ranks {sorted(replies)} reported an error during {what} but ranks "
                            f"{[worker.rank for worker in pending]} did not answer within "
                            f"{_DIVERGENCE_TIMEOUT_S:.0f} s: the ranks are out of step"
                        )
        except BaseException as error:
            # An interrupt (or our own RuntimeError) mid-command leaves the workers at an unknown point: stop them.
            self._stop(f"interrupted by {type(error).__name__} during {what}")
            raise
        errors = [reply for _, reply in sorted(replies.items()) if reply[0] == "error"]
        if errors:
            _, kind, message, _ = errors[0]
            if what == "startup":
                self._stop(f"startup failed: {message}")
            raise USER_ERRORS[kind](message)
        return [replies[rank][1] for rank in range(len(self._workers))]

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"Cosmos3EngineClient is closed: {self._failure}")
        dead = [worker for worker in self._workers if worker.exitcode is not None]
        if dead:
            self._fail(dead[0].describe_exit())

    def _fail(self, message: str):
        self._stop(message)
        raise RuntimeError(f"Cosmos3EngineClient: {message}; all workers were stopped")

    def _stop(self, reason: str) -> None:
        """Stop the workers without asking (they failed, or are at an unknown point); keeps the first reason."""
        if self._finalizer.detach() is not None:
            self._failure = reason
            _shutdown(self._workers, graceful=False, rendezvous_dir=self._rendezvous_dir)

    def _send_failed(self, worker: _Worker, what: str, error: Exception):
        """A send fails once the worker's end of the connection is gone, which can be before its exit is reaped:
        wait for that a moment, so that the error says how the worker ended."""
        try:
            worker.process.wait(timeout=_PEER_DEATH_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        if worker.exitcode is not None:
            self._fail(worker.describe_exit(f" (could not send {what}: {error})"))
        exits = {w.rank: w.exitcode for w in self._workers if w.exitcode is not None}
        self._fail(
            f"could not send {what} to worker rank {worker.rank}: {error}; "
            + (f"exit codes by rank: {exits}" if exits else "all workers still running")
        )


def _worker_environment(world_size: int, rendezvous_file: str) -> dict[str, str]:
    """torchrun's environment for the ranks of one host (RANK and LOCAL_RANK are added per worker), with the
    rendezvous through ``rendezvous_file`` (a file store) instead of torch's TCP store, and the collectives' sockets
    on the loopback interface (module docstring: security model)."""
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    env[RENDEZVOUS_ENV_VAR] = rendezvous_file
    if sys.platform.startswith("linux"):
        env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    if world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks on one host would oversubscribe the cores
    # NVLink SHARP / symmetric-memory multicast stay off unless the user's environment says otherwise.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if Path(_PACKAGE_ROOT).name not in ("site-packages", "dist-packages"):
        # A source checkout (or PYTHONPATH / the current directory): the workers must import the same package.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _shutdown(workers: list[_Worker], graceful: bool = True, rendezvous_dir: str | None = None) -> None:
    """Ask every live worker to exit (``graceful``) and wait a little, then terminate and finally kill the rest;
    then remove the rendezvous folder."""
    if graceful:
        for worker in workers:
            if worker.exitcode is None and worker.connection is not None:
                try:
                    send(worker.connection, ("close",))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for worker in workers:
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for stop in ("terminate", "kill"):
        alive = [worker for worker in workers if worker.exitcode is None]
        for worker in alive:
            getattr(worker.process, stop)()
        for worker in alive:
            try:
                worker.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
    for worker in workers:
        if worker.connection is not None:
            worker.connection.close()
    if rendezvous_dir is not None:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
