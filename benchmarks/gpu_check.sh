#!/usr/bin/env bash
# The prepared GPU check: kernel correctness on the GPU (RoPE and the plugin's fused AOT kernel included), the
# AOT PTX compile, the TensorRT backend's stream ordering (torch streams only; issue 17 item 9), engine builds where
# TensorRT is installed (they skip with the reason elsewhere), then the decode benchmark.
# Run on a machine with a CUDA GPU, torch and triton:  bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py -k "not decoder_generates"
python -m pytest -q -p no:cacheprovider tests/tensorrt/test_plugin.py -k "aot"
python -m pytest -q -p no:cacheprovider tests/tensorrt/test_backend.py
# with TensorRT installed (JetPack, or NVIDIA's wheels): build -> parity, the int4 DequantizeLinear form included
python -m pytest -q -p no:cacheprovider -rs tests/tensorrt/test_trt_engine.py
python benchmarks/attention_gpu.py
