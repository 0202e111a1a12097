"""FSDP2 training (cosmos3_gym.training.fsdp) on CPU with gloo, 2 ranks: a sharded step equals the single-process
step on the union of the ranks' batches, the trainer's sharded state resumes exactly, and the export is a diffusers
checkpoint."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import load_file
from test_training import CHUNK, FPS, TINY_VAE, make_dataset, read_log, world_model_config

from cosmos3_gym import storage
from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG
from cosmos3_gym.training import VAETrainConfig, train_vae
from cosmos3_gym.training.distributed import init_distributed
from cosmos3_gym.training.flow_matching import FlowMatchingBatch, FlowMatchingObjective
from cosmos3_gym.training.fsdp import apply_fsdp, full_tensor
from cosmos3_gym.training.world_model import (
    WorldModelTrainConfig,
    WorldModelTrainer,
    build_optimizer,
    enable_gradient_checkpointing,
    set_trainable,
    training_step,
)


def _batch(rows: slice) -> FlowMatchingBatch:
    """4 samples (rows of it per rank); each half has one policy and one forward-dynamics sample, so each rank's
    loss normalises by the same counts and the mean over ranks is the loss of the whole batch."""
    generator = torch.Generator().manual_seed(1)
    batch = FlowMatchingBatch(
        prompt_ids=[list(range(1, 12)), list(range(1, 6))] * 2, fps=[FPS] * 4,
        video=torch.randn(4, 16, 2, 4, 4, generator=generator), actions=torch.rand(4, CHUNK, 64, generator=generator),
        raw_action_dims=torch.full((4,), 2), domain_ids=torch.full((4,), 4), modes=torch.tensor([0, 1, 1, 0]),
        sigmas=torch.tensor([0.9, 0.4, 0.6, 0.2]), video_noise=torch.randn(4, 16, 2, 4, 4, generator=generator),
        action_noise=torch.randn(4, CHUNK, 64, generator=generator),
    )
    return FlowMatchingBatch(**{k: (v[rows] if isinstance(v, (torch.Tensor, list)) else v)
                                for k, v in vars(batch).items()})


def _sharded_vs_single(checkpointing: bool, device: str = "cpu", bf16: bool = False, cpu_offload: bool = False):
    """Two steps of AdamW on the whole batch in one process and on each rank's half under FSDP; ``bf16``: the
    sharded model computes in bf16 (MixedPrecisionPolicy, CUDA only) under autocast; ``cpu_offload``: the sharded
    states live on the host (CPUOffloadPolicy)."""
    rank = torch.distributed.get_rank()
    device = torch.device(device, rank) if device == "cuda" else torch.device(device)
    cfg = Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG, "vocab_size": 64})
    config = WorldModelTrainConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0)
    torch.manual_seed(0)
    reference = Cosmos3Transformer(cfg).to(device)
    set_trainable(reference, freeze_text_tower=False)
    sharded = copy.deepcopy(reference)
    initial = {n: p.detach().cpu().clone() for n, p in reference.named_parameters()}
    if checkpointing:
        enable_gradient_checkpointing(sharded)
    objective = apply_fsdp(FlowMatchingObjective(sharded), device=device, bf16=bf16, cpu_offload=cpu_offload)
    results = {}
    for name, model, wrapper, rows in (("single", reference, FlowMatchingObjective(reference), slice(0, 4)),
                                       ("fsdp", sharded, objective, slice(2 * rank, 2 * rank + 2))):
        optimizer = build_optimizer(model, config)
        params = [p for p in model.parameters() if p.requires_grad]
        norms = []
        for _ in range(2):
            for group in optimizer.param_groups:
                group["lr"] = config.lr
            _, grad_norm = training_step(wrapper, _batch(rows).to(device), optimizer, params, 1.0,
                                         autocast=bf16 and model is sharded)
            norms.append(float(grad_norm))
        results[name] = ({n: full_tensor(p.detach()).cpu() for n, p in model.named_parameters()}, norms)
    sharded_params = [p for p in sharded.parameters()]
    local_share = sum(p.to_local().numel() for p in sharded_params) / sum(p.numel() for p in sharded_params)
    return results, local_share, initial


@pytest.mark.parametrize("checkpointing, cpu_offload", [(False, False), (True, False), (True, True)])
def test_fsdp_step_equals_the_single_process_step(checkpointing, cpu_offload):
    for results, local_share, initial in run_distributed(_sharded_vs_single, 2, checkpointing, "cpu", False,
                                                         cpu_offload, timeout=60):
        assert 0.4 < local_share < 0.6  # each rank holds about half of every tensor
        (single, single_norms), (fsdp, fsdp_norms) = results["single"], results["fsdp"]
        assert fsdp_norms == pytest.approx(single_norms, rel=1e-4)
        # AdamW moves every weight by about lr = 1e-2 per step whatever its gradient's size, so the summation-order
        # noise of tiny gradient entries shows up to ~1e-5; a wrong shard or reduction would be off by ~1e-2.
        for name, value in single.items():
            torch.testing.assert_close(fsdp[name], value, rtol=0, atol=1e-4, msg=name)
        assert sum(not torch.equal(initial[n], v) for n, v in single.items()) > len(single) // 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fsdp_on_two_gpus_with_nccl():
    """fp32: the sharded step equals the single-GPU step; bf16 compute / fp32 reduce: the gradient norms stay within
    bf16 rounding of the fp32 ones."""
    [(fp32, _, _), _] = run_distributed(_sharded_vs_single, 2, True, "cuda", False, backend="nccl", timeout=120)
    assert fp32["fsdp"][1] == pytest.approx(fp32["single"][1], rel=1e-3)
    for name, value in fp32["single"][0].items():
        torch.testing.assert_close(fp32["fsdp"][0][name], value, rtol=0, atol=1e-4, msg=name)
    [(mixed, _, _), _] = run_distributed(_sharded_vs_single, 2, True, "cuda", True, backend="nccl", timeout=120)
    assert mixed["fsdp"][1] == pytest.approx(mixed["single"][1], rel=5e-2)


def _train(dataset, vae_dir, out, cache_dir, steps, resume):
    config = world_model_config(Path(cache_dir).parent, steps=steps, batch_size=2, warmup_steps=4, ema_decay=0.5,
                                data_parallel="fsdp", gradient_checkpointing=True, resume=resume, save_every=1)
    config.cache_dir = str(cache_dir)
    ctx = init_distributed("cpu")
    trainer = WorldModelTrainer(dataset, out, config, vae_dir, ctx)
    trainer.train()
    trainer.export()
    return trainer.step


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    work = tmp_path_factory.mktemp("fsdp")
    dataset = make_dataset(work / "dataset", num_episodes=2)
    vae_dir = train_vae(dataset, work / "vae", VAETrainConfig(**TINY_VAE, steps=1, batch_size=1, stats_clips=2,
                                                              progress=False, device="cpu"))
    return work, dataset, vae_dir


def test_fsdp_trainer_resumes_exactly_and_exports_a_diffusers_checkpoint(data):
    work, dataset, vae_dir = data
    cache = work / "latent_cache"
    assert run_distributed(_train, 2, dataset, vae_dir, work / "straight", cache, 3, False, timeout=60) == [3, 3]
    run_distributed(_train, 2, dataset, vae_dir, work / "resumed", cache, 2, False, timeout=60)
    assert run_distributed(_train, 2, dataset, vae_dir, work / "resumed", cache, 3, True, timeout=60) == [3, 3]

    snapshot = work / "resumed" / "training" / "state" / "step-000000003"  # cosmos3_gym.storage's snapshots
    state = json.loads((snapshot / "state.json").read_text())
    assert state["step"] == 3 and state["format"] == "torch.distributed.checkpoint"
    assert sorted(p.suffix for p in snapshot.iterdir()).count(".distcp") == 2
    storage.verify_manifest(snapshot)  # every rank's shards are in the manifest rank 0 wrote
    assert [step for step, _ in storage.snapshots(snapshot.parent)] == [3, 2]
    straight, resumed = (load_file(next((work / run / "transformer").glob("*.safetensors")))
                         for run in ("straight", "resumed"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    losses = [r["loss"] for r in read_log(work / "straight" / "training" / "log.jsonl")]
    assert losses == [r["loss"] for r in read_log(work / "resumed" / "training" / "log.jsonl")]
    assert len(losses) == 3
    meta = json.loads((work / "straight" / "meta.json").read_text())
    assert meta["train_steps"] == 3 and meta["weights"] == "ema"
    Cosmos3Engine.from_pretrained(work / "straight", device="cpu", progress=False).close()
