"""Post-training (cosmos3_gym.training) on a tiny synthetic dataset, on CPU.

The dataset is a red square moving on a dark background; each action is the square's velocity, so forward dynamics
are learnable. Module fixtures train a tiny VAE once and a tiny world model once; the other tests reuse them (and the
latent cache) so the whole file stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer
from dist_utils import run_distributed
from safetensors.torch import load_file

from cosmos3_gym import cli, processor
from cosmos3_gym.checkpoint import load_safetensors_state_dict
from cosmos3_gym.engine import MODES, Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import InputError
from cosmos3_gym.media import to_uint8
from cosmos3_gym.models.transformer import (
    Cosmos3Transformer,
    Cosmos3TransformerConfig,
    diffusers_to_native_state_dict,
)
from cosmos3_gym.models.vae import Cosmos3VAE
from cosmos3_gym.sampling import make_schedule
from cosmos3_gym.testing import TINY_SCHEDULER_CONFIG, TINY_TRANSFORMER_CONFIG
from cosmos3_gym.training import (
    VAETrainConfig,
    WorldModelTrainConfig,
    WorldModelTrainer,
    native_to_diffusers_state_dict,
    train_vae,
    train_world_model,
)
from cosmos3_gym.training.data import (
    TrainingWindows,
    build_training_windows,
    encode_episode_windows,
    encode_windows,
    encode_windows_of_episodes,
    read_dataset,
)
from cosmos3_gym.training.distributed import init_distributed
from cosmos3_gym.training.flow_matching import (
    FlowMatchingBatch,
    FlowMatchingObjective,
    mode_masks,
    shift_sigmas,
    timesteps_from_sigmas,
)
from cosmos3_gym.training.rollout import RolloutConditioner, generate_forward_dynamics, reencode_last_frame
from cosmos3_gym.training.schedule import learning_rate
from cosmos3_gym.training.vae import _ClipBatches
from cosmos3_gym.training.world_model import (
    enable_gradient_checkpointing,
    init_train_steps,
    sample_batch,
    step_generator,
    warn_if_vae_clips_are_short,
)

TASK = "move the red square"
CHUNK, TIER, FPS = 4, 256, 10.0
TINY_MODEL = {
    "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
    "num_hidden_layers": 2, "rope_scaling": {"mrope_section": [4, 2, 2]},
}
TINY_VAE = dict(base_dim=4, decoder_base_dim=8, z_dim=16, num_res_blocks=1, frames_per_clip=5, resolution_tier=TIER)


def make_dataset(root: Path, num_episodes: int = 4, steps: int = 16, size: int = 64, seed: int = 0) -> Path:
    """Episodes in the documented layout: a 12x12 red square bouncing around; actions = its velocity (pixels)."""
    (root / "episodes").mkdir(parents=True)
    rng = np.random.default_rng(seed)
    all_actions = []
    for episode in range(num_episodes):
        position = rng.uniform(12, size - 12, 2)
        frames, actions = [], []
        for t in range(steps + 1):
            frame = np.full((size, size, 3), 30, np.uint8)
            y, x = position.astype(int)
            frame[y - 6 : y + 6, x - 6 : x + 6] = (230, 60, 40)
            frames.append(frame)
            if t < steps:
                velocity = rng.uniform(-3, 3, 2)
                velocity = np.where((position + velocity < 8) | (position + velocity > size - 8), -velocity, velocity)
                actions.append(velocity)
                position = position + velocity
        actions = np.asarray(actions, np.float32)
        all_actions.append(actions)
        np.savez(root / "episodes" / f"episode_{episode:06d}.npz", frames=np.stack(frames), actions=actions,
                 task=np.array(TASK))
    a = np.concatenate(all_actions)
    stats = {"min": a.min(0), "max": a.max(0), "mean": a.mean(0), "std": a.std(0),
             "q01": np.quantile(a, 0.01, 0), "q99": np.quantile(a, 0.99, 0)}
    (root / "stats.json").write_text(json.dumps({"action": {k: v.tolist() for k, v in stats.items()}}))
    (root / "meta.json").write_text(json.dumps({
        "domain": "pusht", "raw_action_dim": 2, "fps": FPS, "image_size": [size, size],
        "action_normalization": "minmax", "num_episodes": num_episodes, "source": "synthetic",
    }))
    return root


def world_model_config(tmp: Path, **overrides) -> WorldModelTrainConfig:
    values = dict(model=TINY_MODEL, chunk=CHUNK, resolution_tier=TIER, steps=40, batch_size=4, lr=1e-3,
                  warmup_steps=0, lr_schedule="constant", log_every=1, save_every=0, ema_decay=0.9, progress=False,
                  cache_dir=str(tmp / "latent_cache"), device="cpu")
    values.update(overrides)
    return WorldModelTrainConfig(**values)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("training")


@pytest.fixture(scope="module")
def dataset(work) -> Path:
    return make_dataset(work / "dataset")


@pytest.fixture(scope="module")
def vae_dir(work, dataset) -> Path:
    return train_vae(dataset, work / "vae", VAETrainConfig(**TINY_VAE, steps=4, batch_size=2, stats_clips=4,
                                                           log_every=1, progress=False, device="cpu"))


@pytest.fixture(scope="module")
def trained(work, dataset, vae_dir) -> Path:
    """40 steps of the tiny world model on the whole dataset, exported."""
    return train_world_model(dataset, work / "checkpoint", world_model_config(work), vae_dir)


@pytest.fixture(scope="module")
def engine(trained) -> Cosmos3Engine:
    return Cosmos3Engine.from_pretrained(trained, device="cpu", dtype="fp32", progress=False)


# ----------------------------------------------------------------------------------------------------------------
# VAE
# ----------------------------------------------------------------------------------------------------------------


def test_vae_trains_and_fits_latent_statistics(vae_dir, dataset):
    log = read_log(vae_dir / "train_log.jsonl")
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all(np.isfinite([r["loss"], r["l1"], r["l2"], r["kl"]]).all() for r in log)
    # The fitted statistics normalise the latents of the clips they were fitted on to mean 0, std 1 per channel.
    vae = Cosmos3VAE.from_pretrained(vae_dir)
    info = read_dataset(dataset)
    episodes = [np.load(p)["frames"] for p in info.episode_paths]
    config = VAETrainConfig(**TINY_VAE, batch_size=2, stats_clips=4)
    clips = _ClipBatches(episodes, config, salt="latent_statistics")
    latents = []
    for step in range(2):
        pixels, (h, w), _ = clips[step]
        latents.append(vae.encode(pixels)[..., :h, :w])
    per_channel = torch.cat(latents).transpose(0, 1).flatten(1).double()
    torch.testing.assert_close(per_channel.mean(1), torch.zeros(16, dtype=torch.float64), atol=2e-3, rtol=0)
    torch.testing.assert_close(per_channel.std(1, correction=0), torch.ones(16, dtype=torch.float64), atol=2e-3, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Conventions shared with the engine and the sampler
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden_act", ["silu", "relu2"])
def test_native_diffusers_round_trip_is_exact(hidden_act):
    torch.manual_seed(0)
    config = {**TINY_TRANSFORMER_CONFIG, "vocab_size": 300, "hidden_act": hidden_act}
    diffusers_state = Cosmos3OmniTransformer(**config).state_dict()
    cfg = Cosmos3TransformerConfig.from_dict(config)
    native = diffusers_to_native_state_dict(diffusers_state, cfg)
    back = native_to_diffusers_state_dict(native, cfg)
    assert set(back) == set(diffusers_state) - {"lm_head.weight", "norm.weight"}
    assert all(torch.equal(back[k], diffusers_state[k]) for k in back)
    again = diffusers_to_native_state_dict(back, cfg)
    assert set(again) == set(native) and all(torch.equal(again[k], native[k]) for k in native)


def test_timesteps_and_sigma_shift_match_the_sampler():
    for shift in (3.0, 5.0):
        schedule = make_schedule(4, {**TINY_SCHEDULER_CONFIG, "flow_shift": shift})
        sigmas = torch.tensor(schedule.sigmas[:-1])
        assert timesteps_from_sigmas(sigmas).tolist() == schedule.timesteps.tolist()
        # The sampler's grid is the shifted linear grid: shift_sigmas reproduces it from the unshifted points.
        unshifted = torch.linspace(1.0, 1.0 / 1000, 5, dtype=torch.float64)[:-1]
        torch.testing.assert_close(shift_sigmas(unshifted, shift)[1:].float(), sigmas[1:], atol=1e-6, rtol=0)


def test_mode_masks_equal_the_engine(engine, dataset):
    frames = np.load(read_dataset(dataset).episode_paths[0])["frames"][: CHUNK + 1]
    for mode_index, mode in enumerate(("policy", "forward_dynamics", "inverse_dynamics")):
        prepared = engine.prepare(Cosmos3Request(
            mode=mode, observation=frames if mode == "inverse_dynamics" else frames[0], task=TASK, domain="pusht",
            action=np.zeros((CHUNK, 2), np.float32) if mode == "forward_dynamics" else None, chunk=CHUNK,
            resolution_tier=TIER, fps=FPS,
        ))
        latent_t = prepared.latent_thw[0]
        video_noisy, action_noisy = mode_masks(torch.tensor([mode_index]), latent_t, CHUNK)
        assert sorted(set(range(latent_t)) - set(video_noisy[0].nonzero().flatten().tolist())) == prepared.clean_frames
        assert sorted(set(range(CHUNK)) - set(action_noisy[0].nonzero().flatten().tolist())) == prepared.clean_rows


def test_training_windows_equal_the_engine_inputs(engine, trained, dataset, vae_dir, work):
    """Cached latents, prompts and actions of a window are what the engine builds from the same frames."""
    info = read_dataset(dataset)
    vae = Cosmos3VAE.from_pretrained(vae_dir)
    windows = build_training_windows(
        info, vae, vae_dir, engine.tokenizer, chunk=CHUNK, stride=4, resolution_tier=TIER, view_point="ego_view",
        fps=FPS, cache_dir=work / "latent_cache", progress=False,
    )
    assert len(windows) == 4 * 4  # 16 actions per episode, windows of 4 every 4 frames
    index = 6
    episode = np.load(info.episode_paths[int(windows.episode_index[index])])
    start = int(windows.start[index])
    prepared = engine.prepare(Cosmos3Request(
        mode="inverse_dynamics", observation=episode["frames"][start : start + CHUNK + 1], task=TASK,
        domain="pusht", chunk=CHUNK, resolution_tier=TIER, fps=FPS,
    ))
    # Windows are encoded 8 at a time; a batched convolution rounds differently from a single one (float32 noise).
    torch.testing.assert_close(windows.latents[index], prepared.x0_video[0], atol=1e-5, rtol=0)
    one_at_a_time, _ = encode_episode_windows(vae, episode["frames"], [start], CHUNK, TIER, batch_size=1)
    assert torch.equal(one_at_a_time[0], prepared.x0_video[0])
    cond_ids, uncond_ids = windows.prompts[int(windows.prompt_index[index])]
    assert (cond_ids, uncond_ids) == (prepared.cond_ids, prepared.uncond_ids)
    expected = info.stats.normalize(episode["actions"][start : start + CHUNK])
    np.testing.assert_allclose(windows.actions[index].numpy(), expected, atol=1e-6)
    assert windows.actions.abs().max() <= 1.0 + 1e-6


def test_windows_encoded_across_episodes_are_each_windows_own_encoding(dataset, vae_dir):
    """Batches that straddle episodes (as one-window self-forcing samples make them) give each window the latents of
    its own encoding, in its episode's order."""
    vae = Cosmos3VAE.from_pretrained(vae_dir)
    info = read_dataset(dataset)
    conds = [processor.prepare_conditioning(f, TIER, len(f)) for f in (np.load(p)["frames"] for p in
                                                                        info.episode_paths[:2])]
    episodes = [(conds[0], [0]), (conds[1], [0, 4, 8]), (conds[0], [8, 4])]
    batched = encode_windows_of_episodes(vae, episodes, CHUNK, batch_size=2)
    assert [len(latents) for latents in batched] == [1, 3, 2]
    for (cond, starts), latents in zip(episodes, batched):
        for start, latent in zip(starts, latents):
            alone = encode_windows(vae, cond, [start], CHUNK, batch_size=1)[0]
            torch.testing.assert_close(latent, alone, atol=1e-5, rtol=0)  # batched convolutions round differently
    assert not torch.allclose(batched[2][0], batched[2][1])  # different windows: the check above can fail


