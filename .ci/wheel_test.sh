#!/usr/bin/env bash
# Build the wheel and sdist, install the wheel into a fresh venv outside the repository and run the demo there: the
# built-in model and every asset must be inside the wheel (nothing may read the source tree).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m build --wheel --sdist --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
ls -l "$work/dist"
size=$(stat -c %s "$work"/dist/*.whl)
[ "$size" -lt 100000000 ] || { echo "wheel is $size bytes: over the package index's 100 MB limit"; exit 1; }
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/pip" install -q torch==2.13.0
echo "torch==2.13.0" > "$work/pin.txt"
"$work/venv/bin/pip" install -q -c "$work/pin.txt" "$work"/dist/*.whl
cd "$work"
"$work/venv/bin/python" -c "import cosmos3_gym, pathlib; p = pathlib.Path(cosmos3_gym.__file__); assert 'site-packages' in str(p), p"
"$work/venv/bin/cosmos3-gym" demo --out "$work/demo"
test -s "$work/demo/report.json"
echo "wheel test passed: $(ls "$work"/dist)"
