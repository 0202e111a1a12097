"""Data-parallel GRPO (issue 44 item 3): ranks with envs of their own, groups kept whole on one rank, gradients
all-reduced over the whole minibatch. Two gloo ranks on the CPU stand in for one world-model engine per GPU."""

from __future__ import annotations

import json

import numpy as np
import torch
from dist_utils import run_distributed
from test_rl_grpo import SMALL, ReachRight

from cosmos3_gym.rl.grpo import GRPOConfig, GRPOTrainer, Rollout
from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig
from cosmos3_gym.storage import load_safetensors

CHUNKS = (6, 10)  # chunks on rank 0 and rank 1: ranks whose episodes ended early have fewer


def _policy(seed: int = 0) -> PixelGaussianPolicy:
    torch.manual_seed(seed)
    return PixelGaussianPolicy(PolicyConfig(chunk=2, **SMALL))


def _rollout(rank: int, policy: PixelGaussianPolicy) -> Rollout:
    """A fixed rollout of ``CHUNKS[rank]`` chunks: random images, sampled actions, their log-probabilities."""
    generator = torch.Generator().manual_seed(100 + rank)
    count = CHUNKS[rank]
    images = torch.randint(0, 256, (count, 32, 32, 3), generator=generator, dtype=torch.uint8)
    with torch.no_grad():
        distribution = policy.distribution(policy.preprocess(images))
        actions = distribution.mean + distribution.stddev * torch.randn(distribution.mean.shape, generator=generator)
        log_probs = distribution.log_prob(actions).sum(-1)
    return Rollout(images=images, actions=actions, log_probs=log_probs, reference_log_probs=log_probs.clone(),
                   advantages=torch.randn(count, generator=generator), stats={})


def _concatenated(policy: PixelGaussianPolicy) -> Rollout:
    parts = [_rollout(rank, policy) for rank in range(2)]
    return Rollout(*(torch.cat([getattr(p, name) for p in parts]) for name in
                     ("images", "actions", "log_probs", "reference_log_probs", "advantages")), stats={})


def _config(**overrides) -> GRPOConfig:
    return GRPOConfig(**{**dict(group_size=4, horizon=1, learning_rate=3e-3, update_epochs=2, minibatch_size=16,
                                kl_coef=0.1), **overrides})


