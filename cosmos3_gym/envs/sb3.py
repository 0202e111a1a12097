"""``SB3VecEnv``: Stable-Baselines3's ``VecEnv`` API over a Gymnasium vector env (SB3 accepts only its own VecEnv).

SB3 resets a finished env inside the step that finished it and hands over the last observation in
``infos[i]["terminal_observation"]``, with ``infos[i]["TimeLimit.truncated"]`` telling a time-out from a real end
(used to bootstrap the value). That is Gymnasium's ``SAME_STEP`` autoreset, so the vector env must use it:
``gym.make_vec("cosmos3_gym/WorldModel-v0", num_envs=N, autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP,
...)``, or in Gymnasium's spelling ``vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}`` (the same env,
``cosmos3_gym.registration``). Add ``stable_baselines3.common.vec_env.VecMonitor`` on top for episode returns in
SB3's logs.

The slots of a batched vector env are not separate objects, so ``get_attr`` / ``set_attr`` / ``env_method`` act on
the vector env itself: an attribute read is repeated for each requested index, and a method is called once.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector import VectorEnv as GymVectorEnv
from stable_baselines3.common.vec_env import VecEnv

from ..errors import InputError


class SB3VecEnv(VecEnv):
    """Wraps a ``gymnasium.vector.VectorEnv`` with ``SAME_STEP`` autoreset (e.g. ``WorldModelVectorEnv``)."""

    def __init__(self, vector_env: GymVectorEnv):
        if not isinstance(vector_env, GymVectorEnv):
            raise InputError(f"vector_env: expected a gymnasium.vector.VectorEnv, got {type(vector_env).__name__}.")
        if vector_env.metadata.get("autoreset_mode") != AutoresetMode.SAME_STEP:
            raise InputError(
                f"vector_env: SB3 needs autoreset_mode=AutoresetMode.SAME_STEP (finished envs reset within the step), "
                f"got {vector_env.metadata.get('autoreset_mode')}."
            )
        self.vector_env = vector_env  # before VecEnv.__init__, which reads render_mode through get_attr
        self._actions: np.ndarray | None = None
        super().__init__(vector_env.num_envs, vector_env.single_observation_space, vector_env.single_action_space)

    def reset(self):
        seeds = None if all(seed is None for seed in self._seeds) else list(self._seeds)
        observations, info = self.vector_env.reset(seed=seeds, options=self._merged_options())
        self.reset_infos = [_slot_info(info, i) for i in range(self.num_envs)]
        self._reset_seeds()
        self._reset_options()
        return observations

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    def step_wait(self):
        if self._actions is None:
            raise InputError("actions: call step_async(actions) before step_wait().")
        observations, rewards, terminated, truncated, info = self.vector_env.step(self._actions)
        self._actions = None
        dones = terminated | truncated
        infos = []
        for i in range(self.num_envs):
            if dones[i]:
                # The top-level info of a slot reset in this step is its reset info; its step info is final_info.
                self.reset_infos[i] = _slot_info(info, i)
                slot_info = _slot_info(info["final_info"], i)
                slot_info["terminal_observation"] = info["final_obs"][i]
            else:
                slot_info = _slot_info(info, i)
            slot_info["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            infos.append(slot_info)
        return observations, rewards.astype(np.float32), dones, infos

    def close(self) -> None:
        self.vector_env.close()

    def get_images(self):
        frames = self.vector_env.render()
        return [None] * self.num_envs if frames is None else list(frames)

    def get_attr(self, attr_name: str, indices=None) -> list[Any]:
        value = getattr(self.vector_env, attr_name)
        return [value for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices=None) -> None:
        setattr(self.vector_env, attr_name, value)

    def env_method(self, method_name: str, *method_args, indices=None, **method_kwargs) -> list[Any]:
        result = getattr(self.vector_env, method_name)(*method_args, **method_kwargs)
        return [result for _ in self._get_indices(indices)]

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices=None) -> list[bool]:
        return [False for _ in self._get_indices(indices)]  # the slots are not gymnasium.Env objects to wrap

    def _merged_options(self) -> dict[str, Any] | None:
        """SB3 keeps one options dict per env; the vector env takes per-slot lists (None: that slot's default)."""
        keys = sorted(set().union(*self._options))
        if not keys:
            return None
        return {key: [options.get(key) for options in self._options] for key in keys}


def _slot_info(info: dict[str, Any], slot: int) -> dict[str, Any]:
    """Slot ``slot``'s entries of a Gymnasium vector info dict (arrays masked by ``_key``) as a plain dict."""
    result = {}
    for key, value in info.items():
        if key.startswith("_") or key in ("final_obs", "final_info"):
            continue
        mask = info.get(f"_{key}")
        if mask is not None and not mask[slot]:
            continue
        result[key] = _slot_info(value, slot) if isinstance(value, dict) else _scalar(value[slot])
    return result


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value
