"""``WorldModelEngine``: what the environments, agents and reward code need of a world model.

Three implementations ship, chosen by ``cosmos3_gym.load_engine`` (``backend=``):

- ``Cosmos3Engine`` (``engine.py``): the model in this process (CPU, one GPU, or one rank of an SPMD engine under
  torchrun);
- ``Cosmos3EngineClient`` (``parallel/client.py``): an SPMD engine of several ranks run by worker processes;
- ``RayEngineReplicas`` (``parallel/ray_replicas.py``): several engines as Ray actors behind one ``step``.

Anything else with these members can back ``WorldModelEnv`` / ``WorldModelVectorEnv`` (``engine=``): the env only
builds ``Cosmos3Request`` objects, calls ``step`` and reads ``Cosmos3Result.pixels`` / ``.action``
(``tests/test_engine_protocol.py`` backs an env with a twenty-line fake). An env with ``handover="latent"`` also
needs ``encode_frames`` and ``decode_latents`` (``Cosmos3Engine``'s: start frames to latents, a context's last latent
to its frame), which the engines whose model runs in other processes lack; they do take requests with
``context_latents`` (sent whole, by value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload, runtime_checkable

import torch

if TYPE_CHECKING:
    from .engine import Cosmos3Request, Cosmos3Result


@runtime_checkable
class WorldModelEngine(Protocol):
    """The engine interface (structural: implementations need not inherit from it).

    ``isinstance(obj, WorldModelEngine)`` checks that the members exist, not their signatures."""

    @property
    def action_dim(self) -> int:
        """The model's padded action width; a request's raw action width must not exceed it."""

    @property
    def temporal_compression(self) -> int:
        """Pixel frames per latent frame after the first: a chunk of ``k * temporal_compression`` actions decodes to
        exactly that many new frames."""

    @property
    def device(self) -> torch.device:
        """Where this process should run models that consume ``step``'s outputs (reward models): the model's device
        for an in-process engine, the CPU when the model runs in other processes (results come back on the CPU)."""

    @property
    def vae(self) -> Any | None:
        """The model's VAE when it lives in this process (latent-space reward models use it), else None."""

    @property
    def is_output_rank(self) -> bool:
        """True in the one process that should write files and report (always, except on ranks > 0 under
        torchrun)."""

    @property
    def closed(self) -> bool: ...

    @overload
    def step(self, requests: Cosmos3Request, *, decode: bool | None = None) -> Cosmos3Result: ...

    @overload
    def step(self, requests: Sequence[Cosmos3Request], *, decode: bool | None = None) -> list[Cosmos3Result]: ...

    def step(self, requests, *, decode=None):
        """One request -> one result; a list -> a list of results in order. ``decode=None``: the engine's default."""

    def optimize(
        self, *, cuda_graphs: bool | None = None, tp_overlap: bool | None = None, stage_graphs: bool | None = None
    ) -> WorldModelEngine:
        """Turn on the fast path (compile, CUDA graphs, ...; the options of ``Cosmos3Engine.optimize``, which the
        other backends pass on to it); returns self. The same math up to float rounding."""

    def offload(self) -> None:
        """Free the accelerator between rollouts; the next ``step`` (or ``onload``) moves the model back."""

    def onload(self) -> None: ...

    def close(self) -> None:
        """Release the model and any processes (idempotent); ``step`` raises afterwards."""
