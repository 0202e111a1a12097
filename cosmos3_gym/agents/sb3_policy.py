"""Stable-Baselines3 PPO policies saved as safetensors, and ``SB3PolicyAgent`` to act with one on frames.

SB3's own ``.zip`` format pickles (cloudpickle) the policy's spaces and settings; this project never unpickles
weights. ``save_sb3_policy`` writes the ``MultiInputActorCriticPolicy`` (``PPO("MultiInputPolicy", ...)``) weights
to one ``.safetensors`` file, with everything needed to rebuild the policy as the file's string metadata, each value
JSON-encoded: the observation and action spaces (the observed image's size among them), ``net_arch``, the
activation, the features extractor and its kwargs (``cnn_output_dim``), ``normalize_images`` and
``share_features_extractor``. ``load_sb3_policy`` rebuilds the same policy from that metadata and loads the weights
strictly (every tensor present, none extra, every shape equal).

Shared tensors: with ``share_features_extractor`` (SB3's default) the policy's state dict lists the one CNN under
three names (``features_extractor.*``, ``pi_features_extractor.*``, ``vf_features_extractor.*``), and safetensors
refuses to store a tensor twice. The file holds each tensor once, under its first name; loading hands it to every
name of the rebuilt policy that shares it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import numpy as np
import safetensors
import safetensors.torch
import torch
from gymnasium import spaces
from stable_baselines3.common.policies import MultiInputActorCriticPolicy
from stable_baselines3.common.preprocessing import is_image_space_channels_first
from stable_baselines3.common.torch_layers import CombinedExtractor

from ..data.initial_states import resize_frames
from ..errors import CheckpointError, InputError
from ..storage import save_safetensors

__all__ = ["SB3PolicyAgent", "load_sb3_policy", "read_sb3_policy_metadata", "save_sb3_policy"]

FORMAT = "cosmos3_gym.sb3_policy.v1"
KIND = "sb3_ppo"  # what cosmos3_gym.rl.policy.load_policy_file dispatches on (files written before it lack it)
# The metadata keys save_sb3_policy writes itself; the caller's own metadata may not reuse them.
ARCHITECTURE_KEYS = (
    "format",
    "policy_class",
    "observation_space",
    "action_space",
    "net_arch",
    "activation_fn",
    "features_extractor_class",
    "features_extractor_kwargs",
    "normalize_images",
    "share_features_extractor",
)


# ---------------------------------------------------------------------------------------------------------------
# Saving and loading
# ---------------------------------------------------------------------------------------------------------------


def save_sb3_policy(model_or_policy: Any, path: str | os.PathLike, **metadata: Any) -> Path:
    """Write the policy of an SB3 ``PPO("MultiInputPolicy", ...)`` model (or the ``MultiInputActorCriticPolicy``
    itself) to ``path`` (a ``.safetensors`` file; its folder is created). ``metadata``: extra JSON-serialisable
    values stored with it (e.g. ``world="simulator"``), read back by ``read_sb3_policy_metadata``. Returns ``path``."""
    policy = getattr(model_or_policy, "policy", model_or_policy)
    if type(policy) is not MultiInputActorCriticPolicy:
        raise InputError(
            f"policy: expected an SB3 MultiInputActorCriticPolicy (PPO 'MultiInputPolicy') or a model "
            f"with one, got {type(policy).__name__}"
        )
    if policy.use_sde:
        raise InputError("policy: policies with state-dependent exploration (use_sde=True) are not supported")
    if policy.features_extractor_class is not CombinedExtractor:
        raise InputError(
            f"policy: only SB3's CombinedExtractor features extractor is supported, got "
            f"{policy.features_extractor_class.__name__}"
        )
    activation = policy.activation_fn.__name__
    if getattr(torch.nn, activation, None) is not policy.activation_fn:
        raise InputError(f"policy: the activation must be a torch.nn class, got {policy.activation_fn!r}")
    clashing = sorted(set(metadata) & {*ARCHITECTURE_KEYS, "kind"})
    if clashing:
        raise InputError(f"metadata: {clashing} are written by save_sb3_policy itself; use other names")
    observation_space = policy.observation_space
    assert isinstance(observation_space, spaces.Dict)  # MultiInputActorCriticPolicy observes a spaces.Dict
    architecture = {
        "format": FORMAT,
        "kind": KIND,
        "policy_class": type(policy).__name__,
        "observation_space": {
            key: _box_to_json(space, f"observation_space[{key!r}]") for key, space in observation_space.spaces.items()
        },
        "action_space": _box_to_json(policy.action_space, "action_space"),
        "net_arch": policy.net_arch,
        "activation_fn": activation,
        "features_extractor_class": policy.features_extractor_class.__name__,
        "features_extractor_kwargs": policy.features_extractor_kwargs,
        "normalize_images": policy.normalize_images,
        "share_features_extractor": policy.share_features_extractor,
    }
    try:
        encoded = {key: json.dumps(value) for key, value in {**architecture, **metadata}.items()}
    except TypeError as error:
        raise InputError(f"metadata: values must be JSON-serialisable ({error})") from error
    state = policy.state_dict()
    tensors = {
        name: state[name].detach().cpu().contiguous() for name, first in _first_names(policy).items() if name == first
    }
    # Crash-safe: a temporary file, fsynced and renamed over ``path``, with the tensors' sha256 (cosmos3_gym.storage).
    return save_safetensors(path, tensors, encoded)


def read_sb3_policy_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The decoded metadata of a file written by ``save_sb3_policy`` (its header only, not the weights): the
    architecture entries and the caller's own. Raises ``CheckpointError`` naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"sb3 policy: {path} does not exist (expected a .safetensors file written by save_sb3_policy)"
        )
    try:
        with safetensors.safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for a bad header or a truncated file
        raise CheckpointError(f"sb3 policy: {path} is not a readable safetensors file ({error})") from error
    try:
        metadata = {key: json.loads(value) for key, value in raw.items()}
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"sb3 policy: {path} has metadata that is not JSON ({error}): not written by save_sb3_policy"
        ) from error
    missing = [key for key in ARCHITECTURE_KEYS if key not in metadata]
    if missing:
        raise CheckpointError(f"sb3 policy: {path} lacks the metadata {missing}: not written by save_sb3_policy")
    if metadata["format"] != FORMAT:
        raise CheckpointError(f"sb3 policy: {path} has format {metadata['format']!r}, expected {FORMAT!r}")
    supported = {
        "policy_class": MultiInputActorCriticPolicy.__name__,
        "features_extractor_class": CombinedExtractor.__name__,
    }
    for key, name in supported.items():
        if metadata[key] != name:
            raise CheckpointError(f"sb3 policy: {path} has {key} {metadata[key]!r}; only {name} is supported")
    return metadata


def load_sb3_policy(path: str | os.PathLike, device: torch.device | str = "cpu") -> MultiInputActorCriticPolicy:
    """Rebuild the policy saved by ``save_sb3_policy`` at ``path`` (same spaces and architecture) with its weights,
    in eval mode on ``device``. Raises ``CheckpointError`` naming the file and what is wrong."""
    metadata = read_sb3_policy_metadata(path)
    try:
        observation_space = spaces.Dict(
            {key: _box_from_json(value) for key, value in metadata["observation_space"].items()}
        )
        activation_fn = getattr(torch.nn, metadata["activation_fn"])
        policy = MultiInputActorCriticPolicy(
            observation_space,
            _box_from_json(metadata["action_space"]),
            lr_schedule=lambda _: 0.0,  # only used by the optimizer, which acting does not touch
            net_arch=metadata["net_arch"],
            activation_fn=activation_fn,
            ortho_init=False,  # the saved weights replace any initialisation
            features_extractor_class=CombinedExtractor,
            features_extractor_kwargs=metadata["features_extractor_kwargs"],
            normalize_images=metadata["normalize_images"],
            share_features_extractor=metadata["share_features_extractor"],
        )
    except Exception as error:  # a malformed entry surfaces as whatever gymnasium / SB3 / torch raise on it
        raise CheckpointError(f"sb3 policy: {path} has metadata that does not describe a policy ({error})") from error
    stored = safetensors.torch.load_file(str(path))
    first_names = _first_names(policy)
    missing = sorted(set(first_names.values()) - set(stored))
    unexpected = sorted(set(stored) - set(first_names.values()))
    if missing or unexpected:
        raise CheckpointError(
            f"sb3 policy: the tensors in {path} do not match the policy its metadata describes: "
            f"missing {missing}, unexpected {unexpected}"
        )
    try:
        policy.load_state_dict({name: stored[first] for name, first in first_names.items()}, strict=True)
    except RuntimeError as error:  # a tensor's shape differs from the metadata's architecture
        raise CheckpointError(
            f"sb3 policy: the weights in {path} do not fit the policy its metadata describes ({error})"
        ) from error
    policy.set_training_mode(False)
    return policy.to(device)


def _first_names(policy: torch.nn.Module) -> dict[str, str]:
    """Each state-dict name -> the first name of the same tensor (they differ only for shared tensors)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(tensor), name) for name, tensor in policy.state_dict(keep_vars=True).items()}


