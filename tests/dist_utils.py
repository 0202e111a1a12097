"""Run a function in N local processes joined in a gloo process group, for multi-rank tests on CPU.

``run_distributed(fn, world_size, *args)`` starts the ranks (``fn`` and ``args`` must be picklable, ``fn`` a
module-level function), sets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT on a free 127.0.0.1 port), initialises gloo (``backend="nccl"``: NCCL, rank r on GPU r) and returns
``[fn(*args) on rank 0, rank 1, ...]``.
A rank that raises fails the call with its traceback at once (the others are killed rather than left waiting in a
collective); a run that is not done within ``timeout`` seconds fails instead of blocking the test suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


def _worker(fn, args, rank: int, world_size: int, port: int, timeout: float, backend: str, results) -> None:
    try:
        os.environ.update(torchrun_env(rank, world_size, port))
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the machine's cores
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        try:
            value = fn(*args)
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes: the queue's own pickler would pass tensors as shared-memory handles, which die with
        # this process before the parent reads them.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))


class DistributedTestError(RuntimeError):
    pass


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo") -> list:
    # forkserver: the ranks are forked from one clean server process that imported fn's module (and with it torch,
    # diffusers, ...) once, instead of each spawned interpreter importing them again (~5 s each); unlike a plain
    # fork of the test process they inherit no threads or process-group state.
    # NCCL ranks are spawned: a forkserver that has touched CUDA (some import may) cannot hand it to its children.
    context = mp.get_context("spawn" if backend == "nccl" else "forkserver")
    if backend != "nccl":
        # The server process does not have tests/ on its path, so preloading fn's own module silently fails: preload
        # the package (the heavy imports) as well.
        context.set_forkserver_preload(["cosmos3_gym.engine", fn.__module__])
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(fn, args, rank, world_size, port, timeout, backend, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise DistributedTestError(
                        f"rank {dead[0]} died with exit code {processes[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise DistributedTestError(
                        f"timed out after {timeout:.0f} s; ranks without a result: "
                        f"{sorted(set(range(world_size)) - values.keys())}"
                    ) from None
                continue
            if not ok:
                raise DistributedTestError(f"rank {rank} raised:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in processes:
            p.join(timeout=5 if len(values) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[rank] for rank in range(world_size)]
