"""Beyond one process group: ``RayEngineReplicas`` on a local Ray cluster of CPU actors (skipped when Ray is not
installed), and torchrun's c10d rendezvous (the multi-node launcher) with one node.

Two replicas, each a single-process engine on the tiny checkpoint in fp32. Each replica batches only its own chunk
of the requests, which changes summation order only, so results agree with one in-process engine to 1e-5 relative.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from reference import relative_error

from cosmos3_gym.cli import main
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.executors.ray_replicas import split_contiguous

try:
    import ray

    from cosmos3_gym.executors.ray_replicas import RayEngineReplicas
except ImportError:
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason='Ray is not installed (pip install "cosmos3_gym[ray]")')

BASE = dict(domain="pusht", chunk=4, num_inference_steps=2, fps=15.0, resolution_tier=256, guidance_scale=2.0)
ENGINE_KWARGS = dict(device="cpu", dtype="fp32", progress=False)
# The cluster has 2 CPUs, both held by the module's replicas; a further actor must not reserve one, or Ray would
# wait for a free CPU forever.
NO_CPU = {"num_cpus": 0}


def image(seed: int, size=(200, 280)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def requests(n: int) -> list[Cosmos3Request]:
    return [Cosmos3Request("policy", image(i), f"task {i % 2}", seed=i, **BASE) for i in range(n)]


@pytest.fixture(scope="module")
def cluster():
    assert ray is not None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def replicas(cluster, tiny_checkpoint):
    replicas = RayEngineReplicas(tiny_checkpoint, 2, replica_resources={"num_cpus": 1}, **ENGINE_KWARGS)
    yield replicas
    replicas.close()


def test_split_contiguous():
    assert split_contiguous(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split_contiguous(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_contiguous([0], 3) == [[0], [], []]


@needs_ray
def test_step_splits_requests_and_keeps_their_order(replicas, tiny_checkpoint):
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, **ENGINE_KWARGS)
    expected = engine.step(requests(5), decode=False)
    results = replicas.step(requests(5), decode=False)
    assert [r.seed for r in results] == [r.seed for r in expected] == list(range(5))
    for result, reference in zip(results, expected):
        assert relative_error(result.action, reference.action) < 1e-5
        assert relative_error(result.video_latents, reference.video_latents) < 1e-5
    single = replicas.step(requests(1)[0], decode=False)
    assert relative_error(single.action, expected[0].action) < 1e-5
    assert len(replicas.step(requests(1), decode=False)) == 1  # fewer requests than replicas


@needs_ray
def test_input_errors_come_back_unchanged(replicas, tiny_checkpoint, tmp_path):
    bad = Cosmos3Request("policy", image(0), "push", **{**BASE, "num_inference_steps": 0})
    with pytest.raises(InputError, match=r"^num_inference_steps: expected an integer >= 1, got 0$"):
        replicas.step([*requests(2), bad])
    assert len(replicas.step(requests(2), decode=False)) == 2
    with pytest.raises(CheckpointError, match="missing"):
        RayEngineReplicas(tmp_path / "missing", 1, replica_resources=NO_CPU, **ENGINE_KWARGS)


@needs_ray
def test_vector_env_slots_spread_over_ray_replicas(replicas, tiny_checkpoint):
    """A vector env whose engine is the replica pool: one step sends half of the slots to each replica and gives
    the same frames as the in-process engine."""
    from cosmos3_gym.envs import WorldModelVectorEnv

    frames = [np.asarray(image(i, (96, 128))) for i in range(4)]
    kwargs = dict(domain="pusht", task="push", chunk=4, num_steps=2, guidance_scale=2.0, resolution_tier=256,
                  initial_states=frames)
    observations = []
    for engine in (replicas, Cosmos3Engine.from_pretrained(tiny_checkpoint, **ENGINE_KWARGS)):
        env = WorldModelVectorEnv(4, engine=engine, **kwargs)
        env.reset(seed=0, options={"initial_state_index": [0, 1, 2, 3]})
        obs, *_ = env.step(np.full((4, 4, 2), 0.25, dtype=np.float32))
        observations.append(obs["image"].astype(int))
        env.close()
    assert replicas.action_dim == 64 and replicas.temporal_compression == 4
    assert np.abs(observations[0] - observations[1]).max() <= 1


@needs_ray
def test_close_is_idempotent(replicas):
    replicas.close()
    replicas.close()
    with pytest.raises(RuntimeError, match="closed"):
        replicas.step(requests(1))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_c10d_rendezvous_on_one_node(tiny_checkpoint, tmp_path):
    """The multi-node launch of the ray_replicas docstring with --nnodes=1: two cfg ranks rendezvous through c10d
    and give the single-process actions."""
    image(3).save(tmp_path / "obs.png")
    args = ["infer", "--checkpoint", str(tiny_checkpoint), "--image", str(tmp_path / "obs.png"), "--prompt", "push",
            "--domain-name", "pusht", "--chunk", "4", "--num-steps", "2", "--resolution-tier", "256", "--seed", "3",
            "--guidance-scale", "2.5", "--no-decode"]
    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "cosmos3_gym.cli", *args,
               "--cfg-parallel", "2", "--out", str(tmp_path / "parallel")]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    single = json.loads((tmp_path / "single_action.json").read_text())
    parallel = json.loads((tmp_path / "parallel_action.json").read_text())
    assert parallel["shape"] == single["shape"] == [4, 2]
    assert relative_error(parallel["data"], single["data"]) < 1e-5


def test_ray_before_2_52_is_refused_and_the_extras_require_2_52():
    """Issue 43: ``ray>=2.40`` admitted versions with the unauthenticated job-submission remote-code-execution bug."""
    from cosmos3_gym.executors.ray_replicas import check_ray_version

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    for old in ("2.40.0", "2.51.2", "1.13.1"):
        with pytest.raises(InputError, match=f"ray: version {old} .*ray>=2.52"):
            check_ray_version(old)
    for new in ("2.52.0", "2.60.0", "3.0.0rc1", "2.52.0.dev0"):
        check_ray_version(new)
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "ray>=2.52" in extras["ray"] and "ray>=2.52" in extras["dev"]
