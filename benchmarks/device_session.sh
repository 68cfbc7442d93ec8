#!/usr/bin/env bash
# One device call (fits the 10-minute limit): the GPU tests of the layer the dispatch table runs
# on the H200 (wgmma layout through TABLE.prepare and fused_moe, every 4-bit format it takes, the
# three model shapes; the trainable layer's backward), then the open question of the v5 notes —
# zfold and wide at 16/32-row blocks (Qwen3 512 tokens) — every log under $OUT.
# From the repository root on the GPU machine:
#     OUT=/some/dir bash benchmarks/device_session.sh
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
export HYPOTHESIS_PROFILE=dev
OUT=${OUT:-/tmp/wna16_out}
mkdir -p "$OUT"
timeout 330 python3 -m pytest -v -m gpu tests/test_pallas_engine.py -n 4 -p no:cacheprovider --tb=short -rfE \
    -k "wgmma_gpu_shapes or gpu_prefill" > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
timeout 200 python3 benchmarks/moe_engine.py --sweep --rows qwen3:64,512 mixtral:64 --reps 10 \
    --variants "wgmma=kernel:wgmma;no zfold=kernel:wgmma,zfold:0;no wide=kernel:wgmma,wide:0;bm16=kernel:wgmma,block_m:16;bm16 no zfold=kernel:wgmma,block_m:16,zfold:0" \
    > "$OUT/sweep.log" 2>&1
echo "sweep rc $?" >> "$OUT/sweep.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
grep -E "^##|µs|FAIL|rc " "$OUT/sweep.log"
