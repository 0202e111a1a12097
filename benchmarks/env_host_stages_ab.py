"""Before/after of the PushT env's host stages (``request_prep``, ``env_rest``), interleaved in one run.

    python benchmarks/env_host_stages_ab.py --before 69ec05a --envs 16,64 --rounds 2          # CPU, ~2 min
    python benchmarks/env_host_stages_ab.py --before 7348a19 --envs 16,64 --rounds 3 --steps 3 \
        --name env_host_stages_ab_prepare_batch_cpu.json                                       # issue 24, batched prep

Runs ``profile_pusht_env.py --host-only`` (transformer and VAE stubbed: the host stages alone) on the ``--before``
commit (a ``git archive`` of it, run with this tree's benchmark scripts) and on this tree, alternating
before/after per env count and round, each in its own process, and reports the median per stage. Results JSON via
``benchmarks/common.py`` (card, commit, command).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("profile_pusht_env.py", "profile_gpu.py", "common.py")
STAGES = ("request_prep", "encode", "text", "denoise", "env_rest", "reward")  # the host-side stages (--host-only)


def snapshot(commit: str, where: Path) -> Path:
    """``commit``'s tree in ``where``, with this tree's benchmark scripts (so both sides measure the same way)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    for name in SCRIPTS:
        shutil.copy(ROOT / "benchmarks" / name, where / "benchmarks" / name)
    return where


def run(tree: Path, num_envs: int, args, out: Path) -> dict:
    name = f"run_{tree.name}_{num_envs}.json"
    command = [sys.executable, str(tree / "benchmarks" / "profile_pusht_env.py"), "--host-only", "--device",
               args.device, "--envs", str(num_envs), "--paths", "fast", "--steps", str(args.steps), "--warmup", "1",
               "--threads", str(args.threads), "--out", str(out), "--name", name]
    subprocess.run(command, check=True, cwd=tree, capture_output=True)
    return json.loads((out / name).read_text())[f"fast_envs_{num_envs}"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare with (e.g. main before the change)")
    parser.add_argument("--envs", default="16,64")
    parser.add_argument("--rounds", type=int, default=2, help="before/after pairs per env count")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--name", default=None,
                        help="results file name (default env_host_stages_ab_<device>.json), to keep earlier A/Bs")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    name = args.name or f"env_host_stages_ab_{args.device}.json"
    check_results_target(name, args.out, args.overwrite)  # before measuring
    results = {"provenance": provenance(), "settings": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "before").mkdir()
        trees = {"before": snapshot(args.before, tmp / "before"), "after": ROOT}
        for num_envs in [int(n) for n in args.envs.split(",")]:
            runs = {"before": [], "after": []}
            for _ in range(args.rounds):
                for side, tree in trees.items():
                    runs[side].append(run(tree, num_envs, args, tmp))
            for side, entries in runs.items():
                stages = {k: statistics.median(e["stages_s"][k] for e in entries) for k in STAGES}
                results[f"{side}_envs_{num_envs}"] = {"stages_s": stages, "runs": [e["stages_s"] for e in entries]}
                line = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in stages.items())
                print(f"{side:6s} {num_envs:3d} envs | ms: {line}", flush=True)
    write_results(results, name, args.out, overwrite=args.overwrite)
    return results


if __name__ == "__main__":
    main()
