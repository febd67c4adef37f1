#!/usr/bin/env bash
# GPU checks for kvgate on one CUDA machine (sized for an H200, well under 8 minutes; with two
# or more GPUs the tensor-parallel section adds up to 5).
# Installs nothing: the machine is offline and must already have torch with CUDA and triton.
#
#   bash bench/gpu_check.sh            # PYTHON=/path/to/python to pick the interpreter
#
# Runs the GPU tests (tests/gpu: every Triton kernel against its PyTorch reference in bfloat16,
# float16 and float32, the fp8 KV cache bit for bit, and the KV host tier: requests preempted by
# swap against no preemption), then the paged decode/prefill attention timings next to PyTorch
# SDPA (kvgate bench kernels gpu), then the engine (kvgate bench engine gpu): tokens/s at 1 and
# 64 concurrent requests against transformers generate_batch, and the batch-1 decode step (CUDA
# graphs and eager) against the bandwidth bound. With two or more GPUs, tensor parallelism last
# (kvgate bench scaling tp): two ranks' greedy tokens against one rank's and their tokens/s;
# with one GPU it says why it is skipped. Results go to .run/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."

# The first interpreter that has torch with CUDA and triton; PYTHON overrides the search.
cuda_ready='import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 3)'
if [[ -n "${PYTHON:-}" ]]; then
    candidates=("$PYTHON")
else
    candidates=(.venv/bin/python python3 python)
fi
PYTHON=""
for candidate in "${candidates[@]}"; do
    command -v "$candidate" >/dev/null || continue
    code=0
    "$candidate" -c "$cuda_ready" 2>/dev/null || code=$?
    if [[ $code == 0 ]]; then
        PYTHON="$candidate"
        break
    elif [[ $code == 3 ]]; then
        echo "gpu_check: $candidate has torch and triton but sees no CUDA device" >&2
    else
        echo "gpu_check: $candidate cannot import torch and triton" >&2
    fi
done
if [[ -z "$PYTHON" ]]; then
    echo "gpu_check: no interpreter with CUDA torch and triton found; set PYTHON" >&2
    exit 2
fi
echo "gpu_check: using $PYTHON"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# The Triton kernels, not the interpreter and not the reference, are what is measured here
# (0, not unset: tests/conftest.py turns the interpreter on where TRITON_INTERPRET is unset).
unset KVGATE_KERNELS
export TRITON_INTERPRET=0

status=0
out=.run/gpu_check
mkdir -p "$out"

# The kernels' and the host tier's correctness on CUDA, the Triton interpreter off.
timeout 420 "$PYTHON" -m pytest -q -ra -p no:cacheprovider tests/gpu || status=$?

# Paged attention timings, then the engine on a random model shaped like Llama-3.2-1B.
timeout 120 "$PYTHON" -m bench.cli kernels gpu --out "$out/gpu_kernels.json" || status=$?
timeout 240 "$PYTHON" -m bench.cli engine gpu --out "$out/gpu_engine.json" || status=$?

# Tensor parallelism: two ranks on two GPUs (NCCL) against one.
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
if (( gpus > 1 )); then
    timeout 300 "$PYTHON" -m bench.cli scaling tp --device cuda --out "$out/tensor_parallel.json" \
        || status=$?
else
    echo "gpu_check: tensor parallelism skipped: $gpus CUDA device, two ranks need two GPUs"
fi

exit "$status"
