"""``ParallelConfig(dp, cfg_parallel, tp)`` -> a ``DeviceMesh`` with axes (dp, cfg, tp), outer to inner (tp ranks
adjacent).

NCCL on GPU, gloo on CPU, so every parallel path runs in CI. Global rank
r = (dp_rank * cfg_parallel + cfg_rank) * tp + tp_rank.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import InputError


@dataclass(frozen=True, init=False)
class ParallelConfig:
    """Ranks per axis: ``dp`` independent replicas (requests dealt between them), ``cfg_parallel`` 1 or 2 rank groups
    for the two CFG branches, ``tp`` tensor-parallel ranks per group. ``cfg`` is the deprecated name of
    ``cfg_parallel`` (it read like a guidance setting): accepted by the constructor with a warning, readable."""

    dp: int = 1
    cfg_parallel: int = 1
    tp: int = 1

    def __init__(self, dp: int = 1, cfg_parallel: int = 1, tp: int = 1, *, cfg: int | None = None):
        if cfg is not None:
            warnings.warn("ParallelConfig(cfg=) is deprecated; use cfg_parallel=", DeprecationWarning, stacklevel=2)
            if cfg_parallel not in (1, cfg):
                raise InputError(f"cfg: {cfg} contradicts cfg_parallel={cfg_parallel}; give one or the other")
            cfg_parallel = cfg
        for name, value in (("dp", dp), ("cfg_parallel", cfg_parallel), ("tp", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name}: expected an integer >= 1, got {value!r}")
            object.__setattr__(self, name, value)
        if self.cfg_parallel > 2:
            raise InputError(f"cfg_parallel: expected 1 or 2 (one rank group per CFG branch), got {self.cfg_parallel}")

    @property
    def cfg(self) -> int:
        """Deprecated name of ``cfg_parallel``."""
        return self.cfg_parallel

    @property
    def world_size(self) -> int:
        return self.dp * self.cfg_parallel * self.tp

    @property
    def is_single(self) -> bool:
        return self.world_size == 1


@dataclass
class ParallelContext:
    """Where this process sits in the (dp, cfg, tp) mesh."""

    config: ParallelConfig
    mesh: DeviceMesh | None
    device: torch.device
    # The cfg*tp ranks of this process's dp replica: they share one request batch and split its VAE decode.
    replica_group: dist.ProcessGroup | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.mesh is not None else 0

    def local_rank(self, axis: str) -> int:
        return self.mesh.get_local_rank(axis) if self.mesh is not None else 0

    def group(self, axis: str):
        return self.mesh.get_group(axis) if self.mesh is not None else None

    @property
    def tp_rank(self) -> int:
        return self.local_rank("tp")

    @property
    def cfg_rank(self) -> int:
        return self.local_rank("cfg")

    @property
    def dp_rank(self) -> int:
        return self.local_rank("dp")

    @property
    def replica_rank(self) -> int:
        """Rank inside the replica group: cfg_rank * tp + tp_rank (cfg outer, tp inner)."""
        return self.cfg_rank * self.config.tp + self.tp_rank

    @property
    def is_output_rank(self) -> bool:
        """The rank that writes files and returns results (global rank 0)."""
        return self.rank == 0


def in_process_group() -> bool:
    """True under torchrun (or once ``dist.init_process_group`` has run): this process is one rank."""
    return dist.is_initialized() or "RANK" in os.environ


def resolve_parallel_config(
    parallel: ParallelConfig | ParallelContext | None = None,
    *,
    tp: int | None = None,
    cfg_parallel: int | None = None,
    dp: int | None = None,
    cfg: int | None = None,
) -> ParallelConfig:
    """One ``ParallelConfig`` from ``parallel`` and/or the ``tp``/``cfg_parallel``/``dp`` shorthands (which must
    agree with it). ``cfg`` is the deprecated name of ``cfg_parallel``."""
    if cfg is not None:
        warnings.warn(
            "cfg= (the CFG-parallel degree) is deprecated; use cfg_parallel=", DeprecationWarning, stacklevel=3
        )
        if cfg_parallel is not None and cfg_parallel != cfg:
            raise InputError(f"cfg: {cfg} contradicts cfg_parallel={cfg_parallel}; give one or the other")
        cfg_parallel = cfg
    if parallel is None:
        return ParallelConfig(
            dp=1 if dp is None else dp,
            cfg_parallel=1 if cfg_parallel is None else cfg_parallel,
            tp=1 if tp is None else tp,
        )
    if isinstance(parallel, ParallelContext):
        config = parallel.config
    elif isinstance(parallel, ParallelConfig):
        config = parallel
    else:
        raise InputError(f"parallel: expected a ParallelConfig or ParallelContext, got {type(parallel).__name__}")
    for name, value in (("tp", tp), ("cfg_parallel", cfg_parallel), ("dp", dp)):
        if value is not None and value != getattr(config, name):
            raise InputError(f"{name}: {value} contradicts parallel={config}; give one or the other")
    return config


def init_parallel(config: ParallelConfig, device: str | torch.device | None = None) -> ParallelContext:
    """Join (or start) the default process group and build the mesh. A single-process config needs no group.

    Under torchrun the rendezvous comes from its environment (RANK, WORLD_SIZE, MASTER_ADDR, ...); multi-node runs
    use torchrun's own rendezvous (``--nnodes --rdzv-endpoint``), nothing else is needed here.

    A single-process config is an engine of this process alone, also inside a process group (data-parallel
    replicas, e.g. GRPO with one env and engine per rank): it joins no collective, and "cuda" is this rank's GPU.
    """
    if config.is_single:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and dev.index is None and dist.is_initialized():  # the rank's GPU, as below
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        return ParallelContext(config, None, dev)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise InputError(
                f"parallel config {config} needs {config.world_size} processes: run under torchrun "
                f"--nproc_per_node={config.world_size}, or use cosmos3_gym.load_engine(..., tp=..., cfg_parallel=...), "
                f"which starts the worker processes itself"
            )
        use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        dist.init_process_group("nccl" if use_cuda else "gloo")
    world = dist.get_world_size()
    if world != config.world_size:
        raise InputError(
            f"parallel config: dp*cfg_parallel*tp = {config.dp}*{config.cfg_parallel}*{config.tp} = "
            f"{config.world_size} must equal the number of processes ({world})"
        )
    if device is None:
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            device = torch.device(
                "cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            )
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    mesh = init_device_mesh(
        device.type, (config.dp, config.cfg_parallel, config.tp), mesh_dim_names=("dp", "cfg", "tp")
    )
    # new_group is collective over the world: every rank creates every replica's group, in the same order.
    replica_size = config.cfg_parallel * config.tp
    replica_group = None
    for dp_index in range(config.dp):
        ranks = list(range(dp_index * replica_size, (dp_index + 1) * replica_size))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            replica_group = group
    return ParallelContext(config, mesh, device, replica_group)
