"""The SPMD engine's bookkeeping collectives: what keeps the ranks of a (dp, cfg, tp) engine in step once per
``Cosmos3Engine.step`` call (seed agreement, errors raised on every rank together, the dp results gather) and once per
denoising step (the cfg velocity gather). Each is a no-op for a single-process engine.
"""

from __future__ import annotations

import dataclasses
import secrets

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import InputError
from .mesh import ParallelContext

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single; torch 2.11 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def agree_on_seeds(batch: list, parallel: ParallelContext) -> list:
    """Give each request without a seed (a dataclass with ``seed=None``) one drawn on rank 0, so that every rank
    draws the same noise. Other items pass unchanged (the engine rejects them with an ``InputError``)."""
    missing = [i for i, r in enumerate(batch) if dataclasses.is_dataclass(r) and getattr(r, "seed", 0) is None]
    if not missing:
        return batch
    seeds = torch.tensor([secrets.randbelow(2**63) for _ in missing], dtype=torch.int64)
    if parallel.config.world_size > 1:
        seeds = seeds.to(parallel.device)
        dist.broadcast(seeds, src=0)
    batch = list(batch)
    for i, seed in zip(missing, seeds.tolist()):
        batch[i] = dataclasses.replace(batch[i], seed=seed)
    return batch


def dp_share(num_requests: int, parallel: ParallelContext) -> list[int]:
    """The request indexes this rank's dp replica runs: dealt round-robin (replica d gets d, d+dp, ...)."""
    return list(range(parallel.dp_rank, num_requests, parallel.config.dp))


def run_on_every_rank(fn, parallel: ParallelContext):
    """``fn()``; with several ranks, an error on any rank is raised on all of them (a rank that raised alone would
    leave the others waiting in the next collective): ``InputError`` as itself, anything else as a
    ``RuntimeError`` naming the rank."""
    if parallel.config.world_size == 1:
        return fn()
    error, value = None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = e
    failed = torch.tensor([int(error is not None)], device=parallel.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        reports: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, None if error is None else (isinstance(error, InputError), str(error)))
        if error is not None:
            raise error
        rank, (is_input_error, message) = next((r, rep) for r, rep in enumerate(reports) if rep is not None)
        if is_input_error:
            raise InputError(message)
        raise RuntimeError(f"rank {rank} failed to prepare its requests: {message}")
    return value


def gather_dp_results(local_results: list, num_requests: int, parallel: ParallelContext) -> list:
    """Every replica's results, back in request order, on every rank (one object all-gather per step call)."""
    dp = parallel.config.dp
    if dp == 1:
        return local_results
    shares: list[list | None] = [None] * dp
    dist.all_gather_object(shares, local_results, group=parallel.group("dp"))
    results: list = [None] * num_requests
    for replica, replica_results in enumerate(shares):
        assert replica_results is not None  # all_gather_object filled every replica's share
        for i, result in zip(range(replica, num_requests, dp), replica_results):
            results[i] = result
    return results


def gather_cfg_rows(
    v_video: torch.Tensor, v_action: torch.Tensor, rows_per_rank: int, num_rows: int, parallel: ParallelContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the velocity rows of both cfg rank groups: one collective per step (video and action rows
    packed side by side), every rank padded to ``rows_per_rank`` rows of the same dtype (fp32) so that the
    shapes agree; returns all ``num_rows`` rows in branch order on every rank."""
    video_shape, action_shape = v_video.shape[1:], v_action.shape[1:]
    packed = torch.cat([v_video.flatten(1), v_action.flatten(1)], dim=1)
    packed = F.pad(packed, (0, 0, 0, rows_per_rank - packed.shape[0]))
    gathered = packed.new_empty(parallel.config.cfg_parallel * rows_per_rank, packed.shape[1])
    _all_gather_single(gathered, packed, group=parallel.group("cfg"))
    gathered = gathered[:num_rows]
    split = video_shape.numel()
    return gathered[:, :split].reshape(num_rows, *video_shape), gathered[:, split:].reshape(num_rows, *action_shape)
