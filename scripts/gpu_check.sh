#!/usr/bin/env bash
# CUDA checks for a machine with GPUs: context parallelism (ring attention on CUDA kernels, torch's context_parallel
# under eager / thunder.jit / thunderfx), then the tests that matter on NCCL meshes. Budget: under 7 minutes.
# Uses as many ranks as there are GPUs (at most 4, NCCL needs one GPU per rank); on a single GPU the NCCL runs use a
# 1-rank mesh (THUNDER_DTENSOR_TEST_ANY_WORLD_SIZE=1) and the ring also runs at 2 ranks over gloo on that one GPU.
# Where the machine has no package index (the lent H200: its own python3 with torch), wheels carried in .whl/
# (lightning-thunder and what it needs beyond that image) are installed to /tmp/site and the checkout is used as is.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && [ ! -x .venv/bin/python ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
  PY=python3
  TORCHRUN="python3 -m torch.distributed.run"
else
  make setup >/dev/null || exit 1
  PY=.venv/bin/python
  TORCHRUN=.venv/bin/torchrun
fi
export PYTHONUNBUFFERED=1
ngpu=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -lt 1 ]; then echo "gpu_check: no CUDA device"; exit 1; fi
nproc=$(( ngpu >= 4 ? 4 : (ngpu >= 2 ? 2 : 1) ))
[ "$nproc" -eq 1 ] && export THUNDER_DTENSOR_TEST_ANY_WORLD_SIZE=1
$PY -c "import torch, thunder; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'thunder', thunder.__version__)"
status=0
run() { timeout "$1" $TORCHRUN --nproc-per-node "$2" --local-ranks-filter 0 "${@:3}" || status=1; }
run 150 "$nproc" scripts/gpu_cp_check.py --backend nccl
if [ "$nproc" -eq 1 ]; then  # several ranks on one GPU: gloo's collectives on CUDA tensors, where it has them
  timeout 150 $TORCHRUN --nproc-per-node 2 --local-ranks-filter 0 scripts/gpu_cp_check.py --backend gloo \
    || echo "gpu_check: (2 ranks over gloo on one GPU: informative only)"
fi
run 240 "$nproc" -m pytest -q -p no:cacheprovider -x tests/distributed/test_backward.py tests/distributed/test_retrace.py \
  tests/distributed/test_seed.py
exit $status
