#!/usr/bin/env bash
# The wheels a GPU machine of this workplace lacks (its image has torch, transformers, numpy, opencv, ... but not
# diffusers, gymnasium, SB3 or gym-pusht), for Python 3.12 on x86-64, into .whl/ (ignored by git), then stripped of
# what no recipe imports: pygame's docs, examples and tests, and diffusers' pipelines other than Cosmos (16 MB instead
# of 25, so that the built-in model, the policy files a command reads and the wheels fit the 64 MiB tree limit).
# Run once in the repository's root; every device call then names .whl in carry and starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
# A command that resolves a reward model or task by name through the package's entry points (rl_pusht.py's
# grpo_wm: "pusht_geometric") also needs the tree's own metadata, which a bare checkout on PYTHONPATH lacks:
#   python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/pkg . &&
#     export PYTHONPATH=/tmp/site:/tmp/pkg
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for wheel in diffusers==0.42.1 gymnasium==1.4.0 farama-notifications==0.0.4 stable-baselines3==2.9.2 gym-pusht==0.1.8 \
             pymunk==6.11.1 pygame==2.6.1 shapely==2.2.0 cffi pycparser websockets==17.4 msgpack==1.2.4; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$wheel"
done
python3 - <<'EOF'
import os
import zipfile
from pathlib import Path

KEEP_PIPELINES = {"__init__.py", "pipeline_utils.py", "pipeline_loading_utils.py", "auto_pipeline.py", "cosmos",
                  "onnx_utils.py", "free_init_utils.py", "free_noise_utils.py", "transformers_loading_utils.py"}


def unused(name: str) -> bool:
    if name.startswith(("pygame/docs/", "pygame/examples/", "pygame/tests/")):
        return True
    if name.startswith("diffusers/pipelines/"):
        return name[len("diffusers/pipelines/"):].split("/")[0] not in KEEP_PIPELINES
    return False


for wheel in sorted(Path(".whl").glob("*.whl")):
    with zipfile.ZipFile(wheel) as source:
        members = source.infolist()
        if not any(unused(m.filename) for m in members):
            continue
        stripped = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as target:
            for member in members:
                if not unused(member.filename):
                    target.writestr(member, source.read(member.filename))
    os.replace(stripped, wheel)
    print(f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB")
EOF
du -sh .whl