def test_objective_under_bf16_autocast_with_prompts_of_two_lengths():
    """Cond and uncond prompts differ in length; under autocast the GEN tower's per-prompt-length attention must
    run (bf16 outputs, fp32 queries) and put every sample back in its row (samples are scaled differently so a
    mix-up would show)."""
    cfg = Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG, "vocab_size": 64})
    torch.manual_seed(0)
    objective = FlowMatchingObjective(Cosmos3Transformer(cfg))
    generator = torch.Generator().manual_seed(0)
    scale = torch.tensor([1.0, 3.0, 0.3, 2.0]).view(-1, 1, 1, 1, 1)
    batch = FlowMatchingBatch(
        prompt_ids=[list(range(1, 12)), list(range(1, 6)), list(range(1, 12)), list(range(1, 6))], fps=[FPS] * 4,
        video=scale * torch.randn(4, 16, 2, 4, 4, generator=generator), actions=torch.zeros(4, CHUNK, 64),
        raw_action_dims=torch.full((4,), 2), domain_ids=torch.full((4,), 4), modes=torch.tensor([0, 1, 2, 0]),
        sigmas=torch.tensor([0.9, 0.5, 0.7, 0.2]), video_noise=torch.randn(4, 16, 2, 4, 4, generator=generator),
        action_noise=torch.randn(4, CHUNK, 64, generator=generator),
    )
    with torch.no_grad():
        reference = objective(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = objective(batch)
    for key in ("video_mse", "action_mse"):
        torch.testing.assert_close(mixed[key], reference[key], rtol=3e-2, atol=1e-3, equal_nan=True)


def _two_sample_batch(modes: list[int]) -> FlowMatchingBatch:
    """Two samples of the tiny transformer's shapes, prompts of two lengths, in ``modes``."""
    generator = torch.Generator().manual_seed(1)
    return FlowMatchingBatch(
        prompt_ids=[list(range(1, 12)), list(range(1, 6))], fps=[FPS] * 2,
        video=torch.randn(2, 16, 2, 4, 4, generator=generator), actions=torch.zeros(2, CHUNK, 64),
        raw_action_dims=torch.full((2,), 2), domain_ids=torch.full((2,), 4), modes=torch.tensor(modes),
        sigmas=torch.tensor([0.9, 0.4]), video_noise=torch.randn(2, 16, 2, 4, 4, generator=generator),
        action_noise=torch.randn(2, CHUNK, 64, generator=generator),
    )


def test_gradient_checkpointing_gives_the_same_gradients():
    """Full and selective checkpointing give the gradients of no checkpointing; full recomputes the forward's matmuls
    in the backward pass, selective keeps them (counted at the dispatcher), so the policies really differ."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    cfg = Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG, "vocab_size": 64})
    batch = _two_sample_batch([0, 2])
    gradients, backward_matmuls = {}, {}
    for policy in (None, "full", "selective"):
        torch.manual_seed(0)
        model = Cosmos3Transformer(cfg)
        if policy is not None:
            enable_gradient_checkpointing(model, policy=policy)
        loss = FlowMatchingObjective(model)(batch)["loss"]
        with MatmulCounter() as counter:
            loss.backward()
        backward_matmuls[policy] = counter.count
        gradients[policy] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for policy in ("full", "selective"):
        assert gradients[policy].keys() == gradients[None].keys()
        for name, grad in gradients[None].items():
            torch.testing.assert_close(gradients[policy][name], grad, rtol=1e-5, atol=1e-7, msg=(policy, name))
    assert backward_matmuls["selective"] == backward_matmuls[None] < backward_matmuls["full"], backward_matmuls
    with pytest.raises(InputError, match="checkpoint_policy"):
        enable_gradient_checkpointing(Cosmos3Transformer(cfg), policy="some")
    with pytest.raises(InputError, match="checkpoint_policy"):
        WorldModelTrainConfig(checkpoint_policy="some").validate()


def test_selective_checkpointing_in_compiled_blocks_gives_the_eager_gradients():
    """benchmarks/training_fsdp_gpu.py --checkpointing selective --compile: the checkpoint wrapper compiled per block
    (torch.compile warns that a context_fn needs a region without in-place ops) gives eager's gradients."""
    cfg = Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG, "vocab_size": 64})
    batch = _two_sample_batch([0, 1])
    gradients = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Cosmos3Transformer(cfg)
        enable_gradient_checkpointing(model, policy="selective")
        if compiled:
            model.compile_blocks()
        FlowMatchingObjective(model)(batch)["loss"].backward()
        gradients.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys()
    for name, grad in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_trainer_compiles_the_blocks_and_trains_as_eager(work, dataset, vae_dir):
    """``compile_blocks`` (the benchmark's fastest LoRA setting, issue 46): the blocks run compiled and give the same
    losses as eager, step for step."""
    # A fresh dynamo state, as in a new training process: after the test above, the shared `checkpointed` wrapper
    # would recompile into shape-dynamic graphs (automatic dynamic shapes), slower to compile than the static ones.
    torch._dynamo.reset()
    losses = []
    for compiled in (False, True):
        out = work / f"compile_blocks_{compiled}"
        config = world_model_config(work, steps=2, compile_blocks=compiled, gradient_checkpointing=True)
        ctx = init_distributed("cpu")
        try:
            trainer = WorldModelTrainer(dataset, out, config, vae_dir, ctx)
            block = trainer.transformer.gen_layers[0]
            assert trainer.transformer.blocks_compiled is compiled
            assert hasattr(block.gen_forward, "_torchdynamo_orig_callable") is compiled  # torch.compile's wrapper
            trainer.train()
        finally:
            ctx.close()
        losses.append([row["loss"] for row in read_log(out / "training" / "log.jsonl")])
    assert len(losses[0]) == 2 and np.isfinite(losses[0]).all()
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# World-model training
# ----------------------------------------------------------------------------------------------------------------


