"""``PolicyAgent``: Cosmos3's policy mode (observation image + task -> action chunk) as an agent for the env."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .. import presets
from ..errors import InputError
from .base import EngineAgent

__all__ = ["PolicyAgent"]


class PolicyAgent(EngineAgent):
    """Acts with the checkpoint's own policy: ``agent.act(obs)`` (or ``agent(obs)``) -> an action chunk.

    ``obs`` is one image (uint8 ``HWC`` array, PIL image or ``CHW`` tensor), an env observation dict with an
    ``"image"`` entry, a batch of images (``[N, H, W, 3]``, as ``obs["image"]`` of the vector env) or a list of
    observations. One observation gives ``[chunk, raw_action_dim]``; a batch gives ``[N, chunk, raw_action_dim]``
    from ONE batched ``engine.step``. Actions are float32 clipped to the action space, [-1, 1] (the model's
    normalised space, which the env's action space uses); a preset with raw actions (``"droid_robolab"``: joint
    positions) returns them unclipped.

    Checkpoints trained with state rows (``action_history_length``, e.g. the ``"droid_robolab"`` preset) need the
    robot's state: ``act(obs, state=...)`` (``[H, raw_action_dim]`` rows, or ``[N, H, raw_action_dim]`` for a batch),
    a ``"state"`` entry in a dict observation, or a RoboLab dict's ``observation/joint_position`` and
    ``observation/gripper_position``. With the preset's camera composite a RoboLab dict of camera images is one
    observation (``presets.robolab_composite``).

    ``predict`` has Stable-Baselines3's signature, so SB3 evaluation helpers accept the agent as a model.
    """

    mode = "policy"

    def act(self, observation: Any, task: str | Sequence[str] | None = None, state: Any = None) -> np.ndarray:
        """Action chunk(s) for ``observation``; ``task`` (one string or one per observation) overrides the agent's;
        ``state`` gives the state rows when the checkpoint needs them (see the class docstring)."""
        images, batched = _split_observations(observation, whole_dicts=self.observation_adapter is not None)
        tasks = self._tasks(task, len(images))
        histories = self._histories(observation, images, batched, state)
        actions = self._run(
            [
                self._request(image, task, action_history=history)
                for image, task, history in zip(images, tasks, histories)
            ]
        )
        if self.normalized_actions:
            actions = np.clip(actions, -1.0, 1.0)
        return actions if batched else actions[0]

    def _histories(self, observation: Any, images: list[Any], batched: bool, state: Any) -> list[Any]:
        """The state rows of each observation (None each when the checkpoint takes none)."""
        if not self.action_history_length:
            if state is not None:
                raise InputError("state: this agent's checkpoint takes no state rows (action_history_length=0)")
            return [None] * len(images)
        if state is not None:
            rows = np.asarray(state, dtype=np.float32)
            rows = rows if batched else rows[None]
            if rows.ndim != 3 or len(rows) != len(images):
                raise InputError(
                    f"state: expected [H, raw_action_dim] rows per observation ({len(images)} observations), got "
                    f"shape {np.asarray(state).shape}"
                )
            return list(rows)
        items = list(observation) if isinstance(observation, (list, tuple)) else [observation]
        histories = []
        for item in items if len(items) == len(images) else [None] * len(images):
            found = None
            if isinstance(item, Mapping):
                found = item.get("state")
                if found is None:
                    found = presets.robolab_state(item, self.action_history_length)
            if found is None:
                raise InputError(
                    f"state: the checkpoint conditions on {self.action_history_length} state row(s); pass "
                    "act(obs, state=...) or a dict observation with 'state' (or the RoboLab joint/gripper keys)"
                )
            histories.append(found)
        return histories

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


def _split_observations(observation: Any, whole_dicts: bool = False) -> tuple[list[Any], bool]:
    """``(images, batched)``: the single images in ``observation`` and whether it was a batch. With ``whole_dicts``
    (an observation adapter such as the RoboLab camera composite) a dict without "image" is one observation."""
    if isinstance(observation, (list, tuple)):
        if not observation:
            raise InputError("observation: got an empty list")
        images = []
        for item in observation:
            item_images, item_batched = _split_observations(item, whole_dicts)
            if item_batched:
                raise InputError("observation: a list must hold single observations, not batches")
            images.extend(item_images)
        return images, True
    if isinstance(observation, Mapping):
        if whole_dicts and "image" not in observation:
            return [observation], False
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
