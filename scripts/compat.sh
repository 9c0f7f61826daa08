#!/usr/bin/env bash
# torch / thunder compatibility check (`make compat TORCH=2.14.1`, `make compat TORCH=2.13.0
# THUNDER=0.2.7.dev20260201`): a venv with that torch (and that lightning-thunder, else the declared one), then the
# unit tests, the seed and TP examples under thunder.jit and thunderfx, and a distributed subset at 2 ranks. torch
# builds other than the local 2.13.0 are CUDA wheels of 5-7 GB: the venv is deleted afterwards unless KEEP=1.
#   usage: [THUNDER=VERSION] scripts/compat.sh TORCH_VERSION [VENV]
set -euo pipefail
version=${1:?usage: scripts/compat.sh TORCH_VERSION [VENV]}
venv=${2:-/tmp/thunder_dtensor_compat_torch$version}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cleanup() { if [ "${KEEP:-0}" != 1 ]; then rm -rf "$venv"; fi; }
trap cleanup EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==$version"
thunder_spec="lightning-thunder>=0.2.6,<0.2.7"
if [ -n "${THUNDER:-}" ]; then thunder_spec="lightning-thunder==$THUNDER"; fi
"$venv/bin/pip" install -q "$thunder_spec" looseversion pytest expecttest wheel "torch==$version"
"$venv/bin/pip" install -q --no-build-isolation --no-deps -e .
py="$venv/bin/python"
export THUNDER_DTENSOR_UNTESTED_TORCH=1  # the package refuses a torch outside its declared range otherwise
export THUNDER_DTENSOR_UNTESTED_THUNDER=1  # (and a thunder)
export TORCHINDUCTOR_CACHE_DIR="$venv/inductor_cache"  # its precompiled headers are per torch build
run2=("$venv/bin/torchrun" --nproc-per-node 2 --local-ranks-filter 0)
"$py" -c "import torch, thunder_dtensor, thunder; print('torch', torch.__version__, 'thunder', thunder.__version__)"
"$py" -m pytest tests/unit -q -p no:cacheprovider
"${run2[@]}" examples/seed.py > /dev/null
"${run2[@]}" examples/tp_transformer.py
"${run2[@]}" examples/tp_transformer.py --thunderfx
"${run2[@]}" -m pytest -q -p no:cacheprovider \
    tests/distributed/test_tensor_parallel.py tests/distributed/test_thunderfx.py \
    tests/distributed/test_lowering.py tests/distributed/test_fuzz_regressions.py tests/distributed/test_torch_transformer.py
echo "torch $version: compatible"