def test_world_model_loss_decreases_in_every_mode(trained):
    log = read_log(trained / "training" / "log.jsonl")
    assert [r["step"] for r in log] == list(range(1, 41))
    losses = np.array([r["loss"] for r in log])
    assert np.isfinite(losses).all()
    assert losses[-10:].mean() < 0.85 * losses[:10].mean()
    for mode, terms in (("policy", ("video", "action")), ("forward_dynamics", ("video",)),
                        ("inverse_dynamics", ("action",))):
        values = [r["losses_by_mode"][mode][term] for r in log for term in terms
                  if r["losses_by_mode"][mode]["samples"]]
        assert values and np.isfinite(values).all(), mode
        assert all(r["losses_by_mode"][mode][term] is None for r in log for term in {"video", "action"} - set(terms))


def test_exported_checkpoint_runs_every_mode_and_loads_in_diffusers(trained, engine, dataset):
    meta = json.loads((trained / "meta.json").read_text())
    assert meta["chunk"] == CHUNK and meta["raw_action_dim"] == 2 and meta["domain"] == "pusht"
    stats = processor.ActionStats.from_json(trained / "action_stats.json", mode=meta["action_normalization"])
    assert stats.dim == 2
    frames = np.load(read_dataset(dataset).episode_paths[0])["frames"]
    for mode in ("policy", "forward_dynamics", "inverse_dynamics"):
        result = engine.step(Cosmos3Request(
            mode=mode, observation=frames[: CHUNK + 1] if mode == "inverse_dynamics" else frames[0], task=TASK,
            action=np.zeros((CHUNK, 2), np.float32) if mode == "forward_dynamics" else None, domain="pusht",
            chunk=CHUNK, num_inference_steps=2, resolution_tier=TIER, fps=FPS, seed=0,
        ), decode=False)
        assert result.action.shape == (CHUNK, 2) and np.isfinite(result.action).all()
        assert result.video_latents.shape == (16, 2, 4, 4) and torch.isfinite(result.video_latents).all()

    pipe = Cosmos3OmniPipeline.from_pretrained(trained, enable_safety_checker=False)
    assert pipe.scheduler.config.flow_shift == meta["flow_shift"] == 3.0
    exported = diffusers_to_native_state_dict(pipe.transformer.state_dict(), engine.transformer.config)
    ours = engine.transformer.state_dict()
    assert all(torch.equal(exported[k], ours[k]) for k in ours)


