"""``PolicyAgent``: Cosmos3's policy mode (observation image + task -> action chunk) as an agent for the env."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import InputError
from .base import EngineAgent

__all__ = ["PolicyAgent"]


class PolicyAgent(EngineAgent):
    """Acts with the checkpoint's own policy: ``agent.act(obs)`` (or ``agent(obs)``) -> an action chunk.

    ``obs`` is one image (uint8 ``HWC`` array, PIL image or ``CHW`` tensor), an env observation dict with an
    ``"image"`` entry, a batch of images (``[N, H, W, 3]``, as ``obs["image"]`` of the vector env) or a list of
    observations. One observation gives ``[chunk, raw_action_dim]``; a batch gives ``[N, chunk, raw_action_dim]``
    from ONE batched ``engine.step``. Actions are float32 clipped to the action space, [-1, 1] (the model's
    normalised space, which the env's action space uses).

    ``predict`` has Stable-Baselines3's signature, so SB3 evaluation helpers accept the agent as a model.
    """

    mode = "policy"

    def act(self, observation: Any, task: str | Sequence[str] | None = None) -> np.ndarray:
        """Action chunk(s) for ``observation``; ``task`` (one string or one per observation) overrides the agent's."""
        images, batched = _split_observations(observation)
        tasks = self._tasks(task, len(images))
        actions = self._run([self._request(image, task) for image, task in zip(images, tasks)])
        actions = np.clip(actions, -1.0, 1.0)
        return actions if batched else actions[0]

    __call__ = act

    def predict(
        self,
        observation: Any,
        state: Any = None,
        episode_start: Any = None,
        deterministic: bool = True,
    ) -> tuple[np.ndarray, None]:
        """SB3-style ``(action, state)``. The policy keeps no recurrent state, so ``state`` and ``episode_start``
        are ignored; ``deterministic`` too, since the agent's seed sequence already fixes every sample."""
        return self.act(observation), None


def _split_observations(observation: Any) -> tuple[list[Any], bool]:
    """``(images, batched)``: the single images in ``observation`` and whether it was a batch."""
    if isinstance(observation, (list, tuple)):
        if not observation:
            raise InputError("observation: got an empty list")
        images = []
        for item in observation:
            item_images, item_batched = _split_observations(item)
            if item_batched:
                raise InputError("observation: a list must hold single observations, not batches")
            images.extend(item_images)
        return images, True
    if isinstance(observation, Mapping):
        if "image" not in observation:
            raise InputError(f"observation: a dict observation needs an 'image' entry, got keys {list(observation)}")
        observation = observation["image"]
    if not isinstance(observation, torch.Tensor):
        observation = np.asarray(observation)  # PIL images and nested lists become HWC arrays
    if observation.ndim == 3:
        return [observation], False
    if observation.ndim == 4:
        if observation.shape[0] == 0:
            raise InputError("observation: got an empty batch")
        return list(observation), True
    raise InputError(
        f"observation: expected an HWC image, a batch [N, H, W, 3] or a dict with 'image', "
        f"got shape {tuple(observation.shape)}"
    )
