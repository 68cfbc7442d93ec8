#!/usr/bin/env bash
# One device call (fits the 10-minute limit): the wgmma engine's GPU tests, its ptxas report and
# the kernel-vs-kernel timings, every log under $OUT. From the repository root on the GPU machine:
#     OUT=/some/dir bash benchmarks/device_session.sh
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
export HYPOTHESIS_PROFILE=dev
OUT=${OUT:-/tmp/wna16_out}
mkdir -p "$OUT"
timeout 270 python3 -m pytest -q -m gpu tests/test_pallas_engine.py -k wgmma -n 4 -p no:cacheprovider \
    --tb=short -rfE > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
timeout 75 python3 benchmarks/ptxas_report.py > "$OUT/ptxas.log" 2>&1
echo "ptxas rc $?" >> "$OUT/ptxas.log"
timeout 200 python3 benchmarks/gemm_kernels.py --gemms mixtral1 qwen3_2 --block-m 8 16 128 \
    --append "$OUT/RESULTS_gemm.md" > "$OUT/gemm.log" 2>&1
echo "gemm rc $?" >> "$OUT/gemm.log"
tail -3 "$OUT/tests.log"; grep -E "registers|spill|FAILED" "$OUT/ptxas.log" | head -20; grep -E "^\| [mq]" "$OUT/gemm.log" | tail -60