def test_overfitting_one_window_improves_forward_dynamics(work, vae_dir):
    """Trained on a single window (forward dynamics only), the model predicts that window's future latents far
    better than the untrained model (the same init exported after 0 steps)."""
    one_window = make_dataset(work / "one_window", num_episodes=1, steps=CHUNK, seed=3)
    base = dict(mode_probs={"forward_dynamics": 1.0}, uncond_prob=0.0, ema_decay=0.0, lr=3e-3, batch_size=4,
                sigma_distribution="uniform")
    untrained = train_world_model(one_window, work / "untrained", world_model_config(work, steps=0, **base), vae_dir)
    trained = train_world_model(one_window, work / "overfit", world_model_config(work, steps=250, **base), vae_dir)
    episode = np.load(one_window / "episodes" / "episode_000000.npz")
    actions = read_dataset(one_window).stats.normalize(episode["actions"])
    errors = {}
    for name, checkpoint in (("untrained", untrained), ("trained", trained)):
        model = Cosmos3Engine.from_pretrained(checkpoint, device="cpu", dtype="fp32", progress=False)
        truth = model.prepare(Cosmos3Request(  # the window's true latents, encoded as the engine encodes a video
            mode="inverse_dynamics", observation=episode["frames"], domain="pusht", chunk=CHUNK, resolution_tier=TIER,
        )).x0_video[0]
        result = model.step(Cosmos3Request(
            mode="forward_dynamics", observation=episode["frames"][0], task=TASK, action=actions, domain="pusht",
            chunk=CHUNK, num_inference_steps=4, guidance_scale=1.0, resolution_tier=TIER, fps=FPS, seed=0,
        ), decode=False)
        errors[name] = (result.video_latents[:, 1:] - truth[:, 1:]).square().mean().item()
    assert errors["trained"] < 0.3 * errors["untrained"], errors


