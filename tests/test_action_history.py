"""Training with state rows (``WorldModelTrainConfig.action_history_length``): each window's previous actions go
before its chunk as clean action rows, exactly where the engine puts a request's ``action_history`` and as the env
passes a slot's last executed actions, so that a checkpoint trained with them runs in the env unchanged.

A frame shows where things are, not how they move: PushT's agent velocity is a linear function of its position and
its last 3-4 targets, and a perfect model that does not know it ends 8 px off at chunk 8
(``benchmarks/recipes/handover_sensitivity.py``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_training import FPS, TASK, TIER, make_dataset, world_model_config

from cosmos3_gym.engine import MODES, Cosmos3Engine, Cosmos3Request
from cosmos3_gym.envs import WorldModelEnv
from cosmos3_gym.errors import InputError
from cosmos3_gym.models.vae import Cosmos3VAE
from cosmos3_gym.tokenizer import build_tiny_tokenizer
from cosmos3_gym.training import train_world_model
from cosmos3_gym.training.data import build_training_windows, read_dataset
from cosmos3_gym.training.flow_matching import FlowMatchingBatch, FlowMatchingObjective, mode_masks

POLICY, FORWARD, INVERSE = (MODES.index(m) for m in ("policy", "forward_dynamics", "inverse_dynamics"))
HISTORY, CHUNK = 3, 4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("action_history")


@pytest.fixture(scope="module")
def dataset(work):
    return make_dataset(work / "dataset", num_episodes=2, steps=12, size=32)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Cosmos3Engine:
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


def test_windows_put_the_previous_actions_first(dataset, tiny_checkpoint, work):
    info = read_dataset(dataset)
    vae_dir = tiny_checkpoint / "vae"

    def windows_of(history: int):
        return build_training_windows(
            info, Cosmos3VAE.from_pretrained(vae_dir), vae_dir, build_tiny_tokenizer(), chunk=CHUNK, stride=2,
            resolution_tier=TIER, view_point="ego_view", fps=FPS, cache_dir=work / "cache", progress=False,
            action_history_length=history,
        )

    windows, plain = windows_of(HISTORY), windows_of(0)
    assert windows.actions.shape[1:] == (HISTORY + CHUNK, 2)
    assert torch.equal(windows.latents, plain.latents) and torch.equal(windows.actions[:, HISTORY:], plain.actions)
    for i in range(len(windows)):
        actions = info.stats.normalize(np.load(info.episode_paths[int(windows.episode_index[i])])["actions"])
        s = int(windows.start[i])
        # before the episode's start, its first action (what the env passes at a slot's first step: its chunk's
        # first action, repeated)
        expected = actions[np.clip(np.arange(s - HISTORY, s + CHUNK), 0, None)]
        np.testing.assert_allclose(windows.actions[i].numpy(), expected, atol=1e-6)
    assert windows.start[:3].tolist() == [0, 2, 4]  # a first window, one cut short by the start, one not
    with pytest.raises(InputError, match="^action_history_length:"):
        build_training_windows(info, None, vae_dir, None, chunk=CHUNK, stride=2, resolution_tier=TIER,
                               view_point="ego_view", fps=FPS, cache_dir=work / "cache", action_history_length=-1)


def test_state_rows_are_clean_in_every_mode_as_in_the_engine(engine):
    for index, mode in enumerate(MODES):
        prepared = engine.prepare(Cosmos3Request(
            mode=mode, observation=np.zeros((CHUNK + 1 if mode == "inverse_dynamics" else 1, 32, 32, 3), np.uint8),
            task=TASK, domain="pusht", chunk=CHUNK, resolution_tier=TIER, fps=FPS,
            action=np.zeros((CHUNK, 2), np.float32) if mode == "forward_dynamics" else None,
            action_history=np.ones((HISTORY, 2), np.float32), action_history_length=HISTORY,
        ))
        _, action_noisy = mode_masks(torch.tensor([index]), 2, CHUNK, state_rows=HISTORY)
        assert action_noisy.shape == (1, HISTORY + CHUNK)
        assert (~action_noisy[0]).nonzero().flatten().tolist() == prepared.clean_rows


def _forward_dynamics_batch(engine, history: np.ndarray, chunk_actions: np.ndarray, video: torch.Tensor):
    d = engine.action_dim
    actions = torch.zeros(1, HISTORY + CHUNK, d)
    actions[0, :, :2] = torch.from_numpy(np.concatenate([history, chunk_actions]))
    return FlowMatchingBatch(
        prompt_ids=[[1, 2, 3]], fps=[FPS], video=video, actions=actions, raw_action_dims=torch.tensor([2]),
        domain_ids=torch.tensor([0]), modes=torch.tensor([FORWARD]), sigmas=torch.tensor([0.5]),
        video_noise=torch.zeros_like(video), action_noise=torch.zeros(1, HISTORY + CHUNK, d),
    )


def test_engine_and_training_feed_the_state_rows_alike(engine, monkeypatch):
    """The transformer gets the same action rows, clean masks and row times from a forward-dynamics request with
    state rows and from a training batch of the same actions: rows [history, chunk], the history at times 1 - H .. 0."""
    rng = np.random.default_rng(0)
    history = rng.uniform(-1, 1, (HISTORY, 2)).astype(np.float32)
    chunk_actions = rng.uniform(-1, 1, (CHUNK, 2)).astype(np.float32)
    seen: list[dict] = []
    transformer_type = type(engine.transformer)
    gen_layout, forward = transformer_type.gen_layout, transformer_type.forward

    def spy_layout(self, *args, action_start_offset=1, **kwargs):
        seen.append({"offset": action_start_offset, "rows": args[2]})
        return gen_layout(self, *args, action_start_offset=action_start_offset, **kwargs)

    def spy_forward(self, text, layout, video, video_noisy, timesteps, actions, action_noisy, domain_ids, **kwargs):
        seen[-1].update(actions=actions[0].clone(), action_noisy=action_noisy[0].clone())
        return forward(self, text, layout, video, video_noisy, timesteps, actions, action_noisy, domain_ids, **kwargs)

    monkeypatch.setattr(transformer_type, "gen_layout", spy_layout)
    monkeypatch.setattr(transformer_type, "forward", spy_forward)
    engine.step([Cosmos3Request(
        mode="forward_dynamics", observation=np.zeros((32, 32, 3), np.uint8), task=TASK, domain="pusht", chunk=CHUNK,
        resolution_tier=TIER, fps=FPS, num_inference_steps=1, action=chunk_actions, action_history=history,
        action_history_length=HISTORY, seed=0, guidance_scale=1.0,
    )])
    objective = FlowMatchingObjective(engine.transformer, action_history_length=HISTORY)
    with torch.no_grad():
        objective(_forward_dynamics_batch(engine, history, chunk_actions, torch.zeros(1, 16, 2, 2, 2)))
    from_engine, from_training = seen
    assert from_engine["offset"] == [1 - HISTORY] and from_training["offset"] == 1 - HISTORY
    assert from_engine["rows"] == from_training["rows"] == HISTORY + CHUNK
    assert torch.equal(from_engine["action_noisy"], from_training["action_noisy"])
    assert not from_training["action_noisy"].any()  # forward dynamics: every row given
    torch.testing.assert_close(from_engine["actions"], from_training["actions"], atol=0, rtol=0)


def test_state_rows_carry_no_loss_but_condition(engine):
    """Noise drawn for the state rows changes nothing (they go in clean and are not scored); other state rows change
    the policy-mode loss (the model sees them)."""
    d = engine.action_dim
    generator = torch.Generator().manual_seed(0)
    video = torch.randn(2, 16, 2, 2, 2, generator=generator)
    actions = torch.zeros(2, HISTORY + CHUNK, d)
    actions[..., :2] = torch.rand(2, HISTORY + CHUNK, 2, generator=generator) * 2 - 1
    noise = torch.randn(2, HISTORY + CHUNK, d, generator=generator)

    def batch(actions, action_noise):
        return FlowMatchingBatch(
            prompt_ids=[[1, 2, 3]] * 2, fps=[FPS] * 2, video=video, actions=actions,
            raw_action_dims=torch.tensor([2, 2]), domain_ids=torch.tensor([0, 0]),
            modes=torch.tensor([POLICY, INVERSE]), sigmas=torch.tensor([0.6, 0.4]),
            video_noise=torch.randn(video.shape, generator=torch.Generator().manual_seed(1)), action_noise=action_noise,
        )

    objective = FlowMatchingObjective(engine.transformer, action_history_length=HISTORY)
    other_noise, other_history = noise.clone(), actions.clone()
    other_noise[:, :HISTORY] = torch.randn(2, HISTORY, d, generator=generator)
    other_history[:, :HISTORY, :2] = -other_history[:, :HISTORY, :2]
    with torch.no_grad():
        base = objective(batch(actions, noise))
        assert torch.equal(objective(batch(actions, other_noise))["loss"], base["loss"])
        assert not torch.equal(objective(batch(other_history, noise))["action_mse"], base["action_mse"])


def test_trained_checkpoint_makes_the_env_pass_its_last_actions(work, dataset, tiny_checkpoint, monkeypatch):
    out = train_world_model(dataset, work / "trained", world_model_config(
        work, steps=2, action_history_length=HISTORY, cache_dir=str(work / "train_cache")), tiny_checkpoint / "vae")
    assert json.loads((out / "meta.json").read_text())["action_history_length"] == HISTORY
    frame = np.load(read_dataset(dataset).episode_paths[0])["frames"][0]
    env = WorldModelEnv(out, device="cpu", dtype="fp32", initial_states=frame, num_steps=1)
    assert env.settings.history_length == HISTORY
    requests: list[Cosmos3Request] = []
    step = env.engine.step
    monkeypatch.setattr(env.engine, "step", lambda batch, **kwargs: requests.extend(batch) or step(batch, **kwargs))
    env.reset(seed=0)
    chunks = [np.random.default_rng(i).uniform(-1, 1, (CHUNK, 2)).astype(np.float32) for i in range(2)]
    for chunk_actions in chunks:
        env.step(chunk_actions)
    assert [r.action_history_length for r in requests] == [HISTORY, HISTORY]
    np.testing.assert_array_equal(requests[0].action_history, np.repeat(chunks[0][:1], HISTORY, axis=0))
    np.testing.assert_array_equal(requests[1].action_history, chunks[0][-HISTORY:])
    env.close()


@pytest.mark.parametrize("overrides, field", [
    (dict(action_history_length=-1), "action_history_length"),
    (dict(action_history_length=True), "action_history_length"),
    (dict(action_history_length=2, rollout_prob=0.5), "rollout_prob"),
])
def test_bad_settings_name_the_field(work, overrides, field):
    with pytest.raises(InputError, match=f"WorldModelTrainConfig.{field}:"):
        world_model_config(work, **overrides).validate()


def test_the_history_cannot_change_on_resume(work, dataset, tiny_checkpoint):
    settings = dict(steps=2, cache_dir=str(work / "train_cache"))
    run = work / "resumable"
    train_world_model(dataset, run, world_model_config(work, **settings, action_history_length=2),
                      tiny_checkpoint / "vae")
    with pytest.raises(InputError, match="WorldModelTrainConfig.action_history_length: .* cannot change on resume"):
        train_world_model(dataset, run, world_model_config(work, **{**settings, "steps": 3}, resume=True),
                          tiny_checkpoint / "vae")
