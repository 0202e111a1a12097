"""``SB3VecEnv``: Stable-Baselines3's VecEnv API over the batched world-model env, and PPO training on it."""

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import VecMonitor

from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.envs import SB3VecEnv, WorldModelVectorEnv
from cosmos3_gym.errors import InputError

FAST = dict(domain="pusht", chunk=4, num_steps=2, resolution_tier=256)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


def image(seed: int, size=(64, 64)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def make_sb3_env(shared_engine, num_envs=2, **kwargs) -> SB3VecEnv:
    defaults = dict(engine=shared_engine, initial_states=[image(0), image(1)], max_episode_steps=2,
                    autoreset_mode=AutoresetMode.SAME_STEP)
    return SB3VecEnv(WorldModelVectorEnv(num_envs, **{**FAST, **defaults, **kwargs}))


def test_vec_env_api(engine):
    env = make_sb3_env(engine, reward_model=lambda frames, tasks: frames.mean(dim=(1, 2, 3, 4)), task="push")
    assert env.num_envs == 2 and env.observation_space["image"].shape == (64, 64, 3)
    assert env.action_space.shape == (4, 2)

    env.seed(3)
    obs = env.reset()
    assert obs["image"].shape == (2, 64, 64, 3) and obs["image"].dtype == np.uint8
    env.seed(3)
    assert np.array_equal(env.reset()["image"], obs["image"])  # seeds are used by the next reset
    assert env.reset_infos[0]["task"] == "push"

    actions = np.zeros((2, 4, 2), np.float32)
    obs, rewards, dones, infos = env.step(actions)
    assert rewards.dtype == np.float32 and rewards.shape == (2,) and not dones.any()
    assert rewards[0] == pytest.approx(infos[0]["score"]) and infos[0]["elapsed_steps"] == 1
    assert infos[0]["TimeLimit.truncated"] is False and "terminal_observation" not in infos[0]

    new_obs, _, dones, infos = env.step(actions)  # max_episode_steps=2: both episodes time out
    assert dones.all()
    for i in range(2):
        assert infos[i]["TimeLimit.truncated"] is True and infos[i]["elapsed_steps"] == 2
        assert infos[i]["terminal_observation"]["image"].shape == (64, 64, 3)
        assert "initial_state_index" in env.reset_infos[i]  # the reset that followed
    assert not np.array_equal(infos[0]["terminal_observation"]["image"], new_obs["image"][0])

    assert env.get_attr("image_size") == [(64, 64), (64, 64)]
    assert env.get_attr("num_envs", indices=[1]) == [2]
    assert env.env_is_wrapped(VecMonitor) == [False, False]
    env.env_method("offload")
    env.set_options({"task": "lift"})
    env.reset()
    assert env.get_attr("tasks")[0] == ["lift", "lift"]
    env.set_options([{"initial_state_index": 1}, {}])  # per-env options become per-slot values
    env.reset()
    assert [info["initial_state_index"] for info in env.reset_infos][0] == 1
    env.close()
    env.close()


def test_needs_same_step_autoreset(engine):
    with pytest.raises(InputError, match="SAME_STEP"):
        SB3VecEnv(WorldModelVectorEnv(2, engine=engine, initial_states=image(0), **FAST))
    with pytest.raises(InputError, match="vector_env"):
        SB3VecEnv(object())


def test_ppo_runs_on_the_world_model_with_the_rewards_it_computes(engine):
    """What this checks, precisely: PPO (MultiInputPolicy, NatureCNN on the image) runs a few hundred steps inside the
    world model, every episode ends at max_episode_steps, the returns SB3 logs are the sums of exactly the rewards the
    reward model computed (not dropped, scaled or sign-flipped on the way), and the weights change. Whether PPO
    learns (improves the return) is checked on a task where it must, below: a random tiny world model offers
    nothing to learn in 256 steps."""
    computed = []

    def reward_model(frames, tasks):
        values = frames[:, -1].mean(dim=(1, 2, 3))
        computed.append(values.detach().double().cpu().numpy())
        return values

    env = VecMonitor(make_sb3_env(engine, max_episode_steps=8, observation_size=(48, 48), reward_model=reward_model))
    model = PPO("MultiInputPolicy", env, n_steps=32, batch_size=32, n_epochs=1, seed=0, device="cpu",
                policy_kwargs=dict(net_arch=[16], features_extractor_kwargs=dict(cnn_output_dim=16)))
    before = [p.detach().clone() for p in model.policy.parameters()]
    model.learn(total_timesteps=256)
    assert model.num_timesteps == 256
    returns = [info["r"] for info in model.ep_info_buffer]
    assert len(returns) == 256 // 8 and all(info["l"] == 8 for info in model.ep_info_buffer)
    assert sum(returns) == pytest.approx(float(np.concatenate(computed).sum()), rel=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.policy.parameters()))
    env.close()


class ActionRewardEnv(gym.Env):
    """A task where PPO must learn: the reward is ``sign`` times the mean of the action chunk (the world model's
    action shape); the observation carries no information, so only the policy's mean action matters."""

    observation_space = gym.spaces.Dict({"state": gym.spaces.Box(-1.0, 1.0, (2,), np.float32)})
    action_space = gym.spaces.Box(-1.0, 1.0, (4, 2), np.float32)

    def __init__(self, sign: float):
        self.sign, self.t = sign, 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return {"state": self.np_random.uniform(-1, 1, 2).astype(np.float32)}, {}

    def step(self, action):
        self.t += 1
        reward = self.sign * float(np.clip(action, -1, 1).mean())
        return {"state": self.np_random.uniform(-1, 1, 2).astype(np.float32)}, reward, False, self.t >= 4, {}


def test_ppo_learns_through_sb3_vec_env_where_the_reward_demands_it():
    """The same SB3VecEnv plumbing on a task whose reward depends on the action: PPO's mean action moves towards the
    rewarded side, and with the reward's sign flipped (same seed) the other way."""
    from gymnasium.vector import SyncVectorEnv

    learned = {}
    for sign in (1.0, -1.0):
        env = SB3VecEnv(SyncVectorEnv([functools.partial(ActionRewardEnv, sign)] * 4,
                                      autoreset_mode=AutoresetMode.SAME_STEP))
        model = PPO("MultiInputPolicy", env, n_steps=64, batch_size=64, n_epochs=4, learning_rate=3e-3, seed=0,
                    device="cpu", policy_kwargs=dict(net_arch=[16]))
        probe = {"state": np.zeros((16, 2), np.float32)}
        initial = float(model.predict(probe, deterministic=True)[0].mean())
        model.learn(total_timesteps=2048)
        learned[sign] = float(model.predict(probe, deterministic=True)[0].mean()) - initial
        env.close()
    assert learned[1.0] > 0.3 and learned[-1.0] < -0.3, learned
