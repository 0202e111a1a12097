"""Client mode: an SPMD engine of ``config.world_size`` ranks run by worker processes this module starts.

``Cosmos3Engine.from_pretrained(path, tp=2, cfg=2)`` outside torchrun lands here (vLLM's executor/worker split). The
caller's process stays light: no model, no process group. It starts one worker per rank (``spawn`` start method by
default, so CUDA state is never forked; ``forkserver`` on request). Each worker sets the torchrun environment
(MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK; NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless already set) and builds the SPMD engine with
``Cosmos3Engine.from_pretrained(path, parallel=config, ...)``, which joins the process group itself. Then every worker
loops: receive a command over its pipe, run it, reply; rank 0's reply carries the results (every rank computes the
same ones).

Failure handling, so that a caller never hangs on a dead engine: the client waits on the workers' pipes and on their
process sentinels together. A worker that exits (killed, crashed) or raises anything but ``InputError`` fails the
current or next call with a ``RuntimeError`` naming the rank and its exit code or exception, after all workers have
been terminated (then killed). ``InputError`` (bad request, bad checkpoint at startup: ``CheckpointError``) is raised
again in the caller with the same type and message; after a bad request the workers stay usable (the SPMD engine
raises it on every rank before any collective). Workers also exit on their own when the client's end of their pipe
closes (the caller died). ``close()``, garbage collection and interpreter exit stop the workers.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing

from ..errors import CheckpointError, InputError
from .mesh import ParallelConfig

# The error types a worker reports by name and the client raises again as themselves.
_USER_ERRORS = {"CheckpointError": CheckpointError, "InputError": InputError}
# After one rank reports a bad request, how long the others may take to report theirs before the ranks are declared
# out of step (the SPMD engine raises on all ranks together; a rank that did not would be waiting in a collective).
_DIVERGENCE_TIMEOUT_S = 60.0
_SHUTDOWN_GRACE_S = 10.0
_PEER_DEATH_WAIT_S = 2.0
START_METHODS = ("spawn", "forkserver")


def start_engine_client(
    path_or_id: str | Path, config: ParallelConfig, *, start_method: str = "spawn", **engine_kwargs
) -> "Cosmos3EngineClient":
    """Start ``config.world_size`` worker processes that each build their rank of the SPMD engine; returns once all
    have loaded the checkpoint. ``engine_kwargs`` go to ``Cosmos3Engine.from_pretrained`` on every worker.

    ``start_method`` "forkserver" forks the workers from one server process that imported the engine once, which
    saves each worker the imports (seconds) where cores are few; "spawn" starts each from a fresh interpreter.
    Both are safe with CUDA ("fork" is not offered: it would copy the caller's CUDA and thread state).
    """
    return Cosmos3EngineClient(path_or_id, config, engine_kwargs, start_method=start_method)


class Cosmos3EngineClient:
    """The caller's handle on the workers: ``step`` and ``close`` as on ``Cosmos3Engine``; a context manager."""

    def __init__(
        self, path_or_id: str | Path, config: ParallelConfig, engine_kwargs: dict[str, Any], *,
        start_method: str = "spawn",
    ):
        if not isinstance(config, ParallelConfig):
            raise InputError(f"config: expected a ParallelConfig, got {type(config).__name__}")
        if start_method not in START_METHODS:
            raise InputError(f"start_method: expected one of {list(START_METHODS)}, got {start_method!r}")
        self.config = config
        self._lock = threading.Lock()
        self._failure: str | None = None  # why the client stopped, for the error of later calls
        context = torch.multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Only takes effect if this process has not started its fork server yet.
            context.set_forkserver_preload(["cosmos3_gym.engine"])
        port = _free_port()
        self._connections, self._processes = [], []
        # Stops the workers on close(), on garbage collection and at interpreter exit (it must not refer to self).
        self._finalizer = weakref.finalize(self, _shutdown, self._processes, self._connections)
        try:
            for rank in range(config.world_size):
                ours, theirs = context.Pipe(duplex=True)
                process = context.Process(
                    target=_worker_main,
                    args=(rank, port, str(path_or_id), config, engine_kwargs, theirs),
                    name=f"cosmos3-worker-{rank}",
                    daemon=True,  # multiprocessing also terminates daemonic workers at interpreter exit
                )
                self._connections.append(ours)
                process.start()
                self._processes.append(process)
                theirs.close()  # only the worker holds its end now: when it dies, our end sees EOF
        except BaseException as error:
            self._stop(f"starting the workers failed: {error}")
            raise
        facts = self._receive_all("startup")[0]
        self.action_dim: int = facts["action_dim"]
        self.temporal_compression: int = facts["temporal_compression"]

    # The model lives in the workers; what the caller sees of it (results come back on the CPU, where a caller's
    # reward model runs). There is no VAE here: latent-space reward models need an in-process engine.
    device = torch.device("cpu")
    vae = None

    # ------------------------------------------------------------------ the engine API

    def step(self, requests, *, decode: bool | None = None):
        """Run one request (returns a ``Cosmos3Result``) or a list (returns a list, in order) on the workers."""
        with self._lock:
            self._check_open()
            for rank, connection in enumerate(self._connections):
                try:
                    connection.send(("step", requests, decode))
                except (OSError, ValueError) as error:
                    self._send_failed(rank, "the request", error)
            return self._receive_all("step")[0]

    def offload(self) -> None:
        """Every worker moves its model shard to host memory (frees the GPUs between rollouts)."""
        self._command("offload")

    def onload(self) -> None:
        self._command("onload")

    def _command(self, name: str) -> None:
        with self._lock:
            self._check_open()
            for rank, connection in enumerate(self._connections):
                try:
                    connection.send((name,))
                except (OSError, ValueError) as error:
                    self._send_failed(rank, name, error)
            self._receive_all(name)

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
        return [process.pid for process in self._processes]

    @property
    def worker_exitcodes(self) -> list[int | None]:
        """Exit code of each rank's worker, None while it runs (negative: killed by that signal)."""
        return [process.exitcode for process in self._processes]

    def __enter__(self) -> "Cosmos3EngineClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"closed ({self._failure})" if self.closed else f"workers {self.worker_pids}"
        return f"Cosmos3EngineClient({self.config}, {state})"

    # ------------------------------------------------------------------ waiting for the workers

    def _receive_all(self, what: str) -> list[Any]:
        """Each rank's reply to the current command, in rank order; raises (after stopping the workers if they are no
        longer usable) if a rank failed."""
        replies: dict[int, tuple] = {}
        first_user_error_at = None
        try:
            while len(replies) < len(self._processes):
                pending = [rank for rank in range(len(self._processes)) if rank not in replies]
                waitables = [self._connections[rank] for rank in pending] + [p.sentinel for p in self._processes]
                ready = multiprocessing.connection.wait(waitables, timeout=1.0)
                # Replies first: a worker that reports its error and then exits should be reported by its error.
                for rank in pending:
                    if self._connections[rank] in ready or self._connections[rank].poll():
                        try:
                            replies[rank] = self._connections[rank].recv()
                        except (EOFError, OSError):
                            pass  # it died; its exit code is reported below
                crashes = [(rank, reply) for rank, reply in sorted(replies.items())
                           if reply[0] == "error" and reply[1] not in _USER_ERRORS]
                if crashes:
                    # A rank whose peer died fails in its next collective; name the dead peer as the cause.
                    pending_sentinels = [self._processes[rank].sentinel for rank in pending if rank not in replies]
                    multiprocessing.connection.wait(pending_sentinels, timeout=_PEER_DEATH_WAIT_S)
                for rank, process in enumerate(self._processes):
                    if rank not in replies and process.exitcode is not None:
                        consequence = f" (then rank {crashes[0][0]} raised: {crashes[0][1][2]})" if crashes else ""
                        self._fail(f"worker rank {rank} (pid {process.pid}) {_describe_exit(process.exitcode)} "
                                   f"during {what}{consequence}")
                if crashes:
                    rank, (_, kind, message, worker_traceback) = crashes[0]
                    self._fail(f"worker rank {rank} raised during {what}: {kind}: {message}\n{worker_traceback}")
                user_errors = [reply for reply in replies.values() if reply[0] == "error"]
                if user_errors and what == "startup":
                    break  # nothing to keep in step: the engine is not coming up
                if user_errors:
                    first_user_error_at = first_user_error_at or time.monotonic()
                    if time.monotonic() - first_user_error_at > _DIVERGENCE_TIMEOUT_S:
                        self._fail(f"worker ranks {sorted(replies)} reported an error during {what} but ranks "
                                   f"{pending} did not answer within {_DIVERGENCE_TIMEOUT_S:.0f} s: the ranks are "
                                   f"out of step")
        except BaseException as error:
            # An interrupt (or our own RuntimeError) mid-command leaves the workers at an unknown point: stop them.
            self._stop(f"interrupted by {type(error).__name__} during {what}")
            raise
        errors = [reply for _, reply in sorted(replies.items()) if reply[0] == "error"]
        if errors:
            _, kind, message, _ = errors[0]
            if what == "startup":
                self._stop(f"startup failed: {message}")
            raise _USER_ERRORS[kind](message)
        return [replies[rank][1] for rank in range(len(self._processes))]

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"Cosmos3EngineClient is closed: {self._failure}")
        dead = [(rank, p) for rank, p in enumerate(self._processes) if p.exitcode is not None]
        if dead:
            rank, process = dead[0]
            self._fail(f"worker rank {rank} (pid {process.pid}) {_describe_exit(process.exitcode)}")

    def _fail(self, message: str):
        self._stop(message)
        raise RuntimeError(f"Cosmos3EngineClient: {message}; all workers were stopped")

    def _stop(self, reason: str) -> None:
        """Stop the workers without asking (they failed, or are at an unknown point); keeps the first reason."""
        if self._finalizer.detach() is not None:
            self._failure = reason
            _shutdown(self._processes, self._connections, graceful=False)

    def _send_failed(self, rank: int, what: str, error: Exception):
        """A send fails once the worker's end of the pipe is gone, which can be before its exit is reaped: wait for
        that a moment, so that the error says how the worker ended."""
        process = self._processes[rank]
        process.join(timeout=_PEER_DEATH_WAIT_S)
        if process.exitcode is not None:
            self._fail(f"worker rank {rank} (pid {process.pid}) {_describe_exit(process.exitcode)} "
                       f"(could not send {what}: {error})")
        self._fail(f"could not send {what} to worker rank {rank}: {error}; {self._exit_report()}")

    def _exit_report(self) -> str:
        exits = {rank: p.exitcode for rank, p in enumerate(self._processes) if p.exitcode is not None}
        return f"exit codes by rank: {exits}" if exits else "all workers still running"


