"""Fully sharded data parallel training (FSDP2, ``torch.distributed.fsdp.fully_shard``) of a Cosmos3 policy model.

The plan follows torchtitan: each transformer block (every UND text layer and GEN layer) is one FSDP unit, the time
embedder is its own unit kept in float32 (diffusers' ``_keep_in_fp32_modules``), and the ``FlowMatchingObjective``
is the root unit holding the rest (embeddings, patch projections, action heads, final norms). Weights, gradients and
AdamW states are sharded over the ranks: each rank holds 1/N of them and all-gathers one block at a time. The towers
call ``layer.text_forward`` / ``layer.gen_forward`` rather than ``forward``, so those methods are registered with
FSDP (``register_fsdp_forward_method``) after activation checkpointing wrapped them: the all-gather runs outside the
checkpointed region and again before the recomputation in the backward pass.

Mixed precision (CUDA with ``bf16``): float32 sharded master weights, bf16 all-gathered compute weights and float32
gradient reduce-scatter (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); on CPU (tests, gloo)
everything stays float32. ``cpu_offload`` keeps the sharded weights, gradients and optimizer states on the host
(``CPUOffloadPolicy``; the AdamW step then runs on the CPU).

Training state is saved sharded with ``torch.distributed.checkpoint`` (each rank writes its shards: model, optimizer
and EMA, plus state.json) as a snapshot of ``cosmos3_gym.storage``'s crash-safe protocol (``state/step-N/``, with a
manifest; committed by one rename on rank 0 once every rank's shards are written) and resumed onto the same or
another number of ranks; the export gathers full weights on
rank 0 and writes the diffusers layout as the single-process trainer does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import CheckpointError, InputError
from ..storage import begin_snapshot, commit_snapshot, fault_point, snapshot_path

if TYPE_CHECKING:
    from .flow_matching import FlowMatchingObjective

STATE_FORMAT = "torch.distributed.checkpoint"


def mixed_precision_policy(device: torch.device, bf16: bool, param_dtype: torch.dtype):
    """bf16 compute / fp32 reduce for float32 weights on CUDA; None (no casts) on CPU or for bf16 weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type != "cuda" or not bf16 or param_dtype != torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp(
    objective: FlowMatchingObjective,
    *,
    device: torch.device,
    bf16: bool = True,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    mesh=None,
) -> nn.Module:
    """Shard ``objective`` (a ``FlowMatchingObjective``) in place, block by block, and return it.

    Activation checkpointing (``world_model.enable_gradient_checkpointing``), ``set_trainable`` and LoRA must be
    applied before, the optimizer built after (it must see the sharded parameters).
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if not dist.is_initialized():
        raise InputError("data_parallel: 'fsdp' needs torch.distributed (launch with torchrun)")
    transformer = objective.transformer
    param_dtype = next(p.dtype for n, p in transformer.named_parameters() if not n.startswith("time_embedder."))
    policy = mixed_precision_policy(device, bf16, param_dtype) or MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    common = dict(mesh=mesh, offload_policy=offload)
    for layers, method in ((transformer.text_layers, "text_forward"), (transformer.gen_layers, "gen_forward")):
        for layer in layers:
            fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward, **common)
            register_fsdp_forward_method(layer, method)
    fp32 = (
        MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        if policy.param_dtype is not None
        else MixedPrecisionPolicy()
    )
    fully_shard(transformer.time_embedder, mp_policy=fp32, **common)
    # The root keeps its (small) parameters gathered through the whole step: no reshard after forward.
    fully_shard(objective, mp_policy=policy, reshard_after_forward=False, **common)
    return objective


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls it); a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on the CPU of rank 0; empty on the other ranks (all ranks must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast("dict[str, torch.Tensor]", state)  # a model's state dict: tensors only


def full_ema_state_dict(ema, is_main: bool) -> dict[str, torch.Tensor]:
    """The EMA's full float32 tensors on rank 0's CPU, one tensor gathered at a time (all ranks must call it)."""
    out = {}
    for name, shadow in ema.state_dict().items():
        value = full_tensor(shadow)
        if is_main:
            out[name] = value.detach().cpu()
        del value
    return out


def save_sharded_state(
    state_dir: Path, *, step: int, objective: nn.Module, ema, optimizer, document: dict, is_main: bool
) -> Path:
    """Every rank writes its shards of the model, the optimizer and the EMA (``torch.distributed.checkpoint``) into
    the staging folder of snapshot ``state_dir/step-N``; rank 0 adds state.json (``document`` plus the step), the
    manifest (sizes and sha256s of every rank's files, all fsynced) and commits the snapshot by one rename
    (``storage.save_snapshot``'s protocol; the previous snapshot is kept). Returns the snapshot's folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    staging = begin_snapshot(state_dir, step) if is_main else None
    staging = _broadcast(staging)
    model_state, optimizer_state = get_state_dict(objective, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if ema is not None:
        state["ema"] = ema.state_dict()
    dcp.save(state, checkpoint_id=str(staging))
    dist.barrier()
    if is_main:
        fault_point("shards written")
        (staging / "state.json").write_text(json.dumps({**document, "step": step, "format": STATE_FORMAT}, indent=2))
        commit_snapshot(state_dir, step, staging)
    dist.barrier()
    return snapshot_path(state_dir, step)


def _broadcast(value):
    """Rank 0's ``value`` on every rank."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def find_sharded_state(state_dir: Path, find) -> tuple[int, Path] | None:
    """``find(state_dir)`` (``world_model.find_training_state``) run on rank 0, so that the manifests are read and
    checked once, and its answer, or its ``CheckpointError``, given to every rank."""
    answer = None
    if dist.get_rank() == 0:
        try:
            answer = ("ok", find(state_dir))
        except CheckpointError as error:
            answer = ("error", str(error))
    kind, value = _broadcast(answer)
    if kind == "error":
        raise CheckpointError(value)
    return value


def load_sharded_state(state_dir: Path, *, objective: nn.Module, ema, optimizer) -> None:
    """Load what ``save_sharded_state`` wrote into the sharded model, optimizer and EMA (resharded as needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = state_dir / "state.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"resume: {path} is not a readable training state ({error})") from error
    if document.get("format") != STATE_FORMAT:
        raise InputError(
            f"resume: {state_dir} was not saved by an FSDP run (data_parallel='fsdp'); resume it with the "
            f"data_parallel it was trained with"
        )
    model_state, optimizer_state = get_state_dict(objective, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    if ema is not None:
        state["ema"] = ema.state_dict()  # the EMA's own tensors: loaded in place
    try:
        dcp.load(state, checkpoint_id=str(state_dir))
    except Exception as error:  # a shard damaged after its manifest was checked, or not a DCP folder
        raise CheckpointError(f"resume: cannot read the sharded state {state_dir} ({error})") from error
    set_state_dict(objective, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
