#!/usr/bin/env bash
# One device call (fits the 10-minute limit): the GPU tests of the layer the dispatch table runs
# on the H200 (wgmma layout through TABLE.prepare and fused_moe; the trainable layer's backward),
# then the benchmark table for Mixtral and Qwen3-30B-A3B, every log under $OUT.
# From the repository root on the GPU machine:
#     OUT=/some/dir bash benchmarks/device_session.sh
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
export HYPOTHESIS_PROFILE=dev
OUT=${OUT:-/tmp/wna16_out}
mkdir -p "$OUT"
timeout 230 python3 -m pytest -v -m gpu tests/test_pallas_engine.py -n 4 -p no:cacheprovider --tb=short -rfE \
    -k "wgmma_gpu_shapes or gpu_prefill" > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
timeout 330 python3 benchmarks/moe_engine.py --rows mixtral qwen3 --reps 10 --skip "engine GPTQ,engine←Marlin" \
    --append "$OUT/RESULTS_engine.md" --json "$OUT/results.json" > "$OUT/bench.log" 2>&1
echo "bench rc $?" >> "$OUT/bench.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
grep -E "^\| [MQ]|rc " "$OUT/bench.log" | tail -12
