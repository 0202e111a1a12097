"""The process group of a training run: torchrun's environment, or a group the caller already initialised."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import InputError


@dataclass
class DistributedContext:
    rank: int
    world_size: int
    device: torch.device
    owns_process_group: bool  # True when this module started the group (and so ends it in close())

    @property
    def is_main(self) -> bool:
        """The rank that writes files and logs."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device: str | torch.device | None) -> DistributedContext:
    """Join torch.distributed when launched by torchrun (WORLD_SIZE > 1) or when a group is already initialised.

    The backend is NCCL on CUDA and gloo on CPU. ``device`` None picks CUDA when available; "cuda" under several
    ranks means this rank's GPU (cuda:LOCAL_RANK).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise InputError(f"device: cannot parse {device!r} ({error})") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device: CUDA was requested but torch.cuda.is_available() is False")

    launched = not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if device.type == "cuda" and device.index is None:
        # torchrun's LOCAL_RANK picks this rank's GPU; it is known before the group exists, so NCCL is told (no
        # guessing the rank -> GPU mapping).
        local_rank = os.environ.get("LOCAL_RANK") if (launched or dist.is_initialized()) else None
        device = torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if launched:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return DistributedContext(rank=rank, world_size=world_size, device=device, owns_process_group=launched)
