"""TorchRL (issue 45 item 5): the PushT world-model env in TorchRL's ``GymEnv`` / ``GymWrapper`` steps with TorchRL's
conventions (a TensorDict with ``("next", "reward")``, ``done`` / ``terminated`` / ``truncated`` of shape [1]), and
a collector gathers batches over the batched vector env (``autoreset_mode`` DISABLED, which TorchRL requires of
Gymnasium vector envs). The built-in model with 1 sampling step and 2-chunk episodes keeps it fast.
"""

from __future__ import annotations

import gymnasium as gym
import pytest

torchrl = pytest.importorskip(
    "torchrl",
    reason="torchrl (and tensordict) could not be installed next to this package's torch: pip install -c "
    "<torch constraint> torchrl",
)

import cosmos3_gym  # noqa: E402,F401  (registers cosmos3_gym/PushT-v0)

ENV_ID = "cosmos3_gym/PushT-v0"
FAST = dict(num_steps=1, max_episode_steps=2, device="cpu")


def test_gym_env_by_id_steps_the_pusht_env():
    from torchrl.envs import GymEnv

    env = GymEnv(ENV_ID, **FAST)  # TorchRL offers frameskip= and drops it on the env's TypeError
    rollout = env.rollout(3)
    assert rollout["image"].shape[-3:] == (256, 256, 3) and rollout["action"].shape[-2:] == (8, 2)
    env.close()


def test_gym_wrapper_steps_the_pusht_env():
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    env = GymWrapper(gym.make(ENV_ID, **FAST), device="cpu")
    check_env_specs(env)  # a short rollout checked against the specs TorchRL read off the Gymnasium spaces
    rollout = env.rollout(5)  # stops at the end of the first episode (2 chunks)
    assert rollout.batch_size == (2,)
    assert rollout["image"].shape == (2, 256, 256, 3) and str(rollout["image"].dtype) == "torch.uint8"
    assert rollout["action"].shape == (2, 8, 2) and float(rollout["action"].abs().max()) <= 1.0
    assert rollout["next", "reward"].shape == (2, 1)
    assert rollout["next", "done"].flatten().tolist() == [False, True]
    assert rollout["next", "truncated"].flatten().tolist() == [False, True]  # the time limit, not success
    assert rollout["next", "terminated"].flatten().tolist() == [False, False]
    env.close()


def test_collector_over_the_vector_env():
    import torchrl.collectors as collectors
    from gymnasium.vector import AutoresetMode
    from torchrl.envs import GymWrapper

    vector = gym.make_vec(ENV_ID, num_envs=2, vectorization_mode="vector_entry_point",
                          vector_kwargs={"autoreset_mode": AutoresetMode.DISABLED}, **FAST)
    assert type(vector).__name__ == "WorldModelVectorEnv"  # ONE batched model call per step
    env = GymWrapper(vector, device="cpu")
    assert env.batch_size == (2,)
    Collector = getattr(collectors, "SyncDataCollector", None) or collectors.Collector  # renamed in torchrl 0.11
    collector = Collector(env, policy=None, frames_per_batch=8, total_frames=16)
    batches = list(collector)
    collector.shutdown()
    assert len(batches) == 2
    for batch in batches:
        assert batch.batch_size == (2, 4)  # [slots, steps]
        assert batch["next", "reward"].shape == (2, 4, 1)
        # 2-chunk episodes: each slot ends one every other step and TorchRL resets it
        assert batch["next", "done"].squeeze(-1).tolist() == [[False, True, False, True]] * 2
    assert batches[1]["collector", "traj_ids"].max() > batches[0]["collector", "traj_ids"].max()
    env.close()
    with pytest.raises(RuntimeError, match="auto-reset mode must be one of SAME_STEP or DISABLED"):
        GymWrapper(gym.make_vec(ENV_ID, num_envs=2, vectorization_mode="vector_entry_point", **FAST))
