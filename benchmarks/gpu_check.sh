#!/usr/bin/env bash
# The prepared GPU check (issue 7): kernel correctness on the GPU (RoPE and the plugin's fused AOT
# kernel included), the AOT PTX compile, then the decode benchmark.
# Run on a machine with a CUDA GPU, torch and triton:  bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py -k "not decoder_generates"
python -m pytest -q -p no:cacheprovider tests/export/test_trt_plugin.py -k "aot"
python benchmarks/attention_gpu.py