def _update_on_rank(minibatch_size: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    rank = dist.get_rank()
    policy = _policy(seed=rank)  # the ranks start apart: the trainer takes rank 0's weights
    trainer = GRPOTrainer(policy, ReachRight(8), _config(minibatch_size=minibatch_size))
    trainer.update(_rollout(rank, _policy(seed=0)))
    return {name: value.clone() for name, value in trainer.policy.state_dict().items()}


def test_a_data_parallel_step_is_the_step_of_one_process_on_all_chunks():
    """One minibatch a step on each rank (6 and 10 chunks): the same weights as one process updating on the 16 chunks
    in one minibatch (the same epochs, the same clipping and Adam steps)."""
    ranks = run_distributed(_update_on_rank, 2, 16)
    single = GRPOTrainer(_policy(seed=0), ReachRight(8), _config(minibatch_size=32))
    single.update(_concatenated(_policy(seed=0)))
    for name, value in single.policy.state_dict().items():
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    assert any(not torch.equal(value, _policy(seed=0).state_dict()[name]) for name, value in ranks[0].items())


def test_ranks_with_unequal_steps_finish_together_with_equal_weights():
    """Minibatches of 4: rank 0 has 2 steps an epoch, rank 1 three; rank 0 joins the third with no chunks."""
    ranks = run_distributed(_update_on_rank, 2, 4)
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name


def _train_on_rank(path: str) -> dict:
    import torch.distributed as dist

    def trainer() -> GRPOTrainer:
        return GRPOTrainer(_policy(), ReachRight(8), _config(iterations=3, horizon=1))

    straight = trainer()
    straight.train(progress=False)
    first = trainer()
    first.train(iterations=2, progress=False, checkpoint_path=path)
    resumed = GRPOTrainer.load(path, ReachRight(8), reference=first.reference)
    resumed.train(progress=False)
    return {
        "rank": dist.get_rank(),
        "history": straight.history,
        "resumed_history": resumed.history,
        "weights": {name: value.clone() for name, value in straight.policy.state_dict().items()},
        "resumed_weights": {name: value.clone() for name, value in resumed.policy.state_dict().items()},
        "starts": [options["initial_state_index"].tolist() for options in straight.env.reset_options],
    }


def test_data_parallel_training_combines_the_ranks_and_resumes_exactly(tmp_path):
    zero, one = run_distributed(_train_on_rank, 2, str(tmp_path / "grpo.safetensors"))
    for name, value in zero["weights"].items():
        assert torch.equal(value, one["weights"][name]) and torch.equal(value, zero["resumed_weights"][name]), name
        assert torch.equal(value, one["resumed_weights"][name]), name
    # the logged rates and counts are over both ranks' episodes
    assert [r["env_steps"] for r in zero["history"]] == [16] * 3
    assert [r["success_rate"] for r in zero["history"]] == [r["success_rate"] for r in one["history"]]
    assert [r["mean_return"] for r in zero["resumed_history"]] == [r["mean_return"] for r in zero["history"]]
    # each rank draws starts of its own; groups of 4 share one start on their rank
    assert zero["starts"] != one["starts"]
    for starts in zero["starts"] + one["starts"]:
        assert len(set(starts[:4])) == 1 and len(set(starts[4:])) == 1
    # rank 0 plays what a single process with the same seed plays
    single = GRPOTrainer(_policy(), ReachRight(8), _config(iterations=1, horizon=1))
    single.train(progress=False)
    assert single.env.reset_options[0]["initial_state_index"].tolist() == zero["starts"][0]


def _train_for_a_while() -> int:
    """Rank 1 sleeps 0.3 s after each iteration: it reaches each budget check 0.3 s after rank 0, so left to
    themselves the two would decide at different iterations (and one would wait forever in the next collective)."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    trainer = GRPOTrainer(_policy(), ReachRight(8), _config(iterations=50, horizon=1))
    trainer.train(max_seconds=1.0, progress=False, on_iteration=lambda record: time.sleep(0.3) if rank else None)
    return trainer.iteration


def test_a_time_budget_stops_every_rank_at_the_same_iteration():
    zero, one = run_distributed(_train_for_a_while, 2)
    assert zero == one and 1 <= zero < 50


def _train_with_a_guard_on_rank_zero(path: str) -> list[bool]:
    import torch.distributed as dist

    def guard(indices, chunks, lengths):
        return {"success": chunks[:, 0, 0, 0] > 0.3, "final_coverage": np.zeros(len(indices))}

    trainer = GRPOTrainer(_policy(), ReachRight(8), _config(iterations=2, horizon=1, guard_every=2),
                          guard=guard if dist.get_rank() == 0 else None)
    trainer.train(checkpoint_path=path, progress=False)
    return [bool(r.get("guard")) for r in trainer.history]


def test_a_background_guard_on_rank_zero_alone_ends_with_every_rank_saving(tmp_path):
    # The last replay joins after the loop and the checkpoint is written again: save is collective, so the ranks
    # without a guard must take part (left out, rank 0 waited forever in its gather).
    zero, one = run_distributed(_train_with_a_guard_on_rank_zero, 2, str(tmp_path / "grpo.safetensors"), timeout=120)
    assert zero == [True, False] and one == [False, False]
    _, metadata = load_safetensors(tmp_path / "grpo.safetensors", what="grpo checkpoint")
    assert [bool(r.get("guard")) for r in json.loads(metadata["history"])] == [True, False]


def _benchmark_on_rank(out: str) -> dict | None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import grpo_data_parallel_gpu

    return grpo_data_parallel_gpu.main(["--tiny", "--envs-per-rank", "4", "--group-size", "2", "--horizon", "2",
                                        "--iterations", "3", "--skip", "1", "--out", out])


def test_the_benchmark_runs_one_engine_per_rank(tmp_path):
    """benchmarks/grpo_data_parallel_gpu.py --tiny under two gloo ranks: rank 0 writes the run, over both ranks."""
    zero, one = run_distributed(_benchmark_on_rank, 2, str(tmp_path), timeout=300)
    assert one is None and zero["world_size"] == 2
    assert (tmp_path / "grpo_data_parallel_world2_tiny.json").is_file()
    assert [r["env_steps"] for r in zero["history"]] == [2 * 4 * 2] * 3  # 2 ranks x 4 envs x horizon 2
    steady = zero["steady"]
    assert steady["iterations"] == 2 and steady["loop_env_steps_per_s"] < steady["env_only_env_steps_per_s"]
