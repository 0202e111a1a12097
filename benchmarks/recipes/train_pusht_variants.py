"""Train several PushT world-model variants at once on one GPU, on one shared simulated dataset, and keep the best.

    python benchmarks/recipes/train_pusht_variants.py --out $OUT --deadline-s 560 \
        --variant plain= --variant deep8=--grow-depth=8 -- <train_pusht.py arguments shared by all>

The tiny PushT model leaves an H200 mostly idle (about 3 GB and a fraction of its compute per run), so variants
share it. The first variant simulates the episodes and encodes their latents (in its speed probe); the others start
once its probe has logged and reuse both (``train_pusht.py --data``). Each variant gets what is left of
``--deadline-s`` when it starts. When all have finished, the one with the best mean rollout PSNR over the evaluated
chunks is kept: its checkpoint (without the VAE, which fine-tunes do not change) and reward model, as a tar split in
parts of at most ``PART_BYTES`` (what a device call can hand back), and all variants' results in
``train_pusht_variants.json``. Install the kept model with ``cat best_assets.tar.part* | tar -x -C
cosmos3_gym/assets/pusht``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent)]

from common import add_output_arguments, provenance, write_results  # noqa: E402

PART_BYTES = 15 * 2**20
KEPT = ("checkpoint/transformer", "checkpoint/meta.json", "checkpoint/model_index.json", "checkpoint/reward_model")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--variant", action="append", required=True,
                        help="NAME=ARGS: a variant's own train_pusht.py arguments (comma-free, '=' joined, e.g. "
                             "deep8=--grow-depth=8 or lr3=--wm-lr=3e-4,--wm-cond-noise=0.3)")
    parser.add_argument("--deadline-s", type=float, default=560.0, help="all variants done by then")
    parser.add_argument("--work", default="/tmp/pusht_variants", help="data and each variant's work folder")
    parser.add_argument("--threads", type=int, default=None, help="OMP threads per variant (default: cores / n)")
    args, shared = parser.parse_known_args(argv)
    variants = {}
    for item in args.variant:
        name, _, extra = item.partition("=")
        variants[name] = [token for token in extra.split(",") if token]
    args.variants = variants
    args.shared = [token for token in shared if token != "--"]
    return args


def launch(args, name: str, extra: list[str], started: float) -> subprocess.Popen:
    work = Path(args.work)
    out = work / "out" / name
    deadline = args.deadline_s - (time.perf_counter() - started)
    command = [sys.executable, str(RECIPES / "train_pusht.py"), "--part", "second", "--data", str(work / "data"),
               "--work", str(work / name), "--out", str(out), "--deadline-s", f"{deadline:.0f}", "--overwrite",
               *args.shared, *extra]
    threads = args.threads or max(1, (os.cpu_count() or 1) // len(args.variants))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    print(f"[{name}] {' '.join(command)}", flush=True)
    with open(work / f"{name}.log", "w") as log:  # the child keeps its own copy of the file descriptor
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def summary(args, name: str, returncode: int) -> dict:
    out = Path(args.work) / "out" / name
    result = {"args": args.variants[name], "returncode": returncode}
    path = out / "train_pusht_second.json"
    if path.is_file():
        stages = json.loads(path.read_text())["stages"]
        result["stages"] = stages
        psnr = stages.get("evaluate", {}).get("psnr_rollout_db")
        result["mean_rollout_psnr_db"] = sum(psnr) / len(psnr) if psnr else None
    return result


def pack(assets: Path, work: Path, out: Path) -> list[str]:
    archive = work / "best_assets.tar"
    with tarfile.open(archive, "w") as tar:
        for item in KEPT:
            tar.add(assets / item, arcname=item)
    data, parts = archive.read_bytes(), []
    for index in range(0, len(data), PART_BYTES):
        part = out / f"best_assets.tar.part{index // PART_BYTES:02d}"
        part.write_bytes(data[index : index + PART_BYTES])
        parts.append(part.name)
    return parts


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    names = list(args.variants)
    processes = {names[0]: launch(args, names[0], args.variants[names[0]], started)}
    probe_log = work / names[0] / "world_model_probe" / "training" / "log.jsonl"
    while len(names) > 1 and not probe_log.is_file() and processes[names[0]].poll() is None:
        time.sleep(5)
    print(f"data ready at {time.perf_counter() - started:.0f} s", flush=True)
    for name in names[1:]:
        processes[name] = launch(args, name, args.variants[name], started)
    results = {name: summary(args, name, process.wait()) for name, process in processes.items()}
    scored = {name: r["mean_rollout_psnr_db"] for name, r in results.items() if r.get("mean_rollout_psnr_db")}
    best = max(scored, key=scored.get) if scored else None
    report = {"provenance": provenance(), "variants": results, "best": best,
              "seconds": round(time.perf_counter() - started, 1)}
    if best is not None:
        report["parts"] = pack(work / best / "assets" / "pusht", work, out)
        video = work / "out" / best / "side_by_side.mp4"
        if video.is_file():
            shutil.copyfile(video, out / "side_by_side.mp4")
    for name in names:  # the logs' last lines say how far a failed variant got
        lines = (work / f"{name}.log").read_text(errors="replace").replace("\r", "\n").splitlines()
        results[name]["log_tail"] = [line for line in lines if line.strip()][-15:]
    write_results(report, "train_pusht_variants.json", str(out), args.overwrite)
    return report


if __name__ == "__main__":
    main()
