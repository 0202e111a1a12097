"""The light decoder (issue 24): shapes and the VAE's decode contract, causality, the last-frame shortcut, files,
training, the engine / env option ``decoder="light"`` and the recipe's smoke run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import safetensors.torch
import torch
from test_pusht import FRAME, build_tiny_pusht_assets
from test_training import make_dataset

import cosmos3_gym  # noqa: F401  (registers the env ids)
from cosmos3_gym import launcher, processor
from cosmos3_gym.engine import LIGHT_DECODER_DIR, Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.models.light_decoder import LightDecoder, LightDecoderConfig
from cosmos3_gym.models.vae import Cosmos3VAE
from cosmos3_gym.training.light_decoder import (
    DecoderWindows,
    LightDecoderTrainConfig,
    build_decoder_windows,
    decoder_psnr,
    light_decoder_loss,
    train_light_decoder,
)

TINY = LightDecoderConfig(channels=(8, 8, 6, 4), blocks=(1, 0, 0, 1))


def tiny_decoder(seed: int = 0) -> LightDecoder:
    torch.manual_seed(seed)
    return LightDecoder(TINY).eval()


def latents(t: int, batch: int = 2, h: int = 2, w: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 16, t, h, w, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 3])
def test_shapes_and_range_follow_the_vae_decode_contract(t):
    decoder = tiny_decoder()
    z = latents(t)
    every = decoder.decode(z)
    assert every.shape == (2, 3, 1 + 4 * (t - 1), 32, 48) and every.dtype == torch.float32
    assert decoder.num_frames(t) == every.shape[2]
    last = decoder.decode(z, frames="last")
    assert last.shape == (2, 3, 1, 32, 48)
    assert every.min() >= 0 and every.max() <= 1 and every.std() > 0
    # the last frame alone equals the full decode's last frame (the same convolutions, another batch layout)
    torch.testing.assert_close(last, every[:, :, -1:], atol=1e-6, rtol=0)


def test_decode_is_causal_and_looks_back_one_latent_frame():
    decoder = tiny_decoder()
    z = latents(3)
    base = decoder.decode(z)
    changed_last = z.clone()
    changed_last[:, :, 2] += 1.0
    out = decoder.decode(changed_last)
    torch.testing.assert_close(out[:, :, :5], base[:, :, :5], atol=0, rtol=0)  # frames of latent frames 0 and 1
    assert (out[:, :, 5:] - base[:, :, 5:]).abs().amax(dim=(0, 1, 3, 4)).min() > 0  # every frame of latent 2 moves
    changed_first = z.clone()
    changed_first[:, :, 0] += 1.0
    out = decoder.decode(changed_first)
    assert (out[:, :, 1:5] - base[:, :, 1:5]).abs().max() > 0  # latent frame 1 sees latent frame 0 ...
    torch.testing.assert_close(out[:, :, 5:], base[:, :, 5:], atol=0, rtol=0)  # ... latent frame 2 does not


def test_first_latent_frame_gives_the_same_pixels_alone_or_in_a_clip():
    decoder = tiny_decoder()
    z = latents(3)
    torch.testing.assert_close(decoder.decode(z[:, :, :1]), decoder.decode(z)[:, :, :1], atol=1e-6, rtol=0)


def test_channels_last_and_bf16_decode_like_fp32():
    decoder = tiny_decoder()
    z = latents(2)
    reference = decoder.decode(z)
    fast = LightDecoder(TINY)
    fast.load_state_dict(decoder.state_dict())
    fast.use_channels_last()
    torch.testing.assert_close(fast.decode(z), reference, atol=1e-5, rtol=0)
    bf16 = fast.to(torch.bfloat16).decode(z, frames="last")
    assert bf16.dtype == torch.float32 and (bf16 - reference[:, :, -1:]).abs().max() < 0.05


def test_bad_inputs_name_the_field():
    decoder = tiny_decoder()
    with pytest.raises(InputError, match="frames"):
        decoder.decode(latents(2), frames="first")
    with pytest.raises(InputError, match=r"latents: expected a tensor \[B, 16"):
        decoder.decode(torch.zeros(1, 8, 2, 2, 2))
    with pytest.raises(InputError, match="latents"):
        decoder.decode(torch.zeros(1, 16, 2, 2, 2, dtype=torch.long))
    with pytest.raises(InputError, match="LightDecoderConfig.blocks"):
        LightDecoderConfig(channels=(8, 8), blocks=(1,))
    with pytest.raises(InputError, match="LightDecoderConfig.activation"):
        LightDecoderConfig(activation="gelu")


def test_save_and_load_round_trip_exactly(tmp_path):
    decoder = tiny_decoder()
    decoder.save_pretrained(tmp_path / "light")
    config = json.loads((tmp_path / "light" / "config.json").read_text())
    assert config["_class_name"] == "LightDecoder" and config["channels"] == [8, 8, 6, 4]
    loaded = LightDecoder.from_pretrained(tmp_path / "light")
    assert loaded.config == decoder.config
    for (name, a), (_, b) in zip(decoder.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    z = latents(2)
    assert torch.equal(loaded.decode(z), decoder.decode(z))
    with pytest.raises(CheckpointError, match="config.json"):
        LightDecoder.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "light" / "config.json").write_text(json.dumps({**config, "channels": [8, 8, 6, 5]}))
    with pytest.raises(CheckpointError, match="cannot load weights"):
        LightDecoder.from_pretrained(tmp_path / "light")
    (tmp_path / "light" / "config.json").write_text(json.dumps({**config, "_class_name": "Other"}))
    with pytest.raises(CheckpointError, match="_class_name"):
        LightDecoder.from_pretrained(tmp_path / "light")


def test_default_decoder_is_ten_times_cheaper_than_the_pusht_decode_and_small():
    """The design budget of issue 24: the exact PushT decode is ~51 GFLOP per env step (benchmarks/RESULTS.md); the
    default light decoder's last frame (a 16 x 16 latent, 3 latent frames) must cost under a tenth, and weigh under
    5 MB in fp16."""
    from torch.utils.flop_counter import FlopCounterMode

    decoder = LightDecoder().eval()
    z = torch.zeros(1, 16, 3, 16, 16)
    with FlopCounterMode(display=False) as counter:
        out = decoder.decode(z, frames="last")
    assert out.shape == (1, 3, 1, 256, 256)
    last_flops = counter.get_total_flops()
    assert 1e9 < last_flops < 51e9 / 10
    with FlopCounterMode(display=False) as counter:
        decoder.decode(z)
    assert counter.get_total_flops() > 2.5 * last_flops  # "all" runs 3 latent pairs: "last" really skips work
    assert sum(p.numel() for p in decoder.parameters()) * 2 < 5e6


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def random_windows(count: int = 6, t: int = 2, seed: int = 0) -> DecoderWindows:
    """Random latents and frames that are a function of them (the pixels of latent frame i: its first 3 channels
    through a sigmoid, upsampled 16x), so there is something to learn."""
    z = torch.randn(count, 16, t, 2, 2, generator=torch.Generator().manual_seed(seed))
    images = torch.sigmoid(2 * z[:, :3]).repeat_interleave(16, dim=-1).repeat_interleave(16, dim=-2)
    frames = torch.cat([images[:, :, :1], images[:, :, 1:].repeat_interleave(4, dim=2)], dim=2)
    return DecoderWindows(z, (frames * 255).round().to(torch.uint8))


def test_training_steps_lower_the_loss_and_are_seeded(tmp_path):
    windows = random_windows()
    # no contrast weighting: these frames have no background for it to find
    config = LightDecoderTrainConfig(decoder=TINY, steps=120, batch_size=6, lr=3e-3, warmup_steps=5, log_every=40,
                                     contrast_weight=0.0, gradient_weight=0.1, device="cpu", progress=False)
    target = windows.frames.float() / 255

    def loss_of(decoder):
        with torch.no_grad():
            return float(light_decoder_loss(decoder, windows.latents, target, config)[0])

    torch.manual_seed(config.seed)
    before = loss_of(LightDecoder(TINY))
    trained = train_light_decoder(windows, tmp_path / "a", config)
    assert loss_of(trained) < 0.7 * before
    log = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log] == [40, 80, 120]
    assert json.loads((tmp_path / "a" / "train_config.json").read_text())["steps"] == 120
    again = train_light_decoder(windows, None, config)
    for a, b in zip(trained.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)  # same seed, same weights
    assert torch.equal(LightDecoder.from_pretrained(tmp_path / "a").conv_in.weight, trained.conv_in.weight)


def test_latent_noise_perturbs_training_and_stays_seeded():
    windows = random_windows()
    settings = dict(decoder=TINY, steps=3, batch_size=2, device="cpu", progress=False)
    plain = train_light_decoder(windows, None, LightDecoderTrainConfig(**settings))
    noisy = [train_light_decoder(windows, None, LightDecoderTrainConfig(**settings, latent_noise=0.5)) for _ in "ab"]
    assert torch.equal(noisy[0].conv_in.weight, noisy[1].conv_in.weight)
    assert not torch.equal(plain.conv_in.weight, noisy[0].conv_in.weight)


def test_time_budget_stops_training(tmp_path):
    config = LightDecoderTrainConfig(decoder=TINY, steps=10_000, seconds=0.5, batch_size=2, device="cpu",
                                     progress=False)
    train_light_decoder(random_windows(), tmp_path, config)
    steps = json.loads((tmp_path / "train_config.json").read_text())["steps"]
    assert 1 <= steps < 10_000
    with pytest.raises(InputError, match="LightDecoderTrainConfig.seconds"):
        LightDecoderTrainConfig(seconds=0).validate()


def test_windows_are_the_world_models_encoded_windows_and_their_frames(tmp_path, tiny_checkpoint):
    dataset = make_dataset(tmp_path / "data", num_episodes=2, steps=8, size=32)
    vae = Cosmos3VAE.from_pretrained(tiny_checkpoint / "vae")
    windows = build_decoder_windows(dataset, vae, chunk=4, stride=4, progress=False)
    assert len(windows) == 4 and windows.latents.shape == (4, 16, 2, 2, 2) and windows.frames.shape == (4, 3, 5, 32, 32)
    episode = np.load(dataset / "episodes" / "episode_000001.npz")["frames"]  # [9, 32, 32, 3]
    clip = episode[4:9]
    assert np.array_equal(windows.frames[3].permute(1, 2, 3, 0).numpy(), clip)  # exactly the real frames
    cond = processor.prepare_conditioning(clip, 256, 5)  # as Cosmos3Engine.prepare: the tier canvas, then the crop
    assert cond.canvas_hw == (256, 256) and cond.latent_hw == (2, 2)
    torch.testing.assert_close(windows.latents[3:4], vae.encode(cond.pixels)[..., :2, :2], atol=1e-5, rtol=1e-5)
    psnr = decoder_psnr(tiny_decoder(), windows, vae)
    assert set(psnr) == {"light_vs_real", "vae_vs_real", "light_vs_vae"} and psnr["light_vs_real"].shape == (4,)
    with pytest.raises(InputError, match="chunk"):
        build_decoder_windows(dataset, vae, chunk=3, progress=False)


# ---------------------------------------------------------------------------------------------------------------
# The engine and env option
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def light_assets(tmp_path_factory, tiny_checkpoint) -> Path:
    root = build_tiny_pusht_assets(tmp_path_factory.mktemp("pusht_light"), tiny_checkpoint)
    tiny_decoder(seed=1).save_pretrained(root / "checkpoint" / LIGHT_DECODER_DIR)
    return root


def test_engine_decodes_with_the_light_decoder_when_asked(light_assets):
    engine = Cosmos3Engine.from_pretrained(light_assets / "checkpoint", decoder="light", progress=False)
    assert engine.decoder == "light" and isinstance(engine.light_decoder, LightDecoder)
    frame = np.random.default_rng(0).integers(0, 256, (FRAME, FRAME, 3), dtype=np.uint8)
    request = Cosmos3Request(mode="forward_dynamics", observation=frame, task="push", domain="pusht",
                             raw_action_dim=2, chunk=4, num_inference_steps=2, guidance_scale=1.0, seed=3,
                             action=np.zeros((4, 2), np.float32), resolution_tier=256)
    every = engine.step(request, decode="all")
    last = engine.step(request, decode="last")
    light = engine.light_decoder.decode(every.video_latents[None])[0].cpu()
    # the light decoder made these pixels, not the VAE (exact on a CPU; a GPU may pick other kernels per batch)
    torch.testing.assert_close(every.pixels.cpu(), light, atol=1e-5, rtol=0)
    exact = engine.vae.decode(every.video_latents[None].to(engine.device))[0].cpu()  # results come back on the host
    assert not torch.allclose(every.pixels.cpu(), exact, atol=1e-2)
    torch.testing.assert_close(last.pixels.cpu(), every.pixels[:, -1:].cpu(), atol=1e-5, rtol=0)
    engine.offload()
    assert engine.light_decoder.device.type == "cpu"
    engine.onload()
    engine.close()
    default = Cosmos3Engine.from_pretrained(light_assets / "checkpoint", progress=False)
    assert default.decoder == "vae" and default.light_decoder is None  # opt-in only
    default.close()


def test_pusht_env_and_vector_env_take_the_option(light_assets):
    env = gym.make("cosmos3_gym/PushT-v0", assets_dir=light_assets, decoder="light")
    try:
        assert env.unwrapped.engine.decoder == "light"
        assert env.unwrapped._core.owns_engine  # the fast path's engine, with the light decoder
        observation, _ = env.reset(seed=0)
        observation, reward, *_ = env.step(env.action_space.sample())
        assert observation["image"].shape == (FRAME, FRAME, 3) and 0.0 <= reward <= 1.0
    finally:
        env.close()
    envs = gym.make_vec("cosmos3_gym/PushT-v0", num_envs=2, assets_dir=light_assets, decoder="light",
                        return_frames=True, optimize=False)
    try:
        assert envs.unwrapped.engine.decoder == "light"
        envs.reset(seed=0)
        _, _, _, _, infos = envs.step(envs.action_space.sample())
        assert infos["frames"].shape == (2, 4, FRAME, FRAME, 3)  # every frame of the chunk ("all")
    finally:
        envs.close()
    env = gym.make("cosmos3_gym/WorldModel-v0", checkpoint=light_assets / "checkpoint", decoder="light",
                   initial_states=light_assets / "checkpoint" / "initial_states.npz", success_threshold=None)
    try:
        assert env.unwrapped.engine.decoder == "light"
    finally:
        env.close()


def test_decoder_option_errors_name_the_field(tiny_assets_without_light, stub_engine_client, tiny_checkpoint):
    with pytest.raises(InputError, match="decoder: 'light' needs a light decoder"):
        gym.make("cosmos3_gym/PushT-v0", assets_dir=tiny_assets_without_light, decoder="light")
    with pytest.raises(InputError, match=r"decoder: expected one of \['vae', 'light'\]"):
        gym.make("cosmos3_gym/PushT-v0", assets_dir=tiny_assets_without_light, decoder="exact")
    with pytest.raises(InputError, match="decoder: 'light' needs"):
        launcher.load_engine(tiny_checkpoint, dp=2, decoder="light")  # before any worker starts
    with pytest.raises(InputError, match="decoder: 'light' decodes in one process"):
        launcher.load_engine(tiny_checkpoint, cfg_parallel=2, decoder="light")
    assert stub_engine_client == []
    assert launcher.load_engine(tiny_checkpoint, dp=2) == "client"
    assert stub_engine_client[0][2]["decoder"] == "vae"  # the workers' from_pretrained gets it


def test_a_light_decoder_for_another_latent_space_is_refused(tmp_path, tiny_checkpoint):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, checkpoint)
    LightDecoder(LightDecoderConfig(latent_channels=8, channels=(4, 4, 4, 4), blocks=(0, 0, 0, 0))).save_pretrained(
        checkpoint / LIGHT_DECODER_DIR)
    with pytest.raises(CheckpointError, match="latent_channels 8 does not match the VAE's 16"):
        Cosmos3Engine.from_pretrained(checkpoint, decoder="light", progress=False)


@pytest.fixture(scope="module")
def tiny_assets_without_light(tmp_path_factory, tiny_checkpoint) -> Path:
    return build_tiny_pusht_assets(tmp_path_factory.mktemp("pusht_plain"), tiny_checkpoint)


# ---------------------------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------------------------


def import_benchmark(name: str, folder: str = "benchmarks"):
    import importlib
    import sys

    path = str(Path(__file__).resolve().parents[1] / folder)
    sys.path.insert(0, path)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(path)


def test_throughput_benchmark_measures_the_light_path_beside_the_exact_one(tmp_path, light_assets):
    """``--decoder light --light-decoder DIR``: DIR installed into a copy of assets that have none, and a third path
    measured in the same run (tiny model on a CPU: the plumbing, not the speed)."""
    benchmark = import_benchmark("pusht_env_throughput_gpu")
    plain = tmp_path / "plain"
    shutil.copytree(light_assets, plain)
    shutil.rmtree(plain / "checkpoint" / LIGHT_DECODER_DIR)
    tiny_decoder(seed=2).save_pretrained(tmp_path / "trained")
    results = benchmark.main(["--device", "cpu", "--envs", "1", "--steps", "1", "--warmup", "0",
                              "--fidelity-episodes", "0", "--decoder", "light", "--light-decoder",
                              str(tmp_path / "trained"), "--assets", str(plain), "--out", str(tmp_path / "out")])
    entry = results["envs_1"]
    assert {"baseline", "exact", "light", "light_speedup_over_exact", "light_obs_psnr_db"} <= set(entry)
    installed = Path(results["settings"]["assets"]) / "checkpoint" / LIGHT_DECODER_DIR
    assert torch.equal(LightDecoder.from_pretrained(installed).conv_in.weight, tiny_decoder(seed=2).conv_in.weight)


def test_soak_benchmark_runs_the_decoder_it_is_told_and_records_the_one_it_ran(tmp_path, light_assets):
    """``soak_pusht.py --decoder vae`` once ran the checkpoint's light decoder (only "light" was passed on) and
    recorded "vae"; unnamed, it runs the checkpoint's own."""
    benchmark = import_benchmark("soak_pusht")
    assets = tmp_path / "assets"
    shutil.copytree(light_assets, assets)
    meta = json.loads((assets / "checkpoint" / "meta.json").read_text())
    (assets / "checkpoint" / "meta.json").write_text(json.dumps({**meta, "decoder": "light"}))
    common = ["--device", "cpu", "--envs", "2", "--steps", "4", "--every", "2", "--from-step", "2",
              "--assets", str(assets), "--out", str(tmp_path / "out")]
    for named, used in ((["--decoder", "vae"], "vae"), ([], "light"), (["--decoder", "light"], "light")):
        results = benchmark.main([*common, *named, "--name", f"soak_{used}_{len(named)}.json"])
        assert results["settings"]["decoder_used"] == used and results["samples"][-1]["env_steps"] == 4