def _box_to_json(space: Any, field: str) -> dict[str, Any]:
    """A ``Box`` as JSON: shape, dtype and bounds (one number where all of a bound's entries are equal)."""
    if not isinstance(space, spaces.Box):
        raise InputError(f"policy: {field} must be a gymnasium Box, got {type(space).__name__}")

    def bound(values: np.ndarray) -> Any:
        return values.flat[0].item() if (values == values.flat[0]).all() else values.tolist()

    return {"shape": list(space.shape), "dtype": space.dtype.name, "low": bound(space.low), "high": bound(space.high)}


def _box_from_json(entry: dict[str, Any]) -> spaces.Box:
    dtype = np.dtype(entry["dtype"])
    low, high = (
        np.asarray(entry[name], dtype) if isinstance(entry[name], list) else entry[name] for name in ("low", "high")
    )
    return spaces.Box(low, high, tuple(entry["shape"]), dtype)


# ---------------------------------------------------------------------------------------------------------------
# Acting on frames
# ---------------------------------------------------------------------------------------------------------------


class SB3PolicyAgent:
    """``act(frames [N, H, W, 3] uint8) -> [N, chunk, 2]``: normalised action chunks in [-1, 1] from an SB3 PPO
    policy (or model) trained on the world-model envs' ``{"image": [s, s, 3]}`` observations.

    Each frame is downscaled to the policy's image size by the envs' own ``resize_frame``, as the world-model env
    and the simulator env did for its training observations. ``deterministic`` (the default): the policy's mean
    action; otherwise sampled (torch's global RNG).
    """

    def __init__(self, model_or_policy: Any, deterministic: bool = True):
        self.policy = getattr(model_or_policy, "policy", model_or_policy)
        observation_space = getattr(self.policy, "observation_space", None)
        if (
            not isinstance(observation_space, spaces.Dict)
            or set(observation_space.spaces) != {"image"}
            or not isinstance(observation_space["image"], spaces.Box)
        ):
            raise InputError(f"policy: expected an SB3 policy observing {{'image': Box}}, got {observation_space}")
        image_space = observation_space["image"]
        # SB3 stores image spaces channels first (it transposes the envs' HWC images) and transposes back in predict.
        height_width = image_space.shape[1:] if is_image_space_channels_first(image_space) else image_space.shape[:2]
        self.image_size = cast("tuple[int, int]", tuple(height_width))  # an image Box: [3, H, W] or [H, W, 3]
        self.deterministic = deterministic

    @property
    def action_shape(self) -> tuple[int, ...]:
        """The shape of one action: ``(chunk, raw_action_dim)``."""
        return tuple(self.policy.action_space.shape)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike, device: torch.device | str = "cpu", deterministic: bool = True
    ) -> SB3PolicyAgent:
        """The agent of a policy file written by ``save_sb3_policy``."""
        return cls(load_sb3_policy(path, device), deterministic)

    def act(self, frames: np.ndarray) -> np.ndarray:
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
            raise InputError(
                f"frames: expected uint8 [N, H, W, 3] with N >= 1, got {frames.dtype} {list(frames.shape)}"
            )
        images = resize_frames(frames, self.image_size)
        actions, _ = self.policy.predict({"image": images}, deterministic=self.deterministic)
        return np.clip(actions, -1.0, 1.0)
