#!/usr/bin/env bash
# The wheels a machine without network needs to run the template (and scripts/gpu_check.sh) on
# its own torch: requirements.txt but torch and torchvision, for that machine's Python, into
# DEST; there, `pip install --no-index --no-deps --target` puts them in a folder for PYTHONPATH
# (docs/gpus.md). Run it where pip reaches an index.
#
#   scripts/gpu_wheels.sh DEST [PYTHON_VERSION] [HAVE]
#
# PYTHON_VERSION: the machine's, e.g. 3.12 (default: this Python's); compiled wheels (pydantic,
# SQLAlchemy, greenlet) are built for one version. HAVE: a file of the packages the machine
# holds already (`python3 -m pip list --format=freeze` there, or one name a line); their wheels
# are left out, since a folder on PYTHONPATH would shadow the machine's own (its numpy, ...).
# pytest-xdist and execnet stay in: pyproject.toml's addopts need xdist 3.8 or later.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:?usage: scripts/gpu_wheels.sh DEST [PYTHON_VERSION] [HAVE]}
version=${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
have=${3:-}
mkdir -p "$dest"
wanted=$(mktemp)
trap 'rm -f "$wanted"' EXIT
{
  grep -v '^torch' requirements.txt
  grep '^pytest-xdist' requirements-dev.txt
} >"$wanted"
# hydra-core's parser runtime is published as a source archive only; it is pure Python, so a
# wheel built here serves any Python 3.
python3 -m pip wheel -q --no-deps -w "$dest" 'antlr4-python3-runtime==4.9.*'
python3 -m pip download -q --only-binary=:all: --python-version "$version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --find-links "$dest" -d "$dest" -r "$wanted"
if [ -n "$have" ]; then
  # Names as wheels spell them: lower case, runs of - _ . as one _.
  normalise() { tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }
  held=$(sed -E 's/[ =<>;].*//' "$have" | normalise | grep -vx 'pytest_xdist\|execnet' || true)
  for wheel in "$dest"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | normalise)
    if grep -qx "$name" <<<"$held"; then rm "$wheel"; fi
  done
fi
echo "$(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest"
