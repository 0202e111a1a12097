"""One rank of a client-mode engine: ``python -m cosmos3_gym.executors.worker ADDRESS`` (started by
``parallel/client.py``, never by hand).

A fresh interpreter that imports only this package, never the caller's ``__main__``, so an engine can be started from
an unguarded script, ``python -``, ``python -c`` or a notebook (multiprocessing's spawn re-imports the main module,
which re-runs such a script in every worker). The environment is torchrun's (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE), set by the client, but the process group is joined through the file store the client names in
``COSMOS3_GYM_RENDEZVOUS_FILE`` (a private folder), not torch's TCP store on MASTER_ADDR:MASTER_PORT, which would
listen on every network interface (client.py: security model); ``Cosmos3Engine.from_pretrained`` then finds the
group initialised.

The worker reads the connection's authentication key from its stdin, connects to the client's
``multiprocessing.connection.Listener`` at ADDRESS, says which rank it is, receives what to load, and then serves
commands until "close" or until the client's end of the connection closes (the caller exited or died). Nothing
imports this module: it is only run, so ``-m`` executes it fresh.
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Client, Connection

from ..errors import InputError
from .messages import RENDEZVOUS_ENV_VAR, error_reply, receive, send


def join_process_group(config, engine_kwargs: dict) -> bool:
    """Join the ranks' process group through the client's file store (NCCL for a CUDA engine, else gloo, as
    ``parallel.mesh.init_parallel`` picks); True when this call created it. A single-rank config needs none."""
    import torch
    import torch.distributed as dist

    rendezvous_file = os.environ.get(RENDEZVOUS_ENV_VAR)
    if not rendezvous_file or config.world_size == 1 or dist.is_initialized():
        return False
    device = engine_kwargs.get("device")
    use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"file://{os.path.abspath(rendezvous_file)}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    return True


def _reply(connection: Connection, message) -> None:
    try:
        send(connection, message)
    except (OSError, ValueError):
        raise SystemExit(1) from None  # the client is gone


def serve(connection: Connection, rank: int) -> None:
    """Build this rank's engine from the client's "load" message, then run commands until "close"."""
    try:
        _, path_or_id, config, engine_kwargs = receive(connection)
    except (EOFError, OSError):
        return  # the client gave up before sending what to load
    from ..engine import Cosmos3Engine

    try:
        joined = join_process_group(config, engine_kwargs)
        engine = Cosmos3Engine.from_pretrained(path_or_id, parallel=config, **engine_kwargs)
    except BaseException as error:  # noqa: BLE001 - reported to the client, which raises it
        _reply(connection, error_reply(error))
        return
    _reply(
        connection, ("ready", {"action_dim": engine.action_dim, "temporal_compression": engine.temporal_compression})
    )
    try:
        while True:
            try:
                name, *args = receive(connection)
            except (EOFError, OSError):
                return  # the client is gone
            if name == "close":
                return
            try:
                if name == "step":
                    requests, decode = args
                    value = engine.step(requests, decode=decode)
                    value = value if rank == 0 else None  # every rank holds the same results: send them once
                elif name == "optimize":
                    engine.optimize(**args[0])
                    value = None
                elif name in ("offload", "onload"):
                    getattr(engine, name)()
                    value = None
                else:
                    raise RuntimeError(f"unknown command {name!r}")
            except BaseException as error:  # noqa: BLE001 - reported to the client
                _reply(connection, error_reply(error))
                if not isinstance(error, InputError):
                    raise SystemExit(1) from None  # the ranks may be out of step: the client stops all of them
                continue
            _reply(connection, ("ok", value))
    finally:
        engine.close()
        if joined:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(
            "usage: python -m cosmos3_gym.executors.worker ADDRESS  (started by cosmos3_gym's client mode)",
            file=sys.stderr,
        )
        return 2
    # Ctrl-C in a terminal reaches the whole process group; the client stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    rank = int(os.environ["RANK"])
    with Client(argv[0], authkey=authkey) as connection:
        send(connection, ("hello", rank, os.getpid()))
        serve(connection, rank)
    return 0


if __name__ == "__main__":
    code = main()
    # As multiprocessing's workers do: skip the interpreter's teardown (seconds of module and compile-pool cleanup
    # that the client would wait for); the engine is closed and the connection too, only stdio needs flushing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
