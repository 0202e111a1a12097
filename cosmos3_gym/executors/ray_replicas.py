"""Engine replicas on a Ray cluster: many independent engines, possibly on many machines, behind one ``step``.

Install the extra: ``pip install "cosmos3_gym[ray]"`` (plain ``ray`` is enough for this module; ``ray[default]``
adds the dashboard and cluster launcher). It requires ``ray>=2.52``: earlier versions accept unauthenticated job
submissions, a remote-code-execution hole.

Security model: anyone who can reach a Ray cluster's ports can run code on every node of it. A cluster started with
``ray start --head`` must therefore use token authentication (``RAY_AUTH_MODE=token`` and the same secret
``RAY_AUTH_TOKEN`` on every node and driver, Ray >= 2.52) and sit on a network that only its own hosts can reach (a
private subnet or firewall rules; never a public address). This module adds no access control of its own: it trusts
the cluster it is given (``ray.init()`` without an address starts a local, single-machine one).

``load_engine(path, backend="ray", num_replicas=R)`` or ``RayEngineReplicas(path, num_replicas,
replica_resources={"num_gpus": 1})`` starts one Ray actor per replica; each actor builds one engine with
``Cosmos3Engine.from_pretrained(path, **engine_kwargs)``. With ``tp``/``cfg_parallel`` in ``engine_kwargs`` that
engine is a client-mode engine (``parallel/client.py``): the actor starts the tp*cfg_parallel worker processes on its
own node, so give the replica as many GPUs (``replica_resources={"num_gpus": tp * cfg_parallel}``); Ray sets
``CUDA_VISIBLE_DEVICES`` for the actor and its workers take one visible GPU each.

``step(requests)`` splits the list into contiguous chunks, one per replica (sizes differ by at most one, the first
replicas take the remainder), runs the chunks concurrently and returns the results in request order.

Vector envs: a vector env of N slots passes its N requests in slot order on every step, so with a constant N slot i
always lands on the same replica (replica k serves slots ``k * N // R`` to ``(k + 1) * N // R - 1`` when N is a
multiple of R). Each replica's per-prompt text K/V cache then stays warm for its slots, and N / R requests are
batched into one denoising pass per replica. Choose N as a multiple of ``num_replicas`` to keep them equally loaded.

Multi-node, two ways that combine:

* one tp x cfg engine across machines: torchrun's rendezvous starts the ranks, e.g. on each of 2 nodes with 4 GPUs::

      torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
          -m cosmos3_gym.cli infer --tp 4 --cfg-parallel 2 --checkpoint ... --image ... --out ...

  (mesh order dp, cfg, tp with tp innermost: ranks 0-3 on the first node are the cond branch's tp group, ranks 4-7
  the uncond branch's, so tensor-parallel all-reduces stay inside a node and only one all-gather per denoising step
  crosses nodes). The same command with ``--nnodes=1 --rdzv-endpoint=127.0.0.1:PORT`` runs on one machine.
* many engines: ``ray start --head`` on one node, ``ray start --address=HEAD:6379`` on the others, then
  ``load_engine(..., backend="ray", num_replicas=R, replica_resources={"num_gpus": tp * cfg_parallel}, tp=...,
  cfg_parallel=...)`` from any driver; Ray places each replica on a node with enough free GPUs (a replica never spans
  nodes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine import Cosmos3Request
from ..engine_protocol import WorldModelEngine
from ..errors import InputError
from ..parallel.mesh import resolve_parallel_config
from .remote import RemoteEngine

try:
    import ray
except ImportError:  # optional extra
    _HAS_RAY = False
else:
    _HAS_RAY = True

# Ray before 2.52 runs unauthenticated job submissions (remote code execution) and has no token authentication.
MIN_RAY_VERSION = (2, 52)


def check_ray_version(version: str) -> None:
    """``InputError`` for a Ray older than ``MIN_RAY_VERSION`` (module docstring: security model)."""
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_RAY_VERSION:
        raise InputError(
            f"ray: version {version} accepts unauthenticated job submissions (remote code execution); install "
            f"ray>=2.52 (pip install 'cosmos3_gym[ray]')"
        )


class _EngineReplica:
    """The Ray actor: one engine. Loaded in ``load`` rather than ``__init__`` so that a bad checkpoint comes back as
    a task error carrying the original exception (a failed actor constructor kills the actor instead)."""

    def __init__(self, path_or_id: str, engine_kwargs: dict[str, Any]):
        self._path_or_id, self._engine_kwargs = path_or_id, engine_kwargs
        self._engine: WorldModelEngine | None = None

    def load(self) -> dict[str, int]:
        kwargs = dict(self._engine_kwargs)
        config = resolve_parallel_config(
            kwargs.pop("parallel", None),
            tp=kwargs.pop("tp", None),
            cfg_parallel=kwargs.pop("cfg_parallel", None),
            dp=kwargs.pop("dp", None),
            cfg=kwargs.pop("cfg", None),
        )
        if config.world_size > 1:  # the replica's ranks as worker processes on the actor's node
            from .client import Cosmos3EngineClient

            self._engine = Cosmos3EngineClient(self._path_or_id, config, kwargs)
        else:
            from ..engine import Cosmos3Engine

            self._engine = Cosmos3Engine.from_pretrained(self._path_or_id, **kwargs)
        return {"action_dim": self._engine.action_dim, "temporal_compression": self._engine.temporal_compression}

    def call(self, method: str, kwargs: dict | None = None) -> None:
        getattr(self._engine, method)(**(kwargs or {}))

    def step(self, requests, decode):
        return self._engine.step(requests, decode=decode)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


class RayEngineReplicas(RemoteEngine):
    """``num_replicas`` engines as Ray actors; ``step`` and ``close`` as on ``Cosmos3Engine``. See the module
    docstring for placement, request splitting and multi-node use.

    The constructor returns once every replica has loaded its engine; it waits as long as Ray needs to find the
    ``replica_resources`` for each (forever, if the cluster never has them free).
    """

    def __init__(
        self,
        path_or_id: str | Path,
        num_replicas: int,
        *,
        replica_resources: dict[str, float] | None = None,  # default: {"num_gpus": dp*cfg*tp} or {"num_cpus": 1}
        **engine_kwargs,
    ):
        if not _HAS_RAY:
            raise ImportError('RayEngineReplicas needs Ray: pip install "cosmos3_gym[ray]"')
        check_ray_version(ray.__version__)
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise InputError(f"num_replicas: expected an integer >= 1, got {num_replicas!r}")
        config = resolve_parallel_config(
            engine_kwargs.get("parallel"),
            tp=engine_kwargs.get("tp"),
            cfg_parallel=engine_kwargs.get("cfg_parallel"),
            dp=engine_kwargs.get("dp"),
            cfg=engine_kwargs.get("cfg"),
        )
        if not ray.is_initialized():
            ray.init()  # a local cluster, or the one RAY_ADDRESS names
        if replica_resources is None:
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            # One GPU per rank of the replica's engine (its client-mode workers each take one).
            replica_resources = {"num_gpus": config.world_size} if has_gpus else {"num_cpus": 1}
        self.num_replicas = num_replicas
        self.preset = engine_kwargs.get("preset")  # as Cosmos3Engine.preset: the envs and agents on it take it
        actor_class = ray.remote(_EngineReplica).options(**replica_resources)
        # Actor handles: Ray's types do not give their methods' ``.remote``.
        self._replicas: list[Any] = [actor_class.remote(str(path_or_id), engine_kwargs) for _ in range(num_replicas)]
        self._closed = False
        try:
            facts = self._get([replica.load.remote() for replica in self._replicas], "loading the engine")[0]
        except BaseException:
            self.close()
            raise
        self._action_dim: int = facts["action_dim"]
        self._temporal_compression: int = facts["temporal_compression"]

    # ------------------------------------------------------------------ WorldModelEngine (engine_protocol.py)

    @property
    def closed(self) -> bool:
        return self._closed

    def optimize(self, **options) -> RayEngineReplicas:
        """``optimize(**options)`` on every replica's engine; returns self."""
        self._get([replica.call.remote("optimize", options) for replica in self._replicas], "optimize")
        return self

    def offload(self) -> None:
        self._get([replica.call.remote("offload") for replica in self._replicas], "offload")

    def onload(self) -> None:
        self._get([replica.call.remote("onload") for replica in self._replicas], "onload")

    def step(self, requests, *, decode: bool | None = None):
        """Run one request (on the first replica; returns a ``Cosmos3Result``) or a list (split contiguously over
        the replicas, returns a list in order)."""
        if self._closed:
            raise RuntimeError("RayEngineReplicas is closed")
        if isinstance(requests, Cosmos3Request):
            return self._get([self._replicas[0].step.remote(requests, decode)], "step")[0]
        chunks = split_contiguous(list(requests), self.num_replicas)
        if not any(chunks):
            raise InputError("requests: expected at least one Cosmos3Request")
        calls = [replica.step.remote(chunk, decode) for replica, chunk in zip(self._replicas, chunks) if chunk]
        return [result for chunk_results in self._get(calls, "step") for result in chunk_results]

    def close(self) -> None:
        """Close every replica's engine, then end the actors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            ray.get([replica.close.remote() for replica in self._replicas], timeout=60)
        except Exception:  # noqa: BLE001 - a dead or stuck replica is killed below either way
            pass
        for replica in self._replicas:
            ray.kill(replica)

    @staticmethod
    def _get(refs: list, what: str) -> list:
        """``ray.get`` that raises a replica's ``InputError`` as itself (same type and message) and anything else
        as a ``RuntimeError`` naming the failure."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, InputError):
                raise type(error.cause)(str(error.cause)) from None
            raise RuntimeError(f"RayEngineReplicas: a replica failed during {what}: {error}") from error
        except ray.exceptions.RayActorError as error:
            raise RuntimeError(f"RayEngineReplicas: a replica died during {what}: {error}") from error


def split_contiguous(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one, the larger chunks first."""
    size, remainder = divmod(len(items), parts)
    bounds = [k * size + min(k, remainder) for k in range(parts + 1)]
    return [items[bounds[k] : bounds[k + 1]] for k in range(parts)]
