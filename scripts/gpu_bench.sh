#!/usr/bin/env bash
# benchmarks/bench.py on one CUDA GPU: world size 1 (torchrun --nproc-per-node 1), NCCL, with each variant's
# peak memory (peak_mem_mb). Budget: under 8 minutes. Results in benchmarks/results-gpu/ (or $1).
# Extra arguments after the folder go to bench.py (e.g. `scripts/gpu_bench.sh /tmp/out --quick`).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results-gpu}"
shift || true
make setup >/dev/null
PY=.venv/bin/python
if [ "$($PY -c 'import torch; print(int(torch.cuda.is_available()))')" != 1 ]; then
  echo "gpu_bench: no CUDA device"; exit 1
fi
$PY -c "import matplotlib" 2>/dev/null || $PY -m pip install -q matplotlib
torch_version=$($PY -c "import torch; print(torch.__version__.split('+')[0])")
# nvFuser builds exist per torch release; install one only where it matches the installed torch
if $PY -c "import nvfuser" 2>/dev/null; then
  echo "gpu_bench: nvfuser already installed"
elif [[ "$torch_version" == 2.10.* ]]; then
  $PY -m pip install -q nvfuser-cu128-torch210 || echo "gpu_bench: nvfuser-cu128-torch210 did not install; running without"
else
  echo "gpu_bench: no nvfuser build for torch $torch_version; thunder runs without nvFuser"
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
# the CUDA runs are faster than 2 CPU ranks: a larger timed budget per size, still well under 8 minutes
timeout 360 .venv/bin/torchrun --nproc-per-node 1 benchmarks/bench.py --out "$out" --time-limit-s 320 "$@"
# FSDP2 (a 1-rank mesh): eager FSDP2, torch.compile, thunderfx, thunder.jit and the limit, with peak memory
timeout 120 .venv/bin/torchrun --nproc-per-node 1 benchmarks/bench.py --out "$out/fsdp" --workloads fsdp \
  --variants eager,torch.compile,thunder_on,thunderfx_on,limit,limit_compiled --time-limit-s 100 "$@"