def _shutdown(processes, connections, graceful: bool = True) -> None:
    """Ask every live worker to exit (``graceful``) and wait a little, then terminate and finally kill the rest."""
    if graceful:
        for process, connection in zip(processes, connections):
            if process.exitcode is None:
                try:
                    connection.send(("close",))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        alive = [process for process in processes if process.exitcode is None]
        for process in alive:
            getattr(process, stop)()
        for process in alive:
            process.join(timeout=5.0)
    for connection in connections:
        connection.close()


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"was killed by signal {-exitcode} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the worker process


def _worker_main(rank: int, port: int, path_or_id: str, config: ParallelConfig, engine_kwargs: dict, connection):
    """One rank: build the SPMD engine, then serve commands until "close" or until the client's pipe end closes."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(config.world_size), LOCAL_WORLD_SIZE=str(config.world_size),
    )
    # NVLink SHARP / symmetric-memory multicast stay off unless the user's environment says otherwise.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if "OMP_NUM_THREADS" not in os.environ and config.world_size > 1:
        torch.set_num_threads(1)  # as torchrun does: N ranks on one host would oversubscribe the cores
    from ..engine import Cosmos3Engine

    try:
        engine = Cosmos3Engine.from_pretrained(path_or_id, parallel=config, **engine_kwargs)
    except BaseException as error:  # noqa: BLE001 - reported to the client, which raises it
        _reply(connection, _error_reply(error))
        return
    _reply(connection, ("ready", {"action_dim": engine.action_dim,
                                  "temporal_compression": engine.temporal_compression}))
    try:
        while True:
            try:
                command = connection.recv()
            except (EOFError, OSError):
                return  # the client is gone
            if command[0] == "close":
                return
            if command[0] in ("offload", "onload"):
                getattr(engine, command[0])()
                _reply(connection, ("ok", None))
                continue
            _, requests, decode = command
            try:
                results = engine.step(requests, decode=decode)
            except BaseException as error:  # noqa: BLE001 - reported to the client
                _reply(connection, _error_reply(error))
                if not isinstance(error, InputError):
                    raise SystemExit(1)  # the ranks may be out of step: the client stops all of them
                continue
            # Tensors travel through shared memory (torch.multiprocessing's pickler); this process stays alive until
            # the client has read them, which that handover needs.
            _reply(connection, ("ok", results if rank == 0 else None))
    finally:
        engine.close()


def _error_reply(error: BaseException) -> tuple:
    kind = next((name for name, cls in _USER_ERRORS.items() if isinstance(error, cls)), type(error).__name__)
    return "error", kind, str(error), traceback.format_exc()


def _reply(connection, message) -> None:
    try:
        connection.send(message)
    except (OSError, ValueError):
        raise SystemExit(1) from None  # the client is gone
