#!/usr/bin/env bash
# One device call (fits the 10-minute limit): the wgmma kernel's GPU tests (incl. shift32 and
# zfold, not yet GPU-run), the copy-ring probe, kernel-vs-kernel timings at decode and a layer
# sweep, every log under $OUT. From the repository root on the GPU machine:
#     OUT=/some/dir bash benchmarks/device_session.sh
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
export HYPOTHESIS_PROFILE=dev
OUT=${OUT:-/tmp/wna16_out}
mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -m gpu tests/test_pallas_engine.py -n 4 -p no:cacheprovider --tb=short -rfE \
    -k "wgmma_grouped_gemm_gpu or (wgmma_gpu_shapes and awq)" > "$OUT/tests.log" 2>&1
echo "tests rc $?" >> "$OUT/tests.log"
timeout 70 python3 benchmarks/stream_ceiling.py --gemms mixtral1 --stages 4 > "$OUT/stream.log" 2>&1
echo "stream rc $?" >> "$OUT/stream.log"
timeout 130 python3 benchmarks/gemm_kernels.py --gemms mixtral1 qwen3_2 --block-m 8 16 --reps 10 \
    --only "i16 bn128 st4 s1" "st2 kpb2 wide s1" shift32 zfold "triton mma" --append "$OUT/RESULTS_gemm.md" \
    > "$OUT/gemm.log" 2>&1
echo "gemm rc $?" >> "$OUT/gemm.log"
timeout 180 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16,64 qwen3:1,16,64 --reps 10 \
    --variants "engine=;wgmma=kernel:wgmma;wgmma wide=kernel:wgmma,wide:1;wgmma shift32=kernel:wgmma,shift32:1;wgmma zfold=kernel:wgmma,shift32:1,zfold:1;wgmma wide zfold=kernel:wgmma,wide:1,shift32:1,zfold:1" \
    > "$OUT/sweep.log" 2>&1
echo "sweep rc $?" >> "$OUT/sweep.log"
tail -3 "$OUT/tests.log"; grep -E "^\||FAIL" "$OUT/stream.log"; grep -E "^\| [mq]|FAIL|WRONG" "$OUT/gemm.log" | tail -60
grep -E "^##|µs|FAIL" "$OUT/sweep.log"
