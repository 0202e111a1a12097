"""``load_engine``: one entry point that picks the ``WorldModelEngine`` implementation (vLLM's ``Executor.get_class``).

=============  ==========================================================================================
backend        what runs the model
=============  ==========================================================================================
"inprocess"    ``Cosmos3Engine`` in this process: CPU, one GPU, or this rank of an SPMD engine under torchrun
"mp"           ``Cosmos3EngineClient``: dp*cfg_parallel*tp worker processes started here, one per rank
"ray"          ``RayEngineReplicas``: ``num_replicas`` engines as Ray actors (each itself in-process or "mp")
"auto"         "inprocess" inside a process group or for a single rank, else "mp"
=============  ==========================================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checkpoint import resolve_checkpoint, validate_checkpoint
from .engine import Cosmos3Engine, check_decoder, find_light_decoder
from .engine_protocol import WorldModelEngine
from .errors import InputError
from .executors.client import Cosmos3EngineClient
from .models.transformer import Cosmos3TransformerConfig
from .parallel.mesh import ParallelConfig, ParallelContext, in_process_group, resolve_parallel_config
from .parallel.tensor_parallel import check_tensor_parallel
from .presets import get_preset
from .quantization import check_precision

BACKENDS = ("auto", "inprocess", "mp", "ray")


def resolve_backend(backend: str, config: ParallelConfig) -> str:
    """The concrete backend for ``backend`` ("auto" resolved) and ``config``."""
    if backend not in BACKENDS:
        raise InputError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "inprocess" if config.world_size == 1 or in_process_group() else "mp"
    return backend


def engine_class(backend: str, config: ParallelConfig = ParallelConfig()) -> type:
    """The class that implements ``backend`` for ``config`` (vLLM's ``Executor.get_class``)."""
    backend = resolve_backend(backend, config)
    if backend == "ray":
        from .executors.ray_replicas import RayEngineReplicas  # optional dependency

        return RayEngineReplicas
    return {"inprocess": Cosmos3Engine, "mp": Cosmos3EngineClient}[backend]


def load_engine(
    path_or_id: str | Path,
    *,
    parallel: ParallelConfig | ParallelContext | None = None,
    backend: str = "auto",
    optimize: bool = False,
    vae_dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    decode_video: bool = True,
    progress: bool = True,
    tp: int | None = None,
    cfg_parallel: int | None = None,
    dp: int | None = None,
    num_replicas: int = 1,
    replica_resources: dict[str, float] | None = None,
    cfg: int | None = None,
    precision: str = "bf16",
    preset: str | None = None,
    decoder: str = "vae",
) -> WorldModelEngine:
    """Load a Cosmos3 checkpoint (local directory or hub id) as a ``WorldModelEngine``.

    ``parallel`` (or the shorthands ``tp``/``cfg_parallel``/``dp``; ``cfg`` is the deprecated name of
    ``cfg_parallel``) is the layout of one engine; ``backend`` picks where it runs (module docstring). ``optimize``:
    ``Cosmos3Engine.optimize()`` on every rank (compile, CUDA graphs on a GPU); ``vae_dtype`` e.g. "bf16" for a
    faster decode (default fp32); ``device``/``dtype``/``precision`` ("bf16" or "fp8") as
    ``Cosmos3Engine.from_pretrained``. ``preset`` (``presets.PRESETS``) is applied to every request that names none.
    ``num_replicas`` and ``replica_resources`` are for ``backend="ray"`` only.

    The checkpoint and the tensor-parallel split are checked here, before any worker or actor starts.
    """
    config = resolve_parallel_config(parallel, tp=tp, cfg_parallel=cfg_parallel, dp=dp, cfg=cfg)
    resolved = resolve_backend(backend, config)
    check_precision(precision)
    check_decoder(decoder, config)
    if preset is not None:
        get_preset(preset)  # an unknown name fails before any worker starts
    if resolved != "ray" and (num_replicas != 1 or replica_resources is not None):
        raise InputError(f"num_replicas / replica_resources: only for backend='ray', not {resolved!r}")
    engine_kwargs: dict[str, Any] = dict(
        device=device,
        dtype=dtype,
        vae_dtype=vae_dtype,
        decode_video=decode_video,
        progress=progress,
        optimize=optimize,
        precision=precision,
        preset=preset,
        decoder=decoder,
    )
    if resolved == "inprocess":
        if config.world_size > 1 and not in_process_group() and not isinstance(parallel, ParallelContext):
            raise InputError(
                f"backend 'inprocess': parallel config {config} needs {config.world_size} processes: run under "
                f"torchrun --nproc_per_node={config.world_size}, or use backend 'mp' (or 'auto'), which starts them"
            )
        return Cosmos3Engine.from_pretrained(
            path_or_id, parallel=parallel if parallel is not None else config, **engine_kwargs
        )
    if isinstance(parallel, ParallelContext):
        raise InputError(
            f"parallel: a ParallelContext belongs to this process; backend {resolved!r} starts its own "
            "processes and needs a ParallelConfig"
        )
    layout = validate_checkpoint(resolve_checkpoint(path_or_id))
    if decoder == "light":
        find_light_decoder(layout.root)  # before any worker starts
    check_tensor_parallel(Cosmos3TransformerConfig.from_dict(layout.transformer_config), config.tp)
    if resolved == "mp":
        return Cosmos3EngineClient(layout.root, config, engine_kwargs)
    return engine_class("ray")(
        layout.root, num_replicas, replica_resources=replica_resources, parallel=config, **engine_kwargs
    )
