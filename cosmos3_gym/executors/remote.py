"""What an engine whose model runs in other processes reports about itself.

Shared by the worker-process client (``client.py``) and the Ray replicas (``ray_replicas.py``): both learn the
model's action width and temporal compression from their workers at startup, hand results back on this process's
CPU, keep the VAE out of this process and are the one output rank. Subclasses set ``_action_dim`` and
``_temporal_compression`` and implement the rest of ``WorldModelEngine`` (``engine_protocol.py``).
"""

from __future__ import annotations

import torch


class RemoteEngine:
    _action_dim: int
    _temporal_compression: int

    @property
    def action_dim(self) -> int:
        return self._action_dim

    @property
    def temporal_compression(self) -> int:
        return self._temporal_compression

    @property
    def device(self) -> torch.device:
        """The CPU: results come back to this process on the CPU, where a caller's reward model runs."""
        return torch.device("cpu")

    @property
    def vae(self) -> None:
        """None: the VAE lives in the other processes (latent-space reward models need an in-process engine)."""
        return None

    @property
    def is_output_rank(self) -> bool:
        return True  # results come back here only

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
