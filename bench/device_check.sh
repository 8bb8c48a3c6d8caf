#!/usr/bin/env bash
# One lease of a CUDA machine (the workplace's device tool): the GPU path's tests, then its bench.
# Runs under the image's python3 (torch, triton, transformers there); the few packages the engine
# imports that the image lacks travel as wheels in .whl (bench/README.md says how to fetch them).
# Writes its logs to $OUT (or /tmp/device-check).
set -uo pipefail
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/protoserve
export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export PROTOSERVE_CPU_KERNELS=0  # the CPU kernels are not what this lease is for
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The repo's top conftest starts servers (gRPC deps); each folder's own conftest is enough here.
# KERNEL_TESTS narrows the Triton kernels' tests (a file or a -k expression's worth of paths).
for targets in "${KERNEL_TESTS:-tests/kernels_triton}" tests/models/test_device_path.py; do
  folder=$(dirname "${targets%% *}"); [ -d "$targets" ] && folder=$targets
  timeout 240 python3 -m pytest -q -p no:cacheprovider --confcutdir="$folder" -o addopts="" $targets \
    2>&1 | tee "$OUT/pytest-$(basename "$folder").log" | tail -6
done
timeout 330 python3 -m bench.device_report --device cuda --random-weights --json-out "$OUT/bench.json" ${BENCH_ARGS:-} \
  2>&1 | grep -v "Loading weights" | tee "$OUT/bench.log" | tail -20