def test_resume_continues_exactly_like_an_uninterrupted_run(work, dataset, vae_dir):
    # Warmup makes the learning rate depend on the step, so a resume that restarted the step count would differ.
    settings = dict(steps=6, warmup_steps=4, ema_decay=0.5)
    straight = work / "straight"
    train_world_model(dataset, straight, world_model_config(work, **settings), vae_dir)
    resumed = work / "resumed"
    interrupted = world_model_config(work, **{**settings, "steps": 3})
    train_world_model(dataset, resumed, interrupted, vae_dir)
    train_world_model(dataset, resumed, world_model_config(work, **settings, resume=True), vae_dir)

    state = resumed / "training" / "state" / "step-000000006"
    assert json.loads((state / "state.json").read_text())["step"] == 6
    for name in ("model", "ema", "optimizer"):
        a = load_file(straight / "training" / "state" / "step-000000006" / f"{name}.safetensors")
        b = load_file(state / f"{name}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    losses = [r["loss"] for r in read_log(straight / "training" / "log.jsonl")]
    assert losses == [r["loss"] for r in read_log(resumed / "training" / "log.jsonl")]
    with pytest.raises(InputError, match="chunk"):
        train_world_model(dataset, resumed, world_model_config(work, **settings, resume=True, chunk=8), vae_dir)


def test_max_seconds_stops_at_a_log_step_and_still_saves_and_exports(work, dataset, vae_dir):
    # A budget already spent by construction: the run stops at its first log step (3) of 40, writes its state and
    # exports a checkpoint that says how many steps it trained.
    out = work / "timed"
    config = world_model_config(work, steps=40, log_every=3, max_seconds=1e-9)
    checkpoint = train_world_model(dataset, out, config, vae_dir)
    assert json.loads((out / "training" / "state" / "step-000000003" / "state.json").read_text())["step"] == 3
    assert [r["step"] for r in read_log(out / "training" / "log.jsonl")] == [3]
    assert (checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    with pytest.raises(InputError, match="max_seconds"):
        world_model_config(work, max_seconds=0.0).validate()


def test_under_max_seconds_the_cosine_decay_follows_time(work, dataset, vae_dir):
    # Far more steps than the budget allows: by steps alone the cosine would not move (step 40 of 10**6); under a
    # 5 s budget it follows time, so the learning rate falls towards its floor before the run stops.
    out = work / "time_schedule"
    config = world_model_config(work, steps=10**6, log_every=2, max_seconds=5.0, lr_schedule="cosine",
                                min_lr_ratio=0.1)
    train_world_model(dataset, out, config, vae_dir)
    log = read_log(out / "training" / "log.jsonl")
    assert log[-1]["step"] < 10**6 and len(log) >= 3
    assert log[0]["lr"] > 0.9 * config.lr  # the first log step comes before any time check
    assert log[-1]["lr"] < 0.6 * config.lr
    assert all(a["lr"] >= b["lr"] for a, b in zip(log, log[1:]))


def _ddp_train(dataset, vae_dir, out, cache_dir):
    """One rank of a 2-process gloo run: 2 DDP steps; returns this rank's weights. A time budget that never binds
    still makes the ranks agree on the time spent at every log step (an all-reduce each)."""
    config = world_model_config(Path(cache_dir).parent, steps=2, batch_size=2, max_seconds=1e6)
    ctx = init_distributed("cpu")
    trainer = WorldModelTrainer(dataset, out, config, vae_dir, ctx)
    initial = {k: v.clone() for k, v in trainer.transformer.state_dict().items()}
    trainer.train()
    return initial, {k: v.clone() for k, v in trainer.transformer.state_dict().items()}


def test_ddp_ranks_stay_identical(work, dataset, vae_dir):
    (initial, rank0), (_, rank1) = run_distributed(
        _ddp_train, 2, dataset, vae_dir, work / "ddp", work / "latent_cache", timeout=120
    )
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert any(not torch.equal(rank0[k], initial[k]) for k in rank0)
    log = read_log(work / "ddp" / "training" / "log.jsonl")
    assert [r["step"] for r in log] == [1, 2]
    # Both ranks' samples are in the per-mode statistics: 2 ranks x 2 samples per step.
    assert sum(m["samples"] for m in log[0]["losses_by_mode"].values()) == 4


def test_cli_train_vae_and_train(work, dataset, tmp_path):
    vae_out = tmp_path / "cli_vae"
    assert cli.main([
        "train-vae", "--dataset", str(dataset), "--out", str(vae_out), "--steps", "2", "--batch-size", "1",
        "--base-dim", "4", "--decoder-base-dim", "8", "--frames-per-clip", "5", "--stats-clips", "1",
        "--device", "cpu",
    ]) == 0
    assert json.loads((vae_out / "config.json").read_text())["base_dim"] == 4
    decoder_out = tmp_path / "cli_decoder"
    assert cli.main([
        "train-vae", "--dataset", str(dataset), "--out", str(decoder_out), "--init-vae", str(vae_out),
        "--decoder-only", "--frames-per-clip", "9", "--steps", "1", "--batch-size", "1", "--device", "cpu",
    ]) == 0
    encoder = {k: v for k, v in load_safetensors_state_dict(vae_out).items() if k.startswith("encoder.")}
    assert all(torch.equal(v, load_safetensors_state_dict(decoder_out)[k]) for k, v in encoder.items())
    assert cli.main(["train-vae", "--dataset", str(dataset), "--out", str(tmp_path / "x"), "--decoder-only"]) == 2
    checkpoint = tmp_path / "cli_checkpoint"
    config = {"progress": False, "cache_dir": str(work / "latent_cache"), "save_every": 0}
    assert cli.main([
        "train", "--dataset", str(dataset), "--vae", str(vae_out), "--out", str(checkpoint), "--steps", "2",
        "--batch-size", "2", "--chunk", str(CHUNK), "--model", json.dumps(TINY_MODEL), "--config", json.dumps(config),
        "--save-dtype", "bfloat16", "--vae-save-dtype", "float16", "--device", "cpu", "--rollout-prob", "0.5",
    ]) == 0
    weights = load_safetensors_state_dict(checkpoint / "transformer")
    assert weights["proj_in.weight"].dtype == torch.bfloat16
    assert weights["time_embedder.linear_1.weight"].dtype == torch.float32  # kept fp32, as diffusers does
    assert {w.dtype for w in load_safetensors_state_dict(checkpoint / "vae").values()} == {torch.float16}
    Cosmos3Engine.from_pretrained(checkpoint, device="cpu", progress=False).close()
    assert cli.main(["train", "--dataset", str(dataset), "--vae", str(vae_out), "--out", str(checkpoint),
                     "--chunk", "0"]) == 2


def test_bad_inputs_name_the_field(work, dataset, vae_dir, tmp_path):
    with pytest.raises(InputError, match="mode_probs"):
        world_model_config(work, mode_probs={"dreaming": 1.0}).validate()
    with pytest.raises(InputError, match="frames_per_clip"):
        VAETrainConfig(frames_per_clip=6).validate()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text(json.dumps({"domain": "pusht", "fps": 10.0}))
    with pytest.raises(InputError, match="raw_action_dim"):
        read_dataset(broken)
    with pytest.raises(InputError, match="chunk"):
        train_world_model(dataset, tmp_path / "x", world_model_config(work, chunk=64), vae_dir)


def _windows(successful: list[bool]) -> TrainingWindows:
    n = len(successful)
    return TrainingWindows(
        latents=torch.zeros(n, 16, 2, 2, 2), actions=torch.zeros(n, CHUNK, 2),
        prompt_index=torch.zeros(n, dtype=torch.long),
        prompts=[([1, 2], [3])], episode_index=torch.arange(n), start=torch.zeros(n, dtype=torch.long),
        successful=torch.tensor(successful), canvas_hw=(32, 32),
    )


@pytest.mark.parametrize("policy_episodes", ["all", "successful"])
def test_policy_mode_can_be_kept_to_successful_episodes(work, policy_episodes):
    windows = _windows([True, False, False, False])
    config = world_model_config(work, batch_size=256, policy_episodes=policy_episodes,
                                mode_probs={"policy": 0.5, "forward_dynamics": 0.3, "inverse_dynamics": 0.2})
    policy, forward = MODES.index("policy"), MODES.index("forward_dynamics")
    seen = {True: [], False: []}
    for step in range(4):
        batch = sample_batch(windows, torch.Generator().manual_seed(step), config, domain_id=4, raw_action_dim=2,
                             action_dim=32, fps=FPS)
        # sample_batch draws the windows first, so the same seed tells which window each sample is
        drawn = torch.randint(len(windows), (config.batch_size,), generator=torch.Generator().manual_seed(step))
        for i, mode in zip(drawn.tolist(), batch.modes.tolist()):
            seen[bool(windows.successful[i])].append(mode)
    unsuccessful = torch.tensor(seen[False])
    assert (torch.tensor(seen[True]) == policy).any()  # successful windows still train the policy
    if policy_episodes == "all":
        assert (unsuccessful == policy).float().mean() > 0.35
    else:
        assert not (unsuccessful == policy).any()
        assert (unsuccessful == forward).float().mean() > 0.6  # demoted to forward dynamics, not dropped


def test_policy_episodes_successful_needs_a_successful_episode(work, dataset, vae_dir, tmp_path):
    with pytest.raises(InputError, match="policy_episodes"):
        world_model_config(work, policy_episodes="best").validate()
    with pytest.raises(InputError, match="policy_episodes: 'successful', but no episode"):
        train_world_model(dataset, tmp_path / "x", world_model_config(work, policy_episodes="successful"), vae_dir)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    config = VAETrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    rates = [learning_rate(config, step) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert rates[-1] == pytest.approx(1e-4, rel=0.01)
    assert learning_rate(dataclasses.replace(config, lr_schedule="constant"), 99) == 1e-3
    # under a time budget the decay follows the time spent when that is further along than the steps
    assert learning_rate(config, 10, time_fraction=1.0) == pytest.approx(1e-4)
    assert learning_rate(config, 55, time_fraction=0.5) == pytest.approx(rates[55])
    assert learning_rate(config, 10, time_fraction=0.5) == pytest.approx(rates[55])
    with pytest.raises(InputError, match="lr_schedule"):
        VAETrainConfig(lr_schedule="linear").validate()


def test_conditioning_noise_perturbs_only_the_clean_first_frame(work):
    windows = _windows([True, True])
    windows.latents = torch.randn(2, 16, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    kwargs = dict(domain_id=4, raw_action_dim=2, action_dim=32, fps=FPS)
    plain = sample_batch(windows, torch.Generator().manual_seed(1), world_model_config(work, batch_size=8), **kwargs)
    noisy = sample_batch(windows, torch.Generator().manual_seed(1),
                         world_model_config(work, batch_size=8, cond_noise_std=0.5), **kwargs)
    assert torch.equal(noisy.video[:, :, 1:], plain.video[:, :, 1:])
    assert torch.equal(noisy.video_noise, plain.video_noise) and torch.equal(noisy.modes, plain.modes)
    change = (noisy.video[:, :, 0] - plain.video[:, :, 0]).flatten(1).std(1)
    assert (change > 0).all() and (change < 0.5).all()
    with pytest.raises(InputError, match="cond_noise_std"):
        world_model_config(work, cond_noise_std=-1.0).validate()


# ----------------------------------------------------------------------------------------------------------------
# Rollout conditioning
# ----------------------------------------------------------------------------------------------------------------


def _rollout_conditioner(engine, dataset, vae_dir, work, **overrides) -> RolloutConditioner:
    info = read_dataset(dataset)
    windows = build_training_windows(
        info, engine.vae, vae_dir, engine.tokenizer, chunk=CHUNK, stride=CHUNK, resolution_tier=TIER,
        view_point="ego_view", fps=FPS, cache_dir=work / "latent_cache", progress=False,
    )
    settings = dict(chunk=CHUNK, prob=1.0, max_chunks=3, resolution_tier=TIER, fps=FPS, domain_id=4,
                    action_dim=engine.action_dim)
    settings.update(overrides)
    return RolloutConditioner(windows, engine.vae, make_schedule(4, engine.scheduler_config), **settings)


def _depth_one_rollout_and_env_handover(rollout, engine, dataset):
    """For the window starting a chunk into episode 1: the rollout's depth-1 frame 0, and what ``engine`` (the
    env's path) hands over from that episode's real frame 0 with the same actions and noise."""
    windows = rollout.windows
    target = int(torch.nonzero((windows.episode_index == 1) & (windows.start == CHUNK))[0])
    previous = int(rollout.chains[target, 0])
    assert int(windows.start[previous]) == 0 and int(windows.episode_index[previous]) == 1
    frames = np.load(read_dataset(dataset).episode_paths[1])["frames"]
    result = engine.step(Cosmos3Request(
        mode="forward_dynamics", observation=frames[0], action=windows.actions[previous].numpy(), task=TASK,
        domain="pusht", chunk=CHUNK, num_inference_steps=4, guidance_scale=1.0, resolution_tier=TIER, fps=FPS, seed=7,
    ))
    handed_over = to_uint8(result.pixels[:, -1].permute(1, 2, 0).numpy())
    expected = engine.prepare(Cosmos3Request(
        mode="forward_dynamics", observation=handed_over, action=np.zeros((CHUNK, 2), np.float32), task=TASK,
        domain="pusht", chunk=CHUNK, resolution_tier=TIER, fps=FPS,
    )).x0_video
    # The rollout draws its noise first from the generator, as the engine draws a request's noise from its seed.
    first = rollout.first_frames(engine.transformer, FlowMatchingObjective(engine.transformer).encode_prompts,
                                 torch.tensor([target]), torch.tensor([1]), torch.Generator().manual_seed(7),
                                 autocast=False)
    return first, expected, target


def test_rollout_frame_is_what_the_env_hands_to_the_next_chunk(engine, trained, dataset, vae_dir, work):
    """Depth 1: the engine's forward-dynamics chunk from the previous window's real frame, its last frame as uint8,
    encoded as the next request's frame 0 -- with the same noise, the same latents as the env's path."""
    rollout = _rollout_conditioner(engine, dataset, vae_dir, work)
    first, expected, target = _depth_one_rollout_and_env_handover(rollout, engine, dataset)
    torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)
    real = rollout.windows.latents[target, :, :1]
    assert (first[0] - real).abs().max() > 1e-2  # the model's frame, not the real one


def test_rollout_hands_over_through_the_light_decoder_as_the_env_does(engine, trained, dataset, vae_dir, work):
    """With a light decoder (an env with decoder="light"), the rollout's frame 0 is what that env hands over: the
    light decoder's last frame as uint8, encoded again; and not what the VAE's decode would give."""
    from cosmos3_gym.models.light_decoder import LightDecoder, LightDecoderConfig

    torch.manual_seed(5)
    light = LightDecoder(LightDecoderConfig(latent_channels=engine.vae.latent_channels, channels=(16, 8),
                                            blocks=(1, 0), patch_size=8)).eval().requires_grad_(False)
    light_engine = Cosmos3Engine(engine.transformer, engine.vae, engine.tokenizer, engine.scheduler_config,
                                 progress=False, light_decoder=light)
    rollout = _rollout_conditioner(engine, dataset, vae_dir, work, light_decoder=light)
    first, expected, _ = _depth_one_rollout_and_env_handover(rollout, light_engine, dataset)
    torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)
    by_vae, _, _ = _depth_one_rollout_and_env_handover(_rollout_conditioner(engine, dataset, vae_dir, work), engine,
                                                       dataset)
    assert (first - by_vae).abs().max() > 1e-2


def test_rollout_decoder_setting_is_checked():
    with pytest.raises(InputError, match="rollout_decoder"):
        WorldModelTrainConfig(rollout_decoder="tiles").validate()
    with pytest.raises(InputError, match="rollout_decoder"):
        WorldModelTrainConfig(rollout_prob=0.5, rollout_decoder="light").validate()  # no init_checkpoint to read


def test_rollout_chains_and_depths(engine, trained, dataset, vae_dir, work):
    rollout = _rollout_conditioner(engine, dataset, vae_dir, work, prob=0.5)
    windows = rollout.windows
    for i in range(len(windows)):
        start, episode = int(windows.start[i]), int(windows.episode_index[i])
        for k in range(3):
            j = int(rollout.chains[i, k])
            if start - (k + 1) * CHUNK < 0:
                assert j == -1
            else:
                assert (int(windows.start[j]), int(windows.episode_index[j])) == (start - (k + 1) * CHUNK, episode)
    index = torch.arange(len(windows)).repeat(4)
    eligible = torch.arange(len(index)) % 3 != 0
    seen = set()
    for seed in range(30):
        depth = rollout.draw(index, eligible, torch.Generator().manual_seed(seed))
        picked = depth > 0
        (value,) = set(depth[picked].tolist())  # one depth per step: the generation's shapes stay fixed
        seen.add(value)
        candidates = eligible & (rollout.available[index] >= value)
        assert not (picked & ~candidates).any()
        assert int(picked.sum()) == min(round(0.5 * len(index)), int(candidates.sum()))
    assert seen == {1, 2, 3}
    # A depth-2 chain is two hand-overs: the first from the real frame two windows back with that window's actions.
    target = int(torch.nonzero(rollout.available == 3)[0])
    encode = FlowMatchingObjective(engine.transformer).encode_prompts
    chained = rollout.first_frames(engine.transformer, encode, torch.tensor([target]), torch.tensor([2]),
                                   torch.Generator().manual_seed(3), autocast=False)
    generator = torch.Generator().manual_seed(3)
    first = windows.latents[rollout.chains[target, 1], :, :1][None]
    for window in (rollout.chains[target, 1], rollout.chains[target, 0]):
        noise = torch.randn((1, *windows.latents.shape[1:]), generator=generator)
        actions = torch.zeros(1, CHUNK, engine.action_dim)
        actions[..., :2] = windows.actions[window]
        latents = generate_forward_dynamics(
            engine.transformer, encode([windows.prompts[0][0]]), first, actions, torch.tensor([4]), noise,
            rollout.schedule, FPS,
        )
        first = reencode_last_frame(engine.vae, latents, TIER)
    torch.testing.assert_close(chained, first, atol=0, rtol=0)


def test_training_with_rollouts_replaces_only_frame_zero_of_conditioned_samples(work, dataset, vae_dir, trained):
    config = world_model_config(work, window_stride=CHUNK, rollout_prob=1.0, rollout_max_chunks=2, steps=2,
                                batch_size=8, init_checkpoint=str(trained), model={})
    ctx = init_distributed("cpu")
    try:
        trainer = WorldModelTrainer(dataset, work / "rollout_run", config, vae_dir, ctx)
        batch = sample_batch(trainer.windows, torch.Generator().manual_seed(0), config, domain_id=4,
                             raw_action_dim=2, action_dim=trainer.transformer.config.action_dim, fps=FPS)
        conditioned = trainer.condition_on_rollouts(batch, autocast=False)
        changed = (conditioned.video[:, :, 0] - batch.video[:, :, 0]).flatten(1).abs().amax(1) > 0
        generator = step_generator(config.seed, trainer.step, 0, stream="rollout")
        depth = trainer.rollout.draw(batch.window_index, batch.modes != MODES.index("inverse_dynamics"), generator)
        assert depth.any() and torch.equal(changed, depth > 0)
        assert torch.equal(conditioned.video[:, :, 1:], batch.video[:, :, 1:])
        trainer.train()
        assert trainer.step == 2 and np.isfinite(read_log(trainer.log_path)[-1]["loss"])
        meta = json.loads((trainer.export() / "meta.json").read_text())
    finally:
        ctx.close()
    init_meta = json.loads((trained / "meta.json").read_text())
    assert init_meta["total_train_steps"] == init_meta["train_steps"] > 0  # trained from scratch
    assert (meta["train_steps"], meta["total_train_steps"]) == (2, init_meta["train_steps"] + 2)
    broken = work / "broken_meta"
    shutil.copytree(trained, broken)
    (broken / "meta.json").write_text("{not json")
    with pytest.raises(InputError, match="init_checkpoint: cannot read the training steps"):
        init_train_steps(str(broken))
    with pytest.raises(InputError, match="window_stride"):
        world_model_config(work, rollout_prob=0.5, window_stride=3).validate()
    with pytest.raises(InputError, match="rollout_prob"):
        world_model_config(work, rollout_prob=1.5).validate()


def test_decoder_only_fine_tune_keeps_the_latent_space(work, dataset, vae_dir):
    """init_vae + train_encoder=False: encoder, quant conv and latent statistics stay bit-identical (so a world model
    trained on the latents stays valid); only the decoder learns, here on clips longer than the VAE has seen."""
    out = train_vae(dataset, work / "vae_decoder", VAETrainConfig(
        **{**TINY_VAE, "frames_per_clip": 9}, init_vae=str(vae_dir), train_encoder=False, steps=3, batch_size=2,
        lr=1e-3, warmup_steps=0, log_every=1, progress=False, device="cpu",
    ))
    before, after = (load_file(next(Path(d).glob("*.safetensors"))) for d in (vae_dir, out))
    assert before.keys() == after.keys()
    for name in before:
        same = torch.equal(before[name], after[name])
        assert same == name.startswith(("encoder.", "quant_conv.")), name
    config_before, config_after = (json.loads((Path(d) / "config.json").read_text()) for d in (vae_dir, out))
    for key in ("latents_mean", "latents_std", "z_dim", "base_dim"):
        assert config_after[key] == config_before[key]
    with pytest.raises(InputError, match="train_encoder"):
        VAETrainConfig(train_encoder=False).validate()


def test_world_model_training_warns_when_the_vae_saw_shorter_clips(vae_dir):
    with pytest.warns(UserWarning, match="5-frame clips but chunk=8 generates 9 frames"):
        warn_if_vae_clips_are_short(vae_dir, chunk=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_vae_clips_are_short(vae_dir, chunk=CHUNK)  # 5-frame clips cover chunk 4
