"""Simulating PushT training episodes (``cosmos3_gym.tasks.pusht.episodes.generate_pusht_dataset``): episodes/s of this
tree against a baseline tree (an older commit), in one run, and whether both wrote the same data.

    python benchmarks/simulate_pusht.py                                    # CPU: 8 episodes x 128 steps, 1 worker
    python benchmarks/simulate_pusht.py --episodes 256 --workers 16 --out $OUT   # a 16-core machine

Each tree runs in its own process (``PYTHONPATH`` puts that tree's ``cosmos3_gym`` first) whose main module imports
torch and the engine at the top, as ``benchmarks/recipes/train_pusht.py`` does: spawned workers re-import the main
module, so that cost is part of what the recipe pays. The time is the median over ``--repeats`` runs (the trees
alternate) of the wall time of the whole ``generate_pusht_dataset`` call (worker start-up, simulation, policy
inference, writing the episodes). The default policy mix is issue 18's round-5 mix (scripted, random, replay,
uniform and the three policy files acting on rendered frames) with the shipped checkpoint's action statistics.

``--baseline`` is a git revision (its ``cosmos3_gym`` is extracted with ``git archive``) or a folder holding an older
``cosmos3_gym``; ``--baseline none`` times this tree alone. ``identical`` in the results compares every array of
every episode (sha256 of name, dtype, shape and bytes) and meta.json / stats.json between the two trees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

POLICIES = "benchmarks/results/rl/policies"
ISSUE_18_MIX = ("scripted=0.4,random=0.1,replay=0.1,uniform=0.1,"
                f"file:{POLICIES}/rl_pusht_bc.safetensors=0.1,"
                f"file:{POLICIES}/rl_pusht_grpo_simulator.safetensors=0.1,"
                f"file:{POLICIES}/rl_pusht_grpo_world_model.safetensors=0.1")
ACTION_STATS = "cosmos3_gym/tasks/pusht/assets/checkpoint/action_stats.json"
BASELINE = "7954013"  # the last commit before the simulator speed-ups
CHILD = "COSMOS3_GYM_SIMULATE_CHILD"  # set in a timed tree's process, and so in its simulator workers

if os.environ.get(CHILD):
    # Like the recipe's main module: torch and the engine at the top; spawned simulator workers re-import it.
    import torch  # noqa: F401

    from cosmos3_gym.engine import Cosmos3Engine  # noqa: F401


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for item in text.split(","):
        name, _, share = item.rpartition("=")
        mix[name] = float(share)
    return mix


def dataset_digest(out: Path) -> dict:
    """sha256 of every array of every episode, and of meta.json and stats.json."""
    import numpy as np

    episodes = {}
    for path in sorted((out / "episodes").iterdir()):
        digest = hashlib.sha256()
        with np.load(path) as episode:
            for name in sorted(episode.files):
                array = episode[name]
                digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
                digest.update(np.ascontiguousarray(array).tobytes())
        episodes[path.name] = digest.hexdigest()
    files = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in ("meta.json", "stats.json")}
    return {"episodes": episodes, "files": files}


def child(settings: dict) -> None:
    """Time one ``generate_pusht_dataset`` call of the tree on ``PYTHONPATH``; print a JSON line."""
    import cosmos3_gym
    from cosmos3_gym.tasks.pusht import episodes as pusht

    out = Path(settings["data"])
    start = time.perf_counter()
    pusht.generate_pusht_dataset(out, settings["episodes"], steps_per_episode=settings["steps"],
                                 image_size=(settings["image_size"],) * 2, seed=settings["seed"],
                                 workers=settings["workers"], policy_mix=parse_mix(settings["policy_mix"]),
                                 action_stats=ACTION_STATS, progress=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "package": str(Path(cosmos3_gym.__file__).parent),
                      "digest": dataset_digest(out)}))


def extract_baseline(baseline: str, into: Path) -> Path | None:
    if baseline == "none":
        return None
    if Path(baseline).is_dir():
        return Path(baseline).resolve()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", baseline, "cosmos3_gym"], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"--baseline {baseline}: git archive failed ({archive.stderr.decode().strip()}); give a "
                         f"folder holding the old cosmos3_gym, or --baseline none.")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_tree(tree: Path, settings: dict, scratch: Path, label: str) -> dict:
    path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, **{CHILD: "1"}, PYTHONPATH=path)
    settings = dict(settings, data=str(scratch / f"data_{label}"))
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(settings)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{label} run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["package"]) != tree / "cosmos3_gym":
        raise SystemExit(f"{label} run imported {result['package']}, not {tree / 'cosmos3_gym'}")
    shutil.rmtree(settings["data"], ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    import numpy as np
    from common import add_output_arguments, provenance, write_results

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=128, help="actions per episode")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=1, help="simulator processes (0 or 1: in the process)")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--policy-mix", default=ISSUE_18_MIX, help="name=share,... (default: issue 18's mix)")
    parser.add_argument("--baseline", default=BASELINE, help="git revision, folder with cosmos3_gym, or none")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each tree (median reported)")
    parser.add_argument("--name", default=None, help="results file name (default simulate_pusht_cpu{N}w.json)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)

    settings = {"episodes": args.episodes, "steps": args.steps, "image_size": args.image_size,
                "workers": args.workers, "seed": args.seed, "policy_mix": args.policy_mix}
    results = {"settings": {**settings, "cpu_count": os.cpu_count(), "baseline": args.baseline}}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        (scratch / "baseline").mkdir()
        baseline_tree = extract_baseline(args.baseline, scratch / "baseline")
        trees = {"current": ROOT} if baseline_tree is None else {"baseline": baseline_tree, "current": ROOT}
        runs, times = {}, {label: [] for label in trees}
        for _ in range(args.repeats):  # alternating, so a slow spell of a shared machine hits both
            for label, tree in trees.items():
                runs[label] = run_tree(tree, settings, scratch, label)
                times[label].append(runs[label]["seconds"])
                print(f"{label}: {times[label][-1]:.2f} s, {args.episodes / times[label][-1]:.2f} episodes/s",
                      flush=True)
    for label, seconds in times.items():
        median = float(np.median(seconds))
        results[label] = {"seconds": round(median, 3), "episodes_per_s": round(args.episodes / median, 3),
                          "all_seconds": [round(t, 3) for t in seconds]}
    if "baseline" in runs:
        results["speedup"] = round(results["baseline"]["seconds"] / results["current"]["seconds"], 3)
        results["identical"] = runs["baseline"]["digest"] == runs["current"]["digest"]
        print(f"speedup {results['speedup']}x, identical data: {results['identical']}")
    results["digest"] = runs["current"]["digest"]["files"]
    results["provenance"] = provenance()
    name = args.name or f"simulate_pusht_cpu{args.workers}w.json"
    write_results(results, name, args.out, args.overwrite, args=args)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