@pytest.mark.sim
def test_recipe_smoke_run(tmp_path):
    pytest.importorskip("gym_pusht")
    recipe = import_benchmark("train_light_decoder", "benchmarks/recipes")
    results = recipe.main(["--smoke", "--out", str(tmp_path), "--workers", "1", "--work", str(tmp_path / "work")])
    assert results["windows"]["train"] > 0 and results["training"]["steps"] >= 1
    on_gpu = {"light_bf16_vs_real"} if torch.cuda.is_available() else set()  # as decoder="light" runs it there
    assert set(results["psnr_db"]["last_frame"]) == {"light_vs_real", "vae_vs_real", "light_vs_vae", *on_gpu}
    # the world model's own chunks: latents and the exact decode of them, which the training set gains
    assert results["windows"]["generated_train"] == 3 and results["windows"]["generated_heldout"] == 2
    assert set(results["psnr_db"]["generated"]) == {"light_vs_vae_last_frame", "light_vs_vae_all_frames"}
    generated = safetensors.torch.load_file(str(next((tmp_path / "work").glob("generated_train_*.safetensors"))))
    assert list(generated["frames"].shape) == [3, *results["windows"]["frame_shape"]]
    assert list(generated["latents"].shape) == [3, *results["windows"]["latent_shape"]]
    assert results["speed"]["gflop_per_last_frame"]["ratio"] > 10
    assert set(results["speed"]["batches"]) == {"1", "2"}
    LightDecoder.from_pretrained(tmp_path / "light_decoder")  # installable as <checkpoint>/light_decoder
    weights = safetensors.torch.load_file(str(tmp_path / "light_decoder" / "model.safetensors"))
    assert {tensor.dtype for tensor in weights.values()} == {torch.float16}  # --save-dtype's default
    # Split over two calls: the second reuses the first's datasets and encoded windows (the same windows again).
    first = recipe.main(["--smoke", "--out", str(tmp_path / "a"), "--workers", "1", "--work", str(tmp_path / "work2"),
                         "--stop-after", "encode"])
    assert set(first["stages"]) == {"simulate", "encode"} and "training" not in first
    cached = safetensors.torch.load_file(str(tmp_path / "work2" / "windows_train_stride8.safetensors"))
    assert cached["frames"].dtype == torch.uint8 and len(cached["latents"]) == first["windows"]["train"]
    second = recipe.main(["--smoke", "--out", str(tmp_path / "b"), "--workers", "1", "--work", str(tmp_path / "work2")])
    assert {key: second["windows"][key] for key in first["windows"]} == first["windows"]
    assert second["training"]["steps"] >= 1
    assert second["stages"]["simulate"] < first["stages"]["simulate"]  # reused, not simulated again
    third = recipe.main(["--smoke", "--out", str(tmp_path / "c"), "--workers", "1", "--work", str(tmp_path / "work2")])
    assert third["stages"]["generate"] < second["stages"]["generate"]  # the generated windows are reused too
    shutil.rmtree(tmp_path / "work")
    shutil.rmtree(tmp_path / "work2")


def test_builtin_pusht_model_ships_a_trained_light_decoder():
    """The built-in model's light decoder is trained for its latent space: its first observation is close to the
    exact VAE decode of the same step (an untrained decoder gives ~10 dB, session 11's 34.7 dB; the shipped v2 41 dB
    on a 2-core CPU)."""
    observations = {}
    for decoder in ("vae", "light"):
        env = gym.make("cosmos3_gym/PushT-v0", decoder=decoder)
        try:
            env.reset(seed=3)
            action = np.linspace(-0.5, 0.5, np.prod(env.action_space.shape), dtype=np.float32)
            observation, *_ = env.step(action.reshape(env.action_space.shape))
            observations[decoder] = observation["image"].astype(np.float64) / 255.0
        finally:
            env.close()
    mse = float(np.mean((observations["light"] - observations["vae"]) ** 2))
    assert 10 * np.log10(1.0 / mse) > 37.0
