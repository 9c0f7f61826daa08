#!/usr/bin/env bash
# CUDA checks for a machine with GPUs (NCCL meshes): the tests that matter plus the seed example.
# Budget: under 8 minutes. Uses as many ranks as there are GPUs (at most 4, NCCL needs one GPU per rank);
# on a single GPU every multi-rank test runs on a 1-rank mesh (THUNDER_DTENSOR_TEST_ANY_WORLD_SIZE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
PY=.venv/bin/python
ngpu=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -lt 1 ]; then echo "gpu_check: no CUDA device"; exit 1; fi
nproc=$(( ngpu >= 4 ? 4 : (ngpu >= 2 ? 2 : 1) ))
[ "$nproc" -eq 1 ] && export THUNDER_DTENSOR_TEST_ANY_WORLD_SIZE=1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
run="timeout 420 .venv/bin/torchrun --nproc-per-node $nproc --local-ranks-filter 0"
$run -m pytest -q -p no:cacheprovider tests/distributed/test_seed.py tests/distributed/test_backward.py \
  tests/distributed/test_retrace.py tests/distributed/test_executor.py tests/distributed/test_scalars_and_plain_tensors.py \
  tests/distributed/test_fsdp.py
timeout 60 .venv/bin/torchrun --nproc-per-node "$nproc" --local-ranks-filter 0 examples/seed.py | tail -3
