#!/usr/bin/env bash
# A session's device work, one call per part (each fits the 10-minute limit), every log under
# $OUT. From the repository root on the GPU machine:
#     OUT=/some/dir bash docs/journal/device_session.sh 1     # then ... 2, ...
# Parts 1–4 ran in the seventh session (results-history.md v6), 9–12 in the eighth (v7), 13–15 in the ninth
# (v8), 16–20 in the tenth (v9), 21–26 in the eleventh (v10), 27–31 in the twelfth (v11), 35–39 in the thirteenth (v12), 40–44 in the fourteenth (v13), 44–48 in the fifteenth (v14), 50–55 in the sixteenth (v15), 56–62 in the seventeenth (v16), 65 and 67–70 in the eighteenth (v17: 63 ran inside 67, 64 in parts inside 68 and 70), 76–79 in the nineteenth (v18: a full GPU test run in 76, 78, 79), 84–87 in the twenty-first (v20: 85–87 on the row-gather kernel), 88, 83, 89 and 90 in the twenty-second (v21), 91, 92, 33, 34 and 82 in the twenty-third (v22), 93, 95, 94, 96 and 97 in the twenty-fourth (v23), 99, 100 (its decode rows, without Mixtral 64), 98 and 101 (by hand, in two calls) in the twenty-fifth (v24: block_n=256 was removed after them, so 99 and 100 no longer run), 102, 103, 104 (by hand) and 105 in the twenty-sixth (v25; also a reduced acc2 probe by hand, after which acc2 was removed); 106–109 in the twenty-seventh (v26; half_tiles and unit_wait were removed after 106); 110, 111 and 80–81 in the twenty-eighth (v27, the closing runs); 32, 49, 71, 80 and 81 are prepared (33–34, 81 and 82 ran in the twentieth, v19, and again in the twenty-third) (80–81: the whole GPU suite in two calls; 72–75, a full GPU test run at 4 workers, superseded by 76); 5–8 are still prepared (5: Nsight Compute and the DeepSeek-V2-Lite
# table, 6: the Mixtral / Qwen3 table, 7: its profile half ran as part 10, 8: its sfold timings ran
# as part 13).
# 1: the wgmma GPU tests (kernel cases incl. overlap; the layer the dispatch table runs on the
#    H200 — every 4-bit format it takes, three model shapes, through TABLE.prepare and fused_moe;
#    the trainable layer's backward), the copy-ring probe with the zfold/overlap kernel rows, the
#    decode GEMMs with overlap, 4-stage wide rings and 3/6-stage zfold rings, and where the Qwen3 1-token layer's
#    time goes (per kernel, JAX profiler).
# 2: the prefill GEMMs (128-row blocks) with overlap and with 2 stages (two programs per SM), the
#    same at the 4096-token layers (and 64-row blocks, also two programs per SM),
#    the layer: zfold / wide / overlap at 16- to 64-row blocks (the open Qwen3 512-token
#    question of notes.md v5), and ptxas's report on the overlap kernels (wgmma serialization).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_CAPTURED_CONSTANTS_WARN_BYTES=-1
export HYPOTHESIS_PROFILE=dev
OUT=${OUT:-/tmp/wna16_out}
mkdir -p "$OUT"
part=${1:-1}

logged() {      # logged NAME SECONDS COMMAND...: COMMAND under a time limit into $OUT/NAME.log,
    local log="$OUT/$1.log" name=$1 secs=$2     # then "NAME rc <exit code>" (124: the limit hit)
    shift 2
    timeout "$secs" "$@" > "$log" 2>&1
    echo "$name rc $?" >> "$log"
}

gpu_tests() {   # gpu_tests SECONDS K-EXPRESSION: the Pallas engine's GPU tests into $OUT/tests.log
    logged tests "$1" python3 -m pytest -v -m gpu tests/test_pallas_engine.py -n "${WORKERS:-4}" -p no:cacheprovider \
        --tb=short -rfE -k "$2" ${PYTEST_EXTRA:-}
}
wgmma_table() { # wgmma_table SECONDS ROWS... [OPTIONS]: the layer table's wgmma AWQ / GPTQ columns (the ±10%
    local secs=$1   # target) into $OUT/table_wgmma.log, RESULTS_engine.md, results.json; 5 routings unless
    shift           # OPTIONS give --reps
    logged "table_wgmma" "$secs" python3 benchmarks/moe_engine.py --reps 5 \
        --skip "engine AWQ,engine GPTQ,engine←Marlin,XLA path,ragged_dot bf16,dequant→ragged_dot" \
        --append "$OUT/RESULTS_engine.md" --json "$OUT/results.json" --rows "$@"
}
if [ "$part" = 1 ]; then
    gpu_tests 300 "wgmma or gpu_prefill"
    logged "stream" 70 python3 benchmarks/stream_ceiling.py --gemms mixtral1 --stages 4
    logged "gemm" 130 python3 benchmarks/gemm_kernels.py --gemms mixtral1 qwen3_2 --block-m 8 16 --reps 10 \
        --only "st4 kpb2 wide shift32" "kpb2 wide shift32 zfold" "triton mma" --append "$OUT/RESULTS_gemm.md"
    logged "profile" 70 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:1 --reps 10 \
        --variants "wgmma=kernel:wgmma;engine="
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^\||FAIL|rc " "$OUT/stream.log"
    grep -E "^\| [mq]|FAIL|WRONG|rc " "$OUT/gemm.log" | sort -u
    tail -40 "$OUT/profile.log"
elif [ "$part" = 3 ]; then     # v6: the race-free overlap (halves), stages, zfold ≤ 16 rows
    gpu_tests 260 "wgmma_grouped_gemm_gpu or (gpu_shapes and awq)"
    logged "gemm" 80 python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m 8 64 --reps 10 \
        --only "wide shift32 ovl" "st2 kpb2 wide shift32 zfold" "st4 kpb2 wide shift32 s" \
        --append "$OUT/RESULTS_gemm.md"
    logged "gemm128" 70 python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m 128 --reps 5 \
        --only "bn128 st4 shift32 s" "bn128 st2 shift32 s" "bn128 st4 shift32 ovl" "bn128 st2 shift32 ovl" \
        --append "$OUT/RESULTS_gemm.md"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^\| [mq]|FAIL|WRONG|rc " "$OUT/gemm.log" "$OUT/gemm128.log" | sort -u
elif [ "$part" = 4 ]; then     # v6: the layer with overlap / 2 stages / zfold up to 32 rows
    logged "sweep_prefill" 130 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512,4096 qwen3:4096 --reps 3 \
        --variants "wgmma=kernel:wgmma;ovl=kernel:wgmma,overlap:1;st2 ovl=kernel:wgmma,stages:2,overlap:1"
    logged "sweep" 260 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16,64 qwen3:1,64,512 --reps 10 \
        --variants "wgmma=kernel:wgmma;zf32=kernel:wgmma,zfold:1;ovl=kernel:wgmma,overlap:1;st2=kernel:wgmma,stages:2;st2 ovl=kernel:wgmma,stages:2,overlap:1"
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_prefill.log" "$OUT/sweep.log"
elif [ "$part" = 5 ]; then     # next: the layer table for DeepSeek-V2-Lite on the v6 defaults, and what
    # the decode and prefill kernels wait on (Nsight Compute: speed of light, occupancy, warp stalls)
    logged "table_dsv2" 200 python3 benchmarks/moe_engine.py --rows dsv2lite --reps 10 --skip "engine GPTQ,engine←Marlin" \
        --append "$OUT/RESULTS_engine.md" --json "$OUT/results.json"
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
    for spec in "8|st2 kpb2 wide shift32 zfold s1" "8|st4 kpb2 wide shift32 zfold s1" "128|bn128 st4 shift32 s1"; do
        bm=${spec%%|*}; v=${spec#*|}
        logged "ncu_bm${bm}_${v// /_}" 110 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 1 $S \
            python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m "$bm" --reps 1 --only "$v"
    done
    grep -E "^\|.*DeepSeek|rc " "$OUT/table_dsv2.log"
    grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|Issued Ipc|No Eligible|Warp Cycles Per Issued|rc " "$OUT"/ncu_*.log
elif [ "$part" = 6 ]; then     # next: the layer table for Mixtral and Qwen3 on the v6 defaults
    logged "table" 560 python3 benchmarks/moe_engine.py --rows mixtral qwen3 --reps 10 --skip "engine GPTQ,engine←Marlin" \
        --append "$OUT/RESULTS_engine.md" --json "$OUT/results.json"
    grep -E "^\| (Mix|Qwen)|rc " "$OUT/table.log"
elif [ "$part" = 7 ]; then     # next: where Qwen3's 512/4096-token layers spend their time (8× and 4.4×
    # the floor), and whether Mixtral 64 tokens (16-row blocks: an expert with more than 16 rows
    # is read twice) is faster with 32-row blocks
    logged "profile_qwen3" 200 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:512,4096 --reps 5 \
        --variants "wgmma=kernel:wgmma;engine="
    logged "sweep_bm" 170 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64 qwen3:64 --reps 10 \
        --variants "wgmma=kernel:wgmma;bm32=kernel:wgmma,block_m:32;bm32 zfold=kernel:wgmma,block_m:32,zfold:1;wgmma 2=kernel:wgmma;bm32 2=kernel:wgmma,block_m:32"
    tail -60 "$OUT/profile_qwen3.log"
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_bm.log"
elif [ "$part" = 8 ]; then     # next: sfold (scale-only fold: c − z into the wgmma, no Σx reduction in XLA);
    # its GPU tests run in part 9 (run that first)
    logged "gemm" 90 python3 benchmarks/gemm_kernels.py --gemms mixtral1 qwen3_2 --block-m 8 16 --reps 10 \
        --only "st2 kpb2 wide shift32 zfold s1" "st4 kpb2 wide shift32 zfold s1" "wide shift32 sfold s1" --append "$OUT/RESULTS_gemm.md"
    logged "sweep_sfold" 200 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16 qwen3:1,16 dsv2lite:1 --reps 10 \
        --variants "wgmma=kernel:wgmma;sfold=kernel:wgmma,sfold:1;wgmma 2=kernel:wgmma;sfold 2=kernel:wgmma,sfold:1"
    grep -E "^\| [mq]|FAIL|WRONG|rc " "$OUT/gemm.log" | sort -u
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_sfold.log"
elif [ "$part" = 9 ]; then     # next: the GPU tests of ws and sfold (neither has run on a GPU), then ws timings
    gpu_tests 260 "wgmma_grouped_gemm_gpu or (gpu_shapes and (awq or channel))"
    logged "gemm128" 80 python3 benchmarks/gemm_kernels.py --gemms mixtral1 qwen3_1 --block-m 128 --reps 5 \
        --only "bn128 st4 shift32 s1" "bn128 st4 shift32 ws s1" --append "$OUT/RESULTS_gemm.md"
    logged "gemm" 80 python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m 8 32 --reps 10 \
        --only "st2 kpb2 wide shift32 zfold s1" "st2 kpb2 wide shift32 s1" "wide shift32 ws s1" \
        --append "$OUT/RESULTS_gemm.md"
    logged "sweep_ws" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64,512,4096 qwen3:512,4096 --reps 3 \
        --variants "wgmma=kernel:wgmma;ws=kernel:wgmma,ws:1;ws nofold=kernel:wgmma,ws:1,zfold:0"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^\| [mq]|FAIL|WRONG|rc " "$OUT/gemm128.log" "$OUT/gemm.log" | sort -u
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_ws.log"
elif [ "$part" = 10 ]; then    # v7: the layer tests on the ws default, whether CUDA graphs (XLA command
    # buffers holding the Mosaic GPU calls) close the launch gaps of the 1-token layers, and where
    # Qwen3's 512/4096-token layers spend their time
    gpu_tests 200 "wgmma_gpu_shapes"
    CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
    for mode in "default|loop|" "cmdbuf|loop|$CB" "cmdbuf|unrolled|$CB"; do
        IFS='|' read -r name timing flags <<< "$mode"
        logged "cmdbuf_${name}_${timing}" 60 env XLA_FLAGS="$flags" python3 benchmarks/moe_engine.py --sweep --rows qwen3:1 dsv2lite:1 --reps 20 \
            --timing "$timing" --variants "wgmma=kernel:wgmma"
    done
    logged "profile_qwen3" 150 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:512,4096 --reps 5 \
        --variants "wgmma=kernel:wgmma"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|µs|rror|rc " "$OUT"/cmdbuf_*.log
    tail -45 "$OUT/profile_qwen3.log"
elif [ "$part" = 11 ]; then    # v7: 16-bit GEMM outputs (out16) and [M, N] outputs through a transposed
    # shared-memory store (tout): the GPU tests, the GEMMs, the layer at 64 to 4096 tokens
    gpu_tests 240 "(wgmma_grouped_gemm_gpu and (out16 or tout or ws1)) or (wgmma_gpu_shapes and awq)"
    logged "gemm" 100 python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m 8 32 128 --reps 5 \
        --only "bn128 st4 shift32 ws s1" "ws o16 s1" "ws o16 tout s1" "st2 kpb2 wide shift32 zfold s1" "zfold o16 tout s1" \
        --append "$OUT/RESULTS_gemm.md"
    logged "sweep_out" 180 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64,512,4096 qwen3:512,4096 --reps 3 \
        --variants "f32=kernel:wgmma,out16:0;o16=kernel:wgmma;tout=kernel:wgmma,tout:1"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^\| [mq]|FAIL|WRONG|rc " "$OUT/gemm.log" | sort -u
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_out.log"
elif [ "$part" = 12 ]; then    # v7: the layer tests and the layer on the v7 defaults (ws from 32 rows,
    # 16-bit outputs, tout for 16- to 64-row blocks, 3 stages for 128-row tout)
    gpu_tests 260 "wgmma_gpu_shapes and (awq or actorder)"
    logged "sweep_v7" 130 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64,4096 qwen3:512,4096 --reps 3 \
        --variants "wgmma=kernel:wgmma;f32=kernel:wgmma,out16:0"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_v7.log"
elif [ "$part" = 13 ]; then    # next: the top-k sum as a gather (combine=gather), tout at 128-row blocks
    # (3 stages), and the sfold timings of part 8, after the layer tests that cover them
    gpu_tests 260 "wgmma_gpu_shapes and (awq or channel)"
    logged "sweep_glue" 200 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512,4096 qwen3:512,4096 --reps 3 \
        --variants "wgmma=kernel:wgmma;gather=kernel:wgmma,combine:gather;tout128=kernel:wgmma,tout:1;wgmma 2=kernel:wgmma"
    logged "sweep_sfold" 120 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16 qwen3:1,16 --reps 10 \
        --variants "wgmma=kernel:wgmma;sfold=kernel:wgmma,sfold:1;wgmma 2=kernel:wgmma;sfold 2=kernel:wgmma,sfold:1"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_glue.log" "$OUT/sweep_sfold.log"
elif [ "$part" = 14 ]; then    # v8: the gated epilogue (the activation in GEMM1's epilogue): its GPU
    # tests, then the layer with it on and off, on the v8 defaults (tout also at 128-row blocks)
    gpu_tests 230 "(wgmma_grouped_gemm_gpu and gated) or (wgmma_gpu_shapes and awq)"
    V="wgmma=kernel:wgmma;unfused=kernel:wgmma,fuse_act:0;wgmma 2=kernel:wgmma;unfused 2=kernel:wgmma,fuse_act:0"
    logged "sweep_gated_prefill" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512,4096 qwen3:512,4096 \
        --reps 3 --variants "$V"
    logged "sweep_gated_decode" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16,64 qwen3:1,16,64 \
        --reps 10 --variants "$V"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_gated_prefill.log" "$OUT/sweep_gated_decode.log"
elif [ "$part" = 15 ]; then    # v8: the layer tests on the final v8 defaults (part 14 failed on wide
    # 128-row blocks with tout: fixed), the rows part 14's sweeps did not reach, and the wgmma
    # AWQ and GPTQ columns of the layer table (the ±10% target)
    gpu_tests 280 "wgmma_gpu_shapes"
    logged "sweep_gated" 110 python3 benchmarks/moe_engine.py --sweep --rows qwen3:64,4096 --reps 5 \
        --variants "wgmma=kernel:wgmma;unfused=kernel:wgmma,fuse_act:0"
    wgmma_table 170 qwen3 dsv2lite mixtral
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_gated.log"
    grep -E "^\| (Mix|Qwen|Deep)|rc " "$OUT/table_wgmma.log"
elif [ "$part" = 16 ]; then    # next: block size against padding and against re-reading weights (notes.md
    # v8): compute-bound rows (Mixtral 512/4096, Qwen3 4096) pad less with 64-row blocks;
    # bandwidth-bound rows read an expert's weights once per block, so blocks that hold
    # mean + 2 sd of an expert's rows (Qwen3 512: 64, Mixtral 64: 32, DeepSeek-V2-Lite 64: 16)
    # should beat the average rounded up (32 / 16 / 8); then where the v8 layers spend their time
    logged "sweep_bm" 170 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512,4096 qwen3:512,4096 --reps 3 \
        --variants "wgmma=kernel:wgmma;bm64=kernel:wgmma,block_m:64;wgmma 2=kernel:wgmma;bm64 2=kernel:wgmma,block_m:64"
    logged "sweep_bm_decode" 110 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64 dsv2lite:64 --reps 10 \
        --variants "wgmma=kernel:wgmma;bm16=kernel:wgmma,block_m:16;bm32=kernel:wgmma,block_m:32;wgmma 2=kernel:wgmma"
    logged "profile" 200 python3 benchmarks/moe_engine.py --sweep --profile --rows mixtral:1 qwen3:512,4096 \
        --reps 5 --variants "wgmma=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_bm.log" "$OUT/sweep_bm_decode.log"
    tail -60 "$OUT/profile.log"
elif [ "$part" = 17 ]; then    # next: 1-token layers in fewer launches — GEMM1 without a K split runs
    # the gated epilogue and its 8-row blocks feed GEMM2 directly (no XLA pass between the GEMMs);
    # with sfold no Σx reductions either. The GPU layer tests first (they cover the direct path
    # wherever GEMM1 takes no K split at decode)
    gpu_tests 200 "wgmma_gpu_shapes and (awq or channel)"
    logged "sweep_1tok" 250 python3 benchmarks/moe_engine.py --sweep --rows qwen3:1 dsv2lite:1 mixtral:1 --reps 20 \
        --variants "wgmma=kernel:wgmma;s1=kernel:wgmma,split1:1;s1 sfold=kernel:wgmma,split1:1,sfold:1;wgmma 2=kernel:wgmma;s1 2=kernel:wgmma,split1:1;s1 sfold 2=kernel:wgmma,split1:1,sfold:1"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_1tok.log"
elif [ "$part" = 18 ]; then    # v9: stages fitted to shared memory (64-row blocks failed in part 16 at
    # 288 KB), so 64-row blocks against their padding and weight re-reads at the 512- and 4096-token
    # rows; the inverse-order gather for the top-k sum again now that GEMM2 writes [M, N] (tout);
    # the new block rule at decode (Mixtral 32 / 64 tokens: 16 / 32-row blocks, DeepSeek-V2-Lite
    # 64: 16); the layer GPU tests first (incl. 64-row blocks with fitted stages)
    gpu_tests 220 "wgmma_gpu_shapes and awq"
    V="wgmma=kernel:wgmma;bm64=kernel:wgmma,block_m:64;gather=kernel:wgmma,combine:gather"
    logged "sweep_prefill" 190 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512,4096 mixtral:512 --reps 3 \
        --variants "$V;wgmma 2=kernel:wgmma;bm64 2=kernel:wgmma,block_m:64;gather 2=kernel:wgmma,combine:gather"
    logged "sweep_decode" 110 python3 benchmarks/moe_engine.py --sweep --rows mixtral:32,64 dsv2lite:64 --reps 10 \
        --variants "wgmma=kernel:wgmma;bm8=kernel:wgmma,block_m:8;bm16=kernel:wgmma,block_m:16;wgmma 2=kernel:wgmma"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_prefill.log" "$OUT/sweep_decode.log"
elif [ "$part" = 19 ]; then    # v9: the expert sort by counting (auto from 1024 pairs) against one sort,
    # on the v9 defaults (inverse-order gather for the top-k sum); the two GPTQ channelwise layer tests
    # part 17 did not reach; the wgmma AWQ / GPTQ columns of the layer table, three shapes
    gpu_tests 190 "wgmma_gpu_shapes and gptq4_channel and (mixtral or qwen3)"
    logged "sweep_align" 150 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512,4096 mixtral:512 --reps 3 \
        --variants "wgmma=kernel:wgmma;sort=kernel:wgmma,align:sort;wgmma 2=kernel:wgmma;sort 2=kernel:wgmma,align:sort"
    wgmma_table 190 qwen3 dsv2lite mixtral
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_align.log"
    grep -E "^\| (Mix|Qwen|Deep)|rc " "$OUT/table_wgmma.log"
elif [ "$part" = 20 ]; then    # v9: the one-kernel decode layer (pallas_kernels/wgmma_decode.py): its first
    # GPU run — the layer tests at 1/2 tokens (three calls in a row: the semaphores reset), then 1 token
    # against the two-kernel layer. Fits the last ~4 device minutes of the tenth session
    gpu_tests 100 "decode_layer_gpu and awq and (qwen3 or dsv2lite)"
    logged "sweep_one" 80 python3 benchmarks/moe_engine.py --sweep --rows qwen3:1 dsv2lite:1 --reps 10 \
        --variants "wgmma=kernel:wgmma;one=kernel:wgmma,one_kernel:1;wgmma 2=kernel:wgmma;one 2=kernel:wgmma,one_kernel:1"
    grep -E "FAILED|ERROR|passed|failed|rc |Error" "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_one.log"
elif [ "$part" = 21 ]; then    # next: what one launch costs per kind of kernel (the notes.md v9 guess: Mosaic GPU
    # encodes its TMA descriptors on the host at every launch, and that paces 1-token layers), then the
    # one-kernel decode layer's remaining GPU tests (Mixtral, GPTQ channelwise) and its 1-token timings
    logged "launch" 100 python3 benchmarks/launch_overhead.py --reps 200
    gpu_tests 150 "decode_layer_gpu and (mixtral or gptq4_channel)"
    logged "sweep_one" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1 qwen3:1,2 dsv2lite:1 --reps 10 \
        --variants "wgmma=kernel:wgmma;one=kernel:wgmma,one_kernel:1;wgmma 2=kernel:wgmma;one 2=kernel:wgmma,one_kernel:1"
    grep -E "^\||^#|rc " "$OUT/launch.log"
    grep -E "FAILED|ERROR|passed|failed|rc |Error" "$OUT/tests.log" | tail -14
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_one.log"
elif [ "$part" = 22 ]; then    # next: where the v9 prefill layers spend their time (the gather top-k sum and
    # the counting sort replaced the scatter and the radix sort; the row gather into expert blocks was
    # 122 µs of Qwen3's 4096-token layer), and the Mixtral rows of the layer table the part-19 table
    # did not reach
    logged "profile" 200 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:512,4096 mixtral:512 \
        --reps 5 --variants "wgmma=kernel:wgmma"
    wgmma_table 300 mixtral
    tail -60 "$OUT/profile.log"
    grep -E "^\| Mix|rc " "$OUT/table_wgmma.log"
elif [ "$part" = 23 ]; then    # v10: expert blocks sized to the spread of an expert's rows (wgmma_block_m:
    # 144-row blocks at Mixtral 512 and Qwen3 4096 tokens, 48 at Qwen3 512), against the v9 powers of two
    # in the same run, then the GPU tests that run the new sizes (defaults at 300 tokens: 96 / 48 / 32 rows,
    # and explicit 144- and 48-row blocks) and the router weight in GEMM2's epilogue (row_scale: the kernel
    # cases, and every layer test, whose GEMM2 now scales its rows)
    logged "sweep_bm" 170 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512 qwen3:4096 --reps 5 \
        --variants "wgmma=kernel:wgmma;bm128=kernel:wgmma,block_m:128;bm136=kernel:wgmma,block_m:136;wgmma 2=kernel:wgmma"
    logged "sweep_bm48" 100 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 mixtral:128 --reps 10 \
        --variants "wgmma=kernel:wgmma;bm32=kernel:wgmma,block_m:32;bm64=kernel:wgmma,block_m:64;wgmma 2=kernel:wgmma"
    gpu_tests 270 "(wgmma_gpu_shapes and (awq or channel)) or (wgmma_grouped_gemm_gpu and (rs1 or bm48 or bm144))"
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_bm.log" "$OUT/sweep_bm48.log"
    grep -E "FAILED|ERROR|passed|failed|rc |Error" "$OUT/tests.log" | tail -14
elif [ "$part" = 24 ]; then    # v10: the layer table's wgmma columns timed as straight-line calls. A fori_loop
    # iteration waits for the device before the next one launches (part 21: an XLA fusion costs 12.7 µs
    # per call in the loop, 1.7 unrolled), so in the loop timing every launch's host work adds to the
    # layer; then the launch probe's rows the part-21 call did not reach (10 TMA descriptors, Triton)
    gpu_tests 80 "wgmma_grouped_gemm_gpu and bm48 and rs1"     # part 23's two invalid cases, made valid
    wgmma_table 330 qwen3 dsv2lite mixtral --timing unrolled
    logged "launch" 90 python3 benchmarks/launch_overhead.py --reps 50 --only "mgpu tma 1" "mgpu tma 8" triton
    grep -E "^\| (Qwen|Deep|Mix)|rc " "$OUT/table_wgmma.log" | sort -u
    grep -E "^\||^#|rc " "$OUT/launch.log"
    grep -E "FAILED|ERROR|passed|failed|rc |Error" "$OUT/tests.log" | tail -6
elif [ "$part" = 25 ]; then    # next: where a layer's device time has holes (kernel_profile's call timeline: span
    # from its first kernel to its last, idle time inside it, the largest gaps and the kernels around
    # them) — the rows whose loop time is far above their device-busy time (part 22: Qwen3 512 tokens
    # 411 µs against 252 busy; v9: the one-kernel Qwen3 1-token layer 41–56 µs against 24 busy)
    logged "profile" 150 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:1 mixtral:1 dsv2lite:1 \
        --reps 10 --variants "wgmma=kernel:wgmma;one=kernel:wgmma,one_kernel:1"
    logged "profile512" 70 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:512 --reps 10 \
        --variants "wgmma=kernel:wgmma"
    grep -E "^##|floor  rel|µs/call|µs  ×|rc " "$OUT/profile.log" "$OUT/profile512.log"
elif [ "$part" = 26 ]; then    # v10: part 25 found each call's kernels back to back on the device (idle ≤ 3 µs
    # per call), yet the loop-timed layer 20–260 µs longer than that span: the same rows timed as a
    # loop, as jitted calls dispatched from Python, and as a loop without XLA's command buffers
    local_rows="qwen3:1,512 mixtral:1"
    for timing in loop calls; do
        logged "timing_$timing" 70 python3 benchmarks/moe_engine.py --sweep --timing $timing --rows $local_rows \
            --reps 10 --variants "wgmma=kernel:wgmma"
    done
    logged "timing_nocmd" 70 env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 benchmarks/moe_engine.py --sweep \
        --timing loop --rows $local_rows --reps 10 --variants "wgmma=kernel:wgmma"
    grep -E "^##|floor  rel|FAIL|rc " "$OUT"/timing_*.log
elif [ "$part" = 27 ]; then    # what the host does per layer call. Part 26: a layer takes 40–85 µs longer
    # than its kernels' span on the device, in a fori_loop and as jitted calls from Python, and the kernels
    # of one profiled call run back to back (part 25). But XLA turns its command buffers (CUDA graphs) off
    # while the profiler runs (xla_enable_command_buffers_during_profiling, default false), so parts 25/26
    # profiled op-by-op launches, not the timed program. "profile_cmdbuf": the same profile with them on;
    # --profile also profiles the timed program itself (fresh routing per call): per-call span and idle
    logged "profile_cmdbuf" 200 env XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true \
        python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:1 mixtral:1 --reps 10 --variants "wgmma=kernel:wgmma"
    logged "profile" 150 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:1 mixtral:1 --reps 10 \
        --variants "wgmma=kernel:wgmma"
    # fewer launches at 1 token: the split and top-k sums as unrolled adds (v10 default; "reductions": the
    # v9 XLA reductions), sfold needs no Σx reductions in XLA (2 launches), split1=1 no split sum between
    # the GEMMs (1), "in gemm2": the router weights in GEMM2's epilogue (off at decode: one more launch?)
    logged "launches" 170 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:1 dsv2lite:1 --reps 10 \
        --variants "wgmma=kernel:wgmma;reductions=kernel:wgmma,static_sums:0;sfold=kernel:wgmma,sfold:1;sfold split1=kernel:wgmma,sfold:1,split1:1;in gemm2=kernel:wgmma,weight_in_gemm2:1"
    grep -E "^##|floor  rel|µs/call|µs  ×|host spans|timed program|rc " "$OUT"/profile*.log "$OUT/launches.log"
elif [ "$part" = 28 ]; then    # the same layers under XLA's command-buffer settings: does a CUDA graph
    # take the per-launch host time (~3.4 µs a kernel, notes.md v10) off the layer? min_graph_size=1: every
    # sequence of commands a graph; +WHILE,+CONDITIONAL: the fori_loop itself inside the graph (no host
    # round trip per call); straight-line: no loop at all
    rows="qwen3:1,512 dsv2lite:1 mixtral:1"
    vars="wgmma=kernel:wgmma;one=kernel:wgmma,one_kernel:1"
    flags_run() {   # flags_run NAME SECONDS TIMING XLA_FLAGS
        logged "$1" "$2" env XLA_FLAGS="$4" python3 benchmarks/moe_engine.py --sweep --timing "$3" --rows $rows \
            --reps 10 --variants "$vars"
    }
    flags_run "f_loop" 80 loop ""
    flags_run "f_straight" 95 unrolled ""
    flags_run "f_loop_min1" 80 loop "--xla_gpu_graph_min_graph_size=1"
    flags_run "f_straight_min1" 95 unrolled "--xla_gpu_graph_min_graph_size=1"
    flags_run "f_loop_while" 80 loop "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"
    flags_run "f_loop_unroll" 80 loop "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT"/f_*.log | grep -v "^.*: *$"
elif [ "$part" = 29 ]; then    # v11: the differential timing (the 2R-call program less the R-call one, so a
    # program's fixed 0.08–0.45 ms is no longer spread over its 10 layers — parts 27/28 saw the same layer
    # at 37–114 µs while the timed program's device span was 30–35 µs a call). Predictions (notes.md v11):
    # Qwen3 1 token ≈ its timed device span, 30–35 µs; sfold −3 µs (2 kernels fewer); the straight-line
    # program without the loop's carry copies a few µs less than the loop
    dec="wgmma=kernel:wgmma;sfold=kernel:wgmma,sfold:1;sfold split1=kernel:wgmma,sfold:1,split1:1;one=kernel:wgmma,one_kernel:1;wgmma again=kernel:wgmma"
    logged "dec_loop" 270 python3 benchmarks/moe_engine.py --sweep --rows qwen3:1,16 dsv2lite:1,16 mixtral:1,16 \
        --reps 10 --variants "$dec"
    logged "dec_straight" 220 python3 benchmarks/moe_engine.py --sweep --timing unrolled --rows qwen3:1 dsv2lite:1 \
        mixtral:1 --reps 10 --variants "wgmma=kernel:wgmma;sfold=kernel:wgmma,sfold:1;one=kernel:wgmma,one_kernel:1"
    grep -E "^##|floor  rel|rc |FAIL" "$OUT"/dec_*.log
elif [ "$part" = 30 ]; then    # v11: sfold on for the pair schedule (part 29), GPU-tested against the float64
    # reference for every format the table prepares, then the wgmma table (AWQ / GPTQ) under the differential
    # timing, 40 routings at decode (10 at 512+ tokens) so a program's fixed cost and its spread shrink
    gpu_tests 210 "pair_defaults_gpu"
    wgmma_table 330 mixtral qwen3 dsv2lite --reps 40
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^\| |rc |rror" "$OUT/table_wgmma.log"
elif [ "$part" = 31 ]; then    # v11: prefill under the differential timing. gather32: the token rows gathered
    # into the expert blocks as 32-bit words (XLA wrote the 134 MB of Qwen3 4096's rows at ~1 TB/s, 126 µs, v10);
    # Qwen3 512's block rows again (48 chosen in v10 under the old timing)
    logged "prefill" 230 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512,4096 mixtral:512 --reps 40 \
        --variants "wgmma=kernel:wgmma;gather32=kernel:wgmma,gather32:1;bm32=kernel:wgmma,block_m:32;bm64=kernel:wgmma,block_m:64;wgmma again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL" "$OUT/prefill.log"
elif [ "$part" = 32 ]; then    # prepared in v11 for the next session: the 1-token K splits under the differential
    # timing (v11 defaults: sfold in the pair schedule). The layer's splits (choose_split, then the largest
    # divisor of the steps): Qwen3 GEMM1 2 of 8 steps, GEMM2 3 of 3; DeepSeek-V2-Lite GEMM1 2 of 8, GEMM2 1 of
    # 11; Mixtral GEMM1 1 of 16 (so its activation is fused), GEMM2 4 of 56. Qwen3's GEMM1 at split 2 is 192
    # programs on 132 SMs, a tail of 60: prediction (notes.md v11) split1=4 (384 programs) 1–2 µs faster there
    logged "splits" 240 python3 benchmarks/moe_engine.py --sweep --rows qwen3:1 dsv2lite:1 mixtral:1 --reps 40 \
        --variants "wgmma=kernel:wgmma;split1 4=kernel:wgmma,split1:4;split1 8=kernel:wgmma,split1:8;split1 1=kernel:wgmma,split1:1;split2 1=kernel:wgmma,split2:1;split2 8=kernel:wgmma,split2:8;stages 4=kernel:wgmma,stages:4;wgmma again=kernel:wgmma"
    logged "profile" 120 python3 benchmarks/moe_engine.py --sweep --profile --rows mixtral:1 qwen3:1 --reps 10 \
        --variants "wgmma=kernel:wgmma"
    # Qwen3 512 (21–25% of the dense rate): one program per SM (ws: 256 columns, 3-stage rings, 205–251 KB),
    # and each streams only 8 (GEMM1) or 3 (GEMM2) steps, so every program's ring fill is exposed. Without
    # ws and with 2 stages a program needs 85 KB: two per SM, one filling while the other computes
    logged "prefill512" 120 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 --reps 40 \
        --variants "wgmma=kernel:wgmma;ws0 st2=kernel:wgmma,ws:0,stages:2;ws0=kernel:wgmma,ws:0;st2=kernel:wgmma,stages:2"
    grep -E "^##|floor  rel|rc |FAIL" "$OUT/splits.log" "$OUT/prefill512.log"
    grep -E "^##|floor  rel|µs/call|µs  ×" "$OUT/profile.log" | head -40
elif [ "$part" = 35 ]; then    # v12 (thirteenth session): part 32 trimmed (no profile) plus two zero-code questions.
    # 1 token: the K splits (part 32's predictions), and DeepSeek-V2-Lite's GEMM2, whose 11 K-blocks (I = 1408)
    # are odd, so it runs 128-deep steps without a split (96 programs on 132 SMs): split2 11 gives 1056
    # one-step programs. Prediction: 2–4 µs off DeepSeek-V2-Lite 1 token. Mixtral 1 token: GEMM1 without a split is
    # 448 programs, 3.4 per SM, so 52 SMs run 4 and the rest 3 (85% balance); split1 2 (896) should balance it,
    # prediction 5–10 µs faster if the XLA activation pass costs less than that
    logged "splits" 200 python3 benchmarks/moe_engine.py --sweep --rows qwen3:1 dsv2lite:1 mixtral:1 --reps 40 \
        --variants "wgmma=kernel:wgmma;split1 2=kernel:wgmma,split1:2;split1 4=kernel:wgmma,split1:4;split1 1=kernel:wgmma,split1:1;split2 1=kernel:wgmma,split2:1;split2 11=kernel:wgmma,split2:11;wgmma again=kernel:wgmma"
    # Mixtral 16 / 64 tokens (1.44× / 1.83× floor, target 1.3×): ws from 32-row blocks (64 tokens) was chosen at
    # prefill; at 64 tokens each 32-row block streams all of its expert's weights, 2 blocks per expert
    logged "mixtral_dec" 130 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 --reps 40 \
        --variants "wgmma=kernel:wgmma;ws0=kernel:wgmma,ws:0;bm16=kernel:wgmma,block_m:16;sfold=kernel:wgmma,sfold:1;wgmma again=kernel:wgmma"
    logged "prefill512" 110 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 --reps 40 \
        --variants "wgmma=kernel:wgmma;ws0 st2=kernel:wgmma,ws:0,stages:2;ws0=kernel:wgmma,ws:0;st2=kernel:wgmma,stages:2"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/splits.log" "$OUT/mixtral_dec.log" "$OUT/prefill512.log"
elif [ "$part" = 36 ]; then    # v12, from part 35: sfold won at Mixtral 16 tokens (235 vs 251 µs), so sfold for the
    # blocked schedule's folding blocks (≤ 16 rows) at every decode row (v8 saw Qwen3 16 tokens slower, under the
    # old timing); Mixtral 64 tokens (32-row blocks, 1.8× floor): sfold at 32 rows and ws off with 2 stages;
    # Qwen3 512 (ws0 st2 211 vs 243 µs in part 35): the block rows again without ws
    logged "dec16" 150 python3 benchmarks/moe_engine.py --sweep --rows qwen3:16,64 dsv2lite:16,64 mixtral:16 --reps 40 \
        --variants "wgmma=kernel:wgmma;sfold=kernel:wgmma,sfold:1;wgmma again=kernel:wgmma"
    logged "mixtral64" 100 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64 --reps 40 \
        --variants "wgmma=kernel:wgmma;sfold32=kernel:wgmma,zfold:1,sfold:1;ws0 st2=kernel:wgmma,ws:0,stages:2;wgmma again=kernel:wgmma"
    logged "q512" 100 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 --reps 40 \
        --variants "ws0 st2=kernel:wgmma,ws:0,stages:2;ws0 st3=kernel:wgmma,ws:0,stages:3;ws0 st2 bm32=kernel:wgmma,ws:0,stages:2,block_m:32;ws0 st2 bm64=kernel:wgmma,ws:0,stages:2,block_m:64;wgmma=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/dec16.log" "$OUT/mixtral64.log" "$OUT/q512.log"
elif [ "$part" = 37 ]; then    # v12 defaults (sfold in every folding block; ws from 32 rows only for streams of
    # 32+ K-blocks, else 2 stages): GPU-tested against the float64 reference, then the wgmma table (AWQ / GPTQ)
    gpu_tests 220 "blocked_defaults_gpu"
    wgmma_table 340 mixtral qwen3 dsv2lite --reps 40
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^\| |rc |rror" "$OUT/table_wgmma.log"
elif [ "$part" = 38 ]; then    # v12: Qwen3 512 tokens, two programs per SM made it 10% faster (parts 35/36: without
    # ws, 2 stages 211–222 µs, 3 stages 285: 84 KB vs 126 KB per program). With 128-deep steps (wide off) a
    # stage is 20 KB instead of 42, so 3 stages fit three programs per SM (64 KB) and 2 stages four or five (44 KB);
    # the 32-byte TMA rows cap the ring near 2.4 TB/s, above the ~1.4 TB/s the layer reaches. Prediction:
    # wide0 st3 ≥ 10% faster than the default; then where the default's time goes (kernels, JAX profiler)
    logged "q512b" 110 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 --reps 40 \
        --variants "wgmma=kernel:wgmma;wide0 st2=kernel:wgmma,wide:0;wide0 st3=kernel:wgmma,wide:0,stages:3;wide0 st4=kernel:wgmma,wide:0,stages:4;wgmma again=kernel:wgmma"
    gpu_tests 150 "blocked_defaults_gpu and qwen3"      # the default and wide0 st3 against float64
    logged "profile512" 70 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:512 --reps 10 \
        --variants "wgmma=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/q512b.log"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -8
    grep -E "^##|floor  rel|µs/call|µs  ×" "$OUT/profile512.log" | head -30
elif [ "$part" = 39 ]; then    # v12: the layer suite (defaults and every forced form, 1 / 5–16 / 300 tokens) on the
    # v12 defaults, AWQ and GPTQ channelwise at the three shapes (act-order ran in parts 37/38's blocked tests)
    gpu_tests 280 "wgmma_gpu_shapes and (awq or channel)"
    grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
elif [ "$part" = 40 ]; then    # prepared in v12 for the next session (lowered on jax 0.10.2 and 0.11.2 on the CPU,
    # never run on a GPU): the persistent GEMM — each program streams a contiguous share of the (block, column
    # tile) items through one ring, so an item's ring fill overlaps the previous item's compute. First its
    # kernel cases and the layer forms against float64, then the prefill rows. Prediction (notes.md v12): Qwen3
    # 512 tokens, whose GEMMs read their 302 MB at 1.66 TB/s in 48-row items of 16 / 6 K-blocks, 15–30% faster
    # (≤ 190 µs); Mixtral 512 and Qwen3 4096 (144-row blocks, long streams, ws today) no faster; at 1 token
    # (K splits as items; GEMM2's programs stream 1–4 steps) 1–3 µs faster at Qwen3 and DeepSeek-V2-Lite
    gpu_tests 200 "(wgmma_grouped_gemm_gpu and persistent) or (blocked_defaults_gpu and (qwen3 or dsv2lite))"
    # 160 routings at decode (40 from 512 tokens): at 40, repeats of one 1-token configuration differed by up to
    # ~5 µs (part 35), i.e. ~0.2 ms of the two programs' fixed-cost jitter; 4× the calls divide it by 4
    logged "persist" 260 python3 benchmarks/moe_engine.py --sweep --rows qwen3:1,512,4096 dsv2lite:1 mixtral:1,512 --reps 160 \
        --variants "wgmma=kernel:wgmma;pers=kernel:wgmma,persistent:1;pers st3=kernel:wgmma,persistent:1,stages:3;pers st4=kernel:wgmma,persistent:1,stages:4;wgmma again=kernel:wgmma"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/persist.log"
elif [ "$part" = 41 ]; then    # v13 (fourteenth session): GEMM2 adds each row into its token's output row
    # itself (combine=add: a TMA reduce-add per row from its output tile) instead of writing [rows, H] for XLA's
    # gather-and-sum. Prediction: Qwen3 4096 tokens 40–70 µs faster (GEMM2's 134 MB of rows neither written nor
    # read back; the 43 µs combine gone), Qwen3 512 and Mixtral 512 5–10 µs, Mixtral 4096 10–30 µs; decode
    # blocks (8 rows) no faster (the combine is small there and the adds are one 1-row copy per row)
    gpu_tests 220 "(wgmma_grouped_gemm_gpu and dest) or combine_add_gpu"
    logged "add" 300 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512,4096 mixtral:512,4096 --reps 40 \
        --variants "gather=kernel:wgmma;add=kernel:wgmma,combine:add;gather again=kernel:wgmma;add again=kernel:wgmma,combine:add"
    logged "add_decode" 140 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 qwen3:64 dsv2lite:64 --reps 160 \
        --variants "gather=kernel:wgmma;add=kernel:wgmma,combine:add"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/add.log" "$OUT/add_decode.log"
elif [ "$part" = 42 ]; then    # v13, from part 41 (combine=add: slower at Qwen3 512 / 4096 and Mixtral 4096,
    # 736–758 vs 768–770 µs at Mixtral 512, even at decode): Mixtral 512 repeated, and Mixtral's decode blocks.
    # Prediction: 16-row blocks at 64 tokens (1–2 per expert, now with the scale-only fold, the two blocks of
    # an expert reading the same weight tiles at about the same time, so mostly from L2) 280–300 µs against
    # 316–330 for the 32-row ws default; 8-row blocks there slower (2–3 blocks per expert)
    logged "bm" 200 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64,16 --reps 160 \
        --variants "wgmma=kernel:wgmma;bm16=kernel:wgmma,block_m:16;bm8=kernel:wgmma,block_m:8;bm16 add=kernel:wgmma,block_m:16,combine:add;wgmma again=kernel:wgmma"
    logged "add512" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512 --reps 40 \
        --variants "gather=kernel:wgmma;add=kernel:wgmma,combine:add;gather again=kernel:wgmma;add again=kernel:wgmma,combine:add"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/bm.log" "$OUT/add512.log"
elif [ "$part" = 43 ]; then    # v13, from part 42 (16- and 8-row blocks at Mixtral 64 tokens: 391 and 536 against
    # 323 µs; combine=add at Mixtral 512 806 / 812 against 776 / 807): ring depth at Mixtral decode, whose
    # GEMMs stream its weights at 2.3–3 TB/s. Prediction: 3 stages (ws at 64 tokens, 8-row sfold at 16) 3–8% faster
    logged "stages" 250 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 --reps 160 \
        --variants "wgmma=kernel:wgmma;st3=kernel:wgmma,stages:3;st4=kernel:wgmma,stages:4;wgmma again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/stages.log"
elif [ "$part" = 44 ]; then    # v13: what the wgmma GEMMs wait on (Nsight Compute reads the counters on this
    # machine: part 44's first run): Mixtral's GEMM1 in 8-row sfold blocks (16 tokens) and 32-row ws blocks (64
    # tokens), which stream the weights at 2.3–3 TB/s against 3.9 TB/s for the copy ring alone, and Qwen3's
    # GEMM1 in the 48-row, 2-stage blocks of 512 tokens (its GEMMs at 1.66 TB/s)
    # First (fifteenth session) the GPU layer tests since their inputs moved into one helper (_routed_case),
    # one scheme per test function at the three shapes
    gpu_tests 250 "(decode_layer_gpu and awq) or (pair_defaults_gpu and channel) or (blocked_defaults_gpu and actorder) or (combine_add_gpu and awq) or (fused_moe_gpu_shapes and gptq4_g64) or (wgmma_gpu_shapes and awq)"
    grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -24
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
    for spec in "mixtral1|8|bn128 st2 kpb2 wide shift32 sfold s1" "mixtral1|32|bn128 st3 kpb2 wide shift32 ws s1" \
                "qwen3_1|48|bn128 st2 kpb2 wide shift32 s1"; do
        g=${spec%%|*}; rest=${spec#*|}; bm=${rest%%|*}; v=${rest#*|}
        # the Mosaic GPU host function is <body>_mosaic_gpu and its device kernel is outlined under that name;
        # the first run's filter, 'mosaic|kernel', profiled cuBLAS's reference GEMMs (names ending in _kernel)
        logged "ncu_${g}_bm${bm}" 90 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 1 $S \
            python3 benchmarks/gemm_kernels.py --gemms "$g" --block-m "$bm" --reps 1 --only "$v"
    done
    grep -E "==PROF==|==ERROR|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|Issued Ipc|No Eligible|Warp Cycles Per Issued|Stall|rc " "$OUT"/ncu_*.log | head -90
elif [ "$part" = 45 ]; then    # prepared in v13 for the next session, from benchmarks/wgmma_plan.py (no GPU): at
    # Mixtral 512 tokens GEMM2 runs one ws program per SM, 128 of them when each expert fits one 144-row block,
    # 144 when one expert needs two (32% of uniform routings: P(an expert's 512·¼ rows > 144) = 4.75%), so 12
    # programs then run as a second wave. 160-row blocks need a second block in 0.5% of routings but pad 11%
    # more rows. Prediction: bm160 within ±3% of bm144 on average (the wave saved against the padded MMA rows),
    # and the run-to-run spread of Mixtral 512 (729–814 µs) smaller; split2 2 slower (float32 partials)
    python3 benchmarks/wgmma_plan.py --rows mixtral:512 > "$OUT/plan.log" 2>&1
    python3 benchmarks/wgmma_plan.py --rows mixtral:512 --set block_m:160 >> "$OUT/plan.log" 2>&1
    logged "bm512" 240 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512 --reps 40 \
        --variants "wgmma=kernel:wgmma;bm160=kernel:wgmma,block_m:160;bm176=kernel:wgmma,block_m:176;split2 2=kernel:wgmma,split2:2;wgmma again=kernel:wgmma"
    # 1-token GEMM1 K splits again with 160 routings: Mixtral's 448 programs put 4 on some SMs and 3 on others
    # (3.39 per SM), Qwen3's 192 put 2 on 60 SMs and 1 on 72 (wgmma_plan.py); split1 2 / 4 (Mixtral) and 4 / 8
    # (Qwen3) spread them within 3% of even. Part 35 at 40 routings: Mixtral split1 2 / 4 70.2 / 70.9 against
    # 72.4–72.9, Qwen3 split1 4 22.9 against 19.7–20.7 (±5 µs then). Prediction: Mixtral split1 2 2–4 µs faster
    # (~8 µs of GEMM1's imbalance saved, less the XLA kernel that sums the splits and applies the activation, which
    # GEMM1 fuses at split 1); Qwen3 split1 4 / 8 1–2 µs faster (its default is split 2, already unfused); Qwen3
    # split1 1 (96 programs on 132 SMs, but the activation fused and no XLA kernel between the GEMMs) no faster
    logged "split1" 180 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1 qwen3:1 --reps 160 \
        --variants "wgmma=kernel:wgmma;split1 1=kernel:wgmma,split1:1;split1 2=kernel:wgmma,split1:2;split1 4=kernel:wgmma,split1:4;split1 8=kernel:wgmma,split1:8;wgmma again=kernel:wgmma"
    # Qwen3 4096 tokens: its 144-row ws programs stream 16 / 6 K-blocks, one per SM (wgmma_plan.py); without ws
    # at 2 stages two fit per SM, the form that made Qwen3 512 faster (v12). Prediction: 3–8% faster
    logged "q4096" 150 python3 benchmarks/moe_engine.py --sweep --rows qwen3:4096 --reps 40 \
        --variants "wgmma=kernel:wgmma;ws0 st2=kernel:wgmma,ws:0,stages:2;wgmma again=kernel:wgmma"
    cat "$OUT/plan.log"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/bm512.log" "$OUT/split1.log" "$OUT/q4096.log"
elif [ "$part" = 46 ]; then    # v14 (fifteenth session), from parts 44/45: the pair schedule's GEMM1 now splits K
    # to ~4 programs per SM with ≥ 4 steps each (Mixtral 1 token: split 2, 67.7 against 72.9–73.0 µs in part 45),
    # GPU-tested here with the two layer tests part 44's time limit cut off
    gpu_tests 200 "(fused_moe_wgmma_gpu_shapes and awq and mixtral) or (combine_add_gpu and awq and qwen3) or (pair_defaults_gpu and mixtral)"
    grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -12
    # Part 44's profile: the 8-row sfold GEMM issues 0.72 warp instructions per scheduler-cycle, ~840 per warp
    # per 256-deep step, where the dequantization alone needs ~350 (PTX/SASS kept here, read on the CPU)
    logged "ptx" 150 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 8 32 --keep "$OUT/ptx" \
        --only "bn128 st2 kpb2 wide shift32 sfold" "bn128 st3 kpb2 wide shift32 ws"
    grep -E "^mixtral1|registers|spill|rc " "$OUT/ptx.log" | head -20
    # Mixtral 16 tokens: GEMM2 runs 256 live 8-row programs of 56 steps, ~2 per SM where 4–5 fit (wgmma_plan.py);
    # the 8-row GEMM1 profile reached 71% of DRAM with 4 per SM. Prediction: split2 2 (512 programs, float32
    # partials summed in the top-k combine) 5–15 µs faster at 16 tokens; at 64 tokens (32-row ws, one program per
    # SM by registers) no faster
    logged "split2" 220 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 --reps 160 \
        --variants "wgmma=kernel:wgmma;split2 2=kernel:wgmma,split2:2;split2 4=kernel:wgmma,split2:4;wgmma again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/split2.log"
elif [ "$part" = 47 ]; then    # v14: part 46's SASS (8/32-row sfold kernels, ptxas 13.0 here = the device's register
    # counts) showed each nibble plane's and/or as two LOP3.LUT: 806 instructions per warp and 256-deep step, 258
    # LOP3 + 97 SHF on the integer pipe (half rate), where the dequantization needs 128 LOP3 (one lop3.b32 per
    # plane, now inline PTX: lop3, default on) + 96 SHF. The new defaults first (lop3 everywhere shift32 runs;
    # GEMM1 split 2 at Mixtral 1 token, GEMM2 split 2 at Mixtral 16), against float64
    gpu_tests 230 "(wgmma_grouped_gemm_gpu and shift32) or (blocked_defaults_gpu and (mixtral or (awq and qwen3))) or (pair_defaults_gpu and awq and (mixtral or qwen3)) or (decode_layer_gpu and awq and qwen3) or (fused_moe_wgmma_gpu_shapes and actorder and mixtral)"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -12
    logged "ptx" 50 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 8 32 --keep "$OUT/ptx" \
        --only "bn128 st2 kpb2 wide shift32 sfold"
    grep -E "^mixtral1|registers|spill|rc " "$OUT/ptx.log" | head -8
    # Prediction: the 8-row GEMMs (int pipe at 67%, issue 72% in part 44) 5–12% faster — Mixtral 16 tokens
    # 234 → 210–222 µs, 1 token 68 → 62–65; Mixtral 64 (32-row ws, issue 55%) 0–5%; Qwen3 / DeepSeek-V2-Lite
    # 1 token 0.5–1.5 µs; Qwen3 512 (48 rows, issue 46%) 0–5%
    logged "lop3" 160 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16,64 qwen3:1,64 dsv2lite:1 --reps 160 \
        --variants "wgmma=kernel:wgmma;lop3 0=kernel:wgmma,lop3:0"
    logged "lop3_prefill" 80 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 mixtral:512 --reps 40 \
        --variants "wgmma=kernel:wgmma;lop3 0=kernel:wgmma,lop3:0"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/lop3.log" "$OUT/lop3_prefill.log"
elif [ "$part" = 48 ]; then    # v14: the wgmma columns (AWQ / GPTQ) of the decode rows on the v14 defaults, 160
    # routings (the session's last ~4 device minutes; rows print as they finish)
    wgmma_table 200 mixtral:1,16,64 qwen3:1 dsv2lite:1 qwen3:64 dsv2lite:16 --reps 160
    grep -E "^\| |rc |rror" "$OUT/table_wgmma.log"
elif [ "$part" = 49 ]; then    # prepared in v14 (its 8-row stall reasons and Mixtral 64 as the ws stream ran in part 52,
    # v15; the rest is still to run): what the 8-row GEMMs wait on now that lop3
    # took the issue rate out of the way (Mixtral 16 tokens did not move, part 47) — the warp stall reasons per
    # issued instruction (Nsight Compute's WarpStateStats body), and the same for the 32-row ws and the 48-row
    # Qwen3 GEMMs; then the 8-row decode GEMM1 at Mixtral 16 tokens with a K split (3584 programs of 8 steps:
    # a smaller last wave than 1792 of 16, at the price of the fused activation) and with 3 stages
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --print-details all"
    M="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
    for spec in "mixtral1|8|bn128 st2 kpb2 wide shift32 sfold s1" "mixtral1|32|bn128 st3 kpb2 wide shift32 ws s1" \
                "qwen3_1|48|bn128 st2 kpb2 wide shift32 s1"; do
        g=${spec%%|*}; rest=${spec#*|}; bm=${rest%%|*}; v=${rest#*|}
        logged "ncu_${g}_bm${bm}" 90 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 1 $S $M \
            python3 benchmarks/gemm_kernels.py --gemms "$g" --block-m "$bm" --reps 1 --only "$v"
    done
    grep -E "==PROF==|==ERROR|Duration|DRAM Throughput|Issued Warp|No Eligible|issue_stalled|Stall|rc " "$OUT"/ncu_*.log | head -120
    logged "m16" 140 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16 --reps 160 \
        --variants "wgmma=kernel:wgmma;split1 2=kernel:wgmma,split1:2;st3=kernel:wgmma,stages:3;wgmma again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/m16.log"
elif [ "$part" = 50 ]; then    # prepared in v14 for the next session (lowered on jax 0.10.2 / 0.11.2 on the CPU, never
    # run on a GPU): persistent with ws — one program per SM, one warp-specialized pipeline per item of 2·block_n
    # columns, the pipelines chained by pipeline_state so the copy warpgroup fetches the next item while the compute
    # warpgroups finish the current one. First its kernel cases and the layer form against float64
    gpu_tests 200 "(wgmma_grouped_gemm_gpu and persistent1 and ws1) or (blocked_defaults_gpu and (qwen3 or dsv2lite))"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    # Prediction: Qwen3 512 tokens (48-row blocks, today two non-ws programs per SM, each 128-column tile reading its
    # block's token rows again: L2 at 80% in part 44) 10–25% faster (170–200 µs against ~223): the rows shared by
    # two tiles, no item starting with an empty ring; Qwen3 4096 (144-row ws, 16 / 6 steps per item) 3–8%;
    # Mixtral 512 (32 / 112 steps) within ±3%. "wig0" is the control: the router weights out of GEMM2 as the
    # stream needs, without the stream
    logged "wsstream" 330 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512,4096 mixtral:512 --reps 40 \
        --variants "wgmma=kernel:wgmma;wig0=kernel:wgmma,weight_in_gemm2:0;pers ws=kernel:wgmma,persistent:1,ws:1,weight_in_gemm2:0;wgmma again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/wsstream.log"
elif [ "$part" = 51 ]; then    # v15 (sixteenth session), from part 50 (the chained ws stream right on the H200, 12
    # tests; Qwen3 512 211.4 µs against 228.3–234.0, Qwen3 4096 and Mixtral 512 slower): the stream is now the
    # default for 33–63-row blocks of short K streams (the v12 two-programs-per-SM form, now persistent=False),
    # the router weights then in XLA. The layer tests on it (Qwen3 512, DeepSeek-V2-Lite 256 tokens: blocked
    # defaults, with the v12 form), then the same-run timing, A B A B. Prediction: Qwen3 512 7–10% faster than
    # v14 (as part 50); DeepSeek-V2-Lite 256 (GEMM1 streamed, GEMM2's 11 steps keep the v12 form) 2–6%
    gpu_tests 220 "blocked_defaults_gpu and (qwen3 or dsv2lite)"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    logged "stream" 200 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 dsv2lite:256 --reps 40 \
        --variants "wgmma=kernel:wgmma;v14=kernel:wgmma,persistent:0;wgmma again=kernel:wgmma;v14 again=kernel:wgmma,persistent:0"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/stream.log"
    wgmma_table 120 qwen3:512 --reps 40
    grep -E "^\| |rc |rror" "$OUT/table_wgmma.log"
elif [ "$part" = 52 ]; then    # v15, from part 51 (5 of the 6 layer tests passed before its limit; Qwen3 512 224.4 / 209.9
    # µs against v14's 232.0 / 239.2; the DeepSeek-V2-Lite row cut off): the sixth test, DeepSeek-V2-Lite 256 tokens
    # (GEMM1 streamed, GEMM2's 11 steps keep the v12 form; prediction 2–6% faster), Mixtral 64 tokens' 32-row ws
    # blocks as the stream (prediction within ±3%), and the 8-row decode GEMM's warp stall reasons (part 49's first)
    gpu_tests 180 "blocked_defaults_gpu and gptq4_g128_actorder and qwen3"
    grep -E "FAILED|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -6
    logged "dsv2" 110 python3 benchmarks/moe_engine.py --sweep --rows dsv2lite:256 --reps 20 \
        --variants "wgmma=kernel:wgmma;v14=kernel:wgmma,persistent:0"
    logged "m64" 110 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64 --reps 80 \
        --variants "wgmma=kernel:wgmma;pers ws=kernel:wgmma,persistent:1,ws:1,weight_in_gemm2:0"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/dsv2.log" "$OUT/m64.log"
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    logged "ncu_mixtral1_bm8" 90 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --print-details all \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m 8 --reps 1 --only "bn128 st2 kpb2 wide shift32 sfold s1"
    grep -E "==ERROR|Duration|DRAM Throughput|No Eligible|issue_stalled|rc " "$OUT/ncu_mixtral1_bm8.log" | \
        awk '$NF+0 >= 0.05 || !/issue_stalled/' | head -40
elif [ "$part" = 53 ]; then    # v15, from part 52 (the 8-row GEMM1 of Mixtral 16 tokens alone: 136.5 µs at 77% of DRAM,
    # its stalls mostly long-scoreboard, i.e. waiting on memory — near the copy ceiling, yet the layer is 1.4× its
    # floor): where a Mixtral decode layer's time goes, GEMM by GEMM, in the layer itself — Nsight Compute on the
    # first two Mosaic GPU kernels (GEMM1, GEMM2) of the layer's first call. Prediction: at 16 tokens GEMM2
    # (split 2, 8-row blocks, ~1 wave of 28-step programs) well below GEMM1's DRAM rate, ≥ 75 µs against its 58
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for t in 16 64 1; do
        logged "ncu_layer_mixtral$t" 85 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 2 \
            --section SpeedOfLight --section LaunchStats python3 benchmarks/moe_engine.py --sweep --rows mixtral:$t \
            --reps 1 --variants "wgmma=kernel:wgmma"
        grep -E "mosaic_gpu_kernel|Duration|DRAM Throughput|Grid Size|Registers|rc " "$OUT/ncu_layer_mixtral$t.log"
    done
elif [ "$part" = 54 ]; then    # v15, from part 53 (Nsight Compute segfaulted over moe_engine.py, all three rows): Mixtral's
    # GEMM2 alone instead, in 8-row sfold blocks (16 tokens' form, K unsplit), timed and under Nsight Compute, beside
    # GEMM1's 136.5 µs / 77% of DRAM (part 52). Prediction: well below GEMM1's DRAM rate, ≥ 75 µs against its 58
    V="bn128 st2 kpb2 wide shift32 sfold s1"
    logged "gemm2" 80 python3 benchmarks/gemm_kernels.py --gemms mixtral2 mixtral1 --block-m 8 --reps 20 --only "$V"
    grep -E "^\| m|rc |rror" "$OUT/gemm2.log"
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    logged "ncu_mixtral2_bm8" 100 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 1 \
        --section SpeedOfLight --section SchedulerStats --section LaunchStats \
        python3 benchmarks/gemm_kernels.py --gemms mixtral2 --block-m 8 --reps 1 --only "$V"
    grep -E "==ERROR|Duration|DRAM Throughput|L2 Cache Throughput|No Eligible|Grid Size|Registers Per|rc " "$OUT/ncu_mixtral2_bm8.log"
elif [ "$part" = 55 ]; then    # v15, from part 54 (alone, Mixtral's 8-row GEMM1 144.2 µs and GEMM2 74.1: 218 µs of the
    # 16-token layer's 234–243, both at 1.24–1.28× their bytes' time): the rest of the layer, kernel by kernel (JAX
    # profiler), at Mixtral 16 tokens and Qwen3 1 token. Prediction: Mixtral 16 tokens 15–25 µs outside the GEMMs
    logged "profile" 150 python3 benchmarks/moe_engine.py --sweep --profile --rows mixtral:16 qwen3:1 --reps 10 \
        --variants "wgmma=kernel:wgmma"
    grep -vE "^#|Warning|warn|^ *ref =|^\s*$" "$OUT/profile.log" | head -60
elif [ "$part" = 56 ]; then    # prepared in v15 for the next session, from part 55's profiles: (a) the timed loop's own
    # cost per iteration — per 1-token call two D2D copies and 5–7 µs of idle beside 17.6 µs of kernels (Qwen3),
    # which a model's layers, back to back in one program, do not pay per layer: the same rows with 8 calls per
    # loop iteration (--unroll 8). Prediction: 1-token rows 3–5 µs lower (Qwen3 ~17–18 µs), Mixtral 16 tokens 2–5.
    # (b) Mixtral 16 tokens' glue (22 µs in 14 kernels beside 220 µs of GEMMs): GEMM1's [N, M] output transposed
    # by XLA (2.8 µs) — the kernel's transposed store at 8-row blocks (tout, v8: slower under the old timing),
    # and GEMM2 unsplit with it (no float32 partials to sum and transpose in the 4.3 µs combine)
    for u in 1 8; do
        logged "unroll$u" 200 python3 benchmarks/moe_engine.py --sweep --unroll $u --rows qwen3:1 dsv2lite:1 \
            mixtral:1,16 --reps 160 --variants "wgmma=kernel:wgmma"
    done
    logged "m16glue" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16 --reps 160 \
        --variants "wgmma=kernel:wgmma;tout=kernel:wgmma,tout:1;tout s2 1=kernel:wgmma,tout:1,split2:1;wgmma again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT"/unroll*.log "$OUT/m16glue.log"
elif [ "$part" = 57 ]; then    # prepared in v15 for the next session: the ws stream one GEMM at a time (persistent as a
    # pair, GEMM1's and GEMM2's). Part 50 streamed both GEMMs at Qwen3 4096 (144-row ws blocks) and lost (926 vs
    # 799–823 µs); its GEMM2 runs 2071 live programs of 6 steps, one per SM, 15.7 waves each filling a 4-deep ring —
    # the short items the stream won with at 512 tokens. Prediction: GEMM2 alone as the stream 2–5% faster (770–790,
    # ≥ 61% of the dense rate), so GEMM1's long items were the loss. At Qwen3 512: which GEMM the v15 gain came from
    # (prediction: mostly GEMM2, 3-step items)
    logged "pergemm" 450 python3 benchmarks/moe_engine.py --sweep --rows qwen3:4096,512 --reps 40 \
        --variants "wgmma=kernel:wgmma;wig0=kernel:wgmma,weight_in_gemm2:0;stream2=kernel:wgmma,persistent:-/1,weight_in_gemm2:0;stream 1 only=kernel:wgmma,persistent:-/0;stream 2 only=kernel:wgmma,persistent:0/-;wgmma again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/pergemm.log"
elif [ "$part" = 58 ]; then    # v16, from part 56 (Mixtral 16 tokens: tout at 8-row blocks 227.0 µs, with GEMM2 unsplit
    # too 216.2, against 236.0–236.4): the new defaults (tout wherever the output is 16-bit; the blocked schedule's
    # GEMM2 unsplit in blocks of up to 16 rows) at every decode row they change, A B A against v15's forms (tout:0,
    # split2:2 gives v15's picks at these 8-row rows; at Mixtral 32, 16-row blocks, split2:2 alone). Prediction:
    # Mixtral 16 −15–20 µs, Mixtral 32 −5–15, Qwen3 16 / 64 and DeepSeek-V2-Lite 16 (GEMM2 already unsplit, so
    # the XLA transposes go) −2–6 µs each. Then the new kernel cases (8-row sfold with tout) and the
    # blocked-defaults layer test at Mixtral (16 tokens: the default, and the v15 form), AWQ
    logged "v16" 260 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16 qwen3:16,64 dsv2lite:16 --reps 160 \
        --variants "v16=kernel:wgmma;v15=kernel:wgmma,tout:0,split2:2;v16 again=kernel:wgmma"
    logged "v16m32" 100 python3 benchmarks/moe_engine.py --sweep --rows mixtral:32 --reps 160 \
        --variants "v16=kernel:wgmma;v15=kernel:wgmma,split2:2;v16 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/v16.log" "$OUT/v16m32.log"
    gpu_tests 200 "(bm8 and sfold1 and tout1) or (blocked_defaults and awq and mixtral)"
    grep -E "PASS|FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -12
elif [ "$part" = 59 ]; then    # v16: the 1-token rows now that 8-row GEMMs write [M, N] tiles (tout). Unsplit GEMMs
    # then leave XLA nothing between the two kernels (GEMM1's act(gate)·up rows are GEMM2's input as they are)
    # and a 16-bit [M, N] output to sum: split1 1 / split2 1 lost at 1 token while XLA still transposed (part 35:
    # Qwen3 23.4 / 21.8 against 19.7–20.7 µs). DeepSeek-V2-Lite's GEMM2 (11 steps) is already unsplit, so v16
    # changes it (v15: tout:0). Prediction: Qwen3 and DeepSeek-V2-Lite split1 1 + split2 1 1–3 µs faster than
    # the default; Mixtral (GEMM2 at split 1 would be 64 programs of 56 steps) no better
    logged "decode1" 200 python3 benchmarks/moe_engine.py --sweep --rows qwen3:1 dsv2lite:1 mixtral:1 --reps 160 \
        --variants "v16=kernel:wgmma;v15=kernel:wgmma,tout:0;s2 1=kernel:wgmma,split2:1;s1 1 s2 1=kernel:wgmma,split1:1,split2:1;v16 again=kernel:wgmma"
    # and the alignment by comparing all pairs (align="compare", new: counts, ranks, a cumulative sum and the
    # inverse as reductions — no sort, scatters or search — and each pair's row for the top-k gather, so no
    # scatter there either) at the blocked decode rows. Prediction: 3–5 µs less each (~8 of Mixtral 16 tokens'
    # 14 small XLA kernels were the alignment's and the gather's inverse, part 55)
    logged "align" 170 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 qwen3:64 dsv2lite:16 --reps 160 \
        --variants "v16=kernel:wgmma;compare=kernel:wgmma,align:compare;v16 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/decode1.log" "$OUT/align.log"
elif [ "$part" = 60 ]; then    # v16: the GPU tests of v16's defaults at every decode row they change, every format
    # (test_wgmma_v16_defaults_gpu: Mixtral 16 / 32, Qwen3 16 / 64, DeepSeek-V2-Lite 16 tokens; default and v15's
    # form), and DeepSeek-V2-Lite 1 token, whose unsplit GEMM2 now writes [M, N] tiles (the pair-defaults test)
    gpu_tests 420 "v16_defaults_gpu or (pair_defaults_gpu and dsv2lite)"
    grep -E "PASS|FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -16
elif [ "$part" = 61 ]; then    # v16, from part 59 (align="compare": Qwen3 64 tokens 110.9 µs against 124.8–125.2,
    # DeepSeek-V2-Lite 16 96.4 against 107.2–107.4, Mixtral 16 219.5 against 223.7–224.5): "auto" now compares up
    # to 512 routed pairs. The new default against the sorted alignment (align:sort) at DeepSeek-V2-Lite 64 tokens
    # (384 pairs, not timed before) and again at Qwen3 64 and Mixtral 16. Prediction: DeepSeek-V2-Lite 64 −8–14 µs.
    # Then the v16-defaults GPU tests, whose blocked rows now align by comparing
    logged "auto" 150 python3 benchmarks/moe_engine.py --sweep --rows dsv2lite:64 qwen3:64 mixtral:16 --reps 160 \
        --variants "v16=kernel:wgmma;sort=kernel:wgmma,align:sort;v16 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/auto.log"
    gpu_tests 220 "v16_defaults_gpu"
    grep -E "PASS|FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -12
elif [ "$part" = 62 ]; then    # v16, the session's last ~5 device minutes: (a) Mixtral 1 token with GEMM1 unsplit
    # (split1:1: with v16's tout no XLA pass between the GEMMs; part 45 measured it 5 µs slower while XLA still
    # transposed). Prediction: within ±2 µs. (b) The compared alignment beyond "auto"'s 512 pairs: DeepSeek-V2-Lite
    # 128 tokens (768 pairs, sorted by default) and Qwen3 128 (1024, counted). Prediction: compare 5–10 µs faster
    # at 768 pairs, even at 1024
    logged "m1" 90 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1 --reps 160 \
        --variants "v16=kernel:wgmma;s1 1=kernel:wgmma,split1:1;v16 again=kernel:wgmma"
    logged "cmp128" 130 python3 benchmarks/moe_engine.py --sweep --rows dsv2lite:128 qwen3:128 --reps 80 \
        --variants "v16=kernel:wgmma;compare=kernel:wgmma,align:compare;v16 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/m1.log" "$OUT/cmp128.log"
elif [ "$part" = 63 ]; then    # prepared in v16 for the next session: the v16-defaults GPU test, extended to Qwen3 and
    # DeepSeek-V2-Lite 128 tokens (1024 / 768 routed pairs: the compared alignment that "auto" took over from the
    # count and the sort, GPU-timed in part 62 but not yet GPU-tested), every format
    gpu_tests 300 "v16_defaults_gpu and (qwen3 or dsv2lite)"
    grep -E "PASS|FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -8
elif [ "$part" = 64 ]; then    # prepared in v16 for the next session: the alignment past "auto"'s compare cap, where it
    # counts (_counting_order: a scatter-add per chunk, cumulative sums, a search, the order's scatter, and the layer's
    # own scatter to invert it): (a) "compare" (the inverse's padded rows × pairs: DeepSeek-V2-Lite 256 tokens 1536 pairs
    # 7.0 M, Qwen3 512 41 M, Qwen3 4096 ~1.4 G — left out there); (b) "rank" (new, CPU-tested: per-chunk counts by
    # reduction, ranks, the padded rows, one scatter for the padded list, and each pair's row for the top-k gather — no
    # order scatter, no search, no inverse scatter). Prediction: rank 5–10 µs faster at the 512 / 256-token rows and
    # 5–15 at Qwen3 4096; compare faster at 1536 pairs, slower at 4096. (c) Mixtral 512 tokens (1024 pairs, 2304 padded
    # rows: 2.4 M) is compared by "auto" since v16 without a timing: against the count it replaced. Prediction: ±1%
    logged "align_big" 300 python3 benchmarks/moe_engine.py --sweep --rows dsv2lite:256 qwen3:512 --reps 40 \
        --variants "v16=kernel:wgmma;compare=kernel:wgmma,align:compare;rank=kernel:wgmma,align:rank;v16 again=kernel:wgmma"
    logged "align_m512" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512 --reps 40 \
        --variants "v16=kernel:wgmma;count=kernel:wgmma,align:count;rank=kernel:wgmma,align:rank;v16 again=kernel:wgmma"
    logged "align_4096" 200 python3 benchmarks/moe_engine.py --sweep --rows qwen3:4096 --reps 20 \
        --variants "v16=kernel:wgmma;rank=kernel:wgmma,align:rank;v16 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT"/align_*.log
elif [ "$part" = 65 ]; then    # v17: (a) the GPU layer tests on _table_weights (the helper of v16's last review, never
    # GPU-run) and the v16-defaults test at 128 tokens (part 63's compared alignment at 768 / 1024 pairs), AWQ /
    # GPTQ act-order / GPTQ channelwise; (b) Mixtral 32 / 64 tokens in other block rows. At 64 tokens an expert
    # gets 16 ± 3.7 rows: 32-row ws blocks (one program per SM, 8.0 live), 24-row blocks (8.1 live, no ws, three
    # programs per SM: untimed — BLOCK_M_CHOICES has no 24), 16-row sfold (11.5 live). Prediction: 24-row blocks
    # (plain or sfold) 270–295 µs against 301; 16-row 290–320; 8-row worse (19.5 live blocks)
    gpu_tests 330 "v16_defaults_gpu or decode_layer_gpu or fused_moe_wgmma_gpu_shapes or (pair_defaults_gpu and awq)"
    grep -E "PASS|FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -12
    logged "m64rows" 230 python3 benchmarks/moe_engine.py --sweep --rows mixtral:32,64 --reps 160 \
        --variants "v16=kernel:wgmma;bm24=kernel:wgmma,block_m:24;bm24 sfold=kernel:wgmma,block_m:24,zfold:1;bm24 st3=kernel:wgmma,block_m:24,stages:3;bm16=kernel:wgmma,block_m:16;bm8=kernel:wgmma,block_m:8;v16 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/m64rows.log"
elif [ "$part" = 67 ]; then    # v17, from part 65 (Mixtral 64 tokens: 24-row sfold blocks 285.9 µs against 293.3 /
    # 292.3 for v16's 32-row ws blocks; plain 24-row 310.4; 16-row 331.2; Mixtral 32 tokens: v16's 16-row blocks
    # best). (a) The scale-only fold at 24- and 32-row blocks (three programs per SM instead of one ws program) at
    # Mixtral 64, and at the rows whose 32-row blocks run plain (short streams): DeepSeek-V2-Lite 128, Qwen3 256
    # tokens. Prediction: Mixtral 64 bm32 sfold 280–290 µs; the short-stream rows ±3%. (b) 64-column tiles at
    # Mixtral 1 token: GEMM1 896 programs of 16 steps, 8 per SM (all resident, 6.8 per SM) instead of 896 of 8 at
    # split 2 and 5 per SM (1.4 waves). Prediction: 62–65 µs against 67. (c) Part 63: the v16-defaults GPU test
    # at Qwen3 / DeepSeek-V2-Lite, up to 128 tokens (the compared alignment at 1024 / 768 pairs)
    logged "fold32" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64 --reps 160 \
        --variants "v16=kernel:wgmma;bm24 sfold=kernel:wgmma,block_m:24,zfold:1;bm32 sfold=kernel:wgmma,block_m:32,zfold:1;v16 again=kernel:wgmma"
    logged "fold32s" 150 python3 benchmarks/moe_engine.py --sweep --rows dsv2lite:128 qwen3:256 --reps 80 \
        --variants "v16=kernel:wgmma;bm24 sfold=kernel:wgmma,block_m:24,zfold:1;bm32 sfold=kernel:wgmma,block_m:32,zfold:1;v16 again=kernel:wgmma"
    logged "bn64" 80 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1 --reps 160 \
        --variants "v16=kernel:wgmma;bn64=kernel:wgmma,block_n:64;bn64 s2 4=kernel:wgmma,block_n:64,split2:4;v16 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT"/fold32*.log "$OUT/bn64.log"
    gpu_tests 210 "v16_defaults_gpu and (qwen3 or dsv2lite)"
    grep -E "PASS|FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -8
elif [ "$part" = 68 ]; then    # v17, from part 67: the new default (FOLD_ROWS = 24: a 32-row pick becomes 24 rows with
    # the scale-only fold where those are at most 3% more blocks) — (a) its GPU tests (test_wgmma_v17_defaults_gpu at
    # Mixtral 64, Qwen3 256, DeepSeek-V2-Lite 128 tokens, every format, and v16's 32-row form; the 24-row sfold kernel
    # cases); (b) A B A against v16 (block_m:32) at those rows. Prediction: as part 67 (−4%, −9%, −14%);
    # (c) Mixtral 512 tokens, compared by "auto" since v16 without a timing, against the count. Prediction: ±1%
    gpu_tests 250 "v17_defaults_gpu or (bm24 and sfold1)"
    grep -E "PASS|FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -14
    logged "v17" 140 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64 dsv2lite:128 qwen3:256 --reps 80 \
        --variants "v17=kernel:wgmma;v16=kernel:wgmma,block_m:32;v17 again=kernel:wgmma"
    logged "align_m512" 120 python3 benchmarks/moe_engine.py --sweep --rows mixtral:512 --reps 20 \
        --variants "auto=kernel:wgmma;count=kernel:wgmma,align:count;auto again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/v17.log" "$OUT/align_m512.log"
elif [ "$part" = 69 ]; then    # v17, the session's last device minutes, from parts 67/68 (24-row sfold blocks beat 32-row
    # ones with or without the fold): (a) ptxas's registers and spills of the sfold GEMM at 24 and 32 rows (three
    # programs per SM by shared memory at both: is 32 rows over the 170 registers three need?); (b) Qwen3 512 tokens
    # (an expert's rows 32 ± 5.5: 48-row ws-stream blocks, 128.4 live) in folded 24- / 32-row blocks (~250 / ~187
    # live, sibling blocks reading the same weight tiles at once, through L2). Prediction: both slower (≥ 240 µs
    # against 210–225); (c) Mixtral 64 tokens' 24-row GEMM2 (260 live programs, 2 per SM) with a K split of 2.
    # Prediction: ±3%
    logged "ptxas" 110 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 24 32 --only "bn128 st2 kpb2 wide shift32 sfold"
    grep -E "^mixtral1|registers|spill|rc " "$OUT/ptxas.log" | head -20
    logged "q512fold" 130 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 --reps 40 \
        --variants "v17=kernel:wgmma;bm24 sfold=kernel:wgmma,block_m:24;bm32 sfold=kernel:wgmma,block_m:32,zfold:1;v17 again=kernel:wgmma"
    logged "m64s2" 90 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64 --reps 80 \
        --variants "v17=kernel:wgmma;s2 2=kernel:wgmma,split2:2;v17 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/q512fold.log" "$OUT/m64s2.log"
elif [ "$part" = 70 ]; then    # v17: part 64's "rank" alignment past "auto"'s compare cap (more than 1024 pairs, where
    # it counts), the Qwen3 rows first (512 tokens is the furthest from its target). Prediction: rank 5–10 µs faster
    # at Qwen3 512 and DeepSeek-V2-Lite 256, 5–15 at Qwen3 4096
    logged "rank" 170 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512 dsv2lite:256 --reps 40 \
        --variants "auto=kernel:wgmma;rank=kernel:wgmma,align:rank;auto again=kernel:wgmma"
    logged "rank4096" 120 python3 benchmarks/moe_engine.py --sweep --rows qwen3:4096 --reps 10 \
        --variants "auto=kernel:wgmma;rank=kernel:wgmma,align:rank;auto again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/rank.log" "$OUT/rank4096.log"
elif [ "$part" = 71 ]; then    # prepared in v17 for the next session: registers per thread of the default kernel forms
    # (part 69: the folding GEMM 166 at 24 rows, 193 at 32 — two 128-thread programs per SM by registers where shared
    # memory holds three). 8- / 16- / 24-row sfold (the decode blocks: 5 / 4 / 3 per SM by shared memory), 48-row
    # plain (Qwen3 512's v12 form), 32-row ws; then where the ranked alignment's time goes (one profiled call)
    logged "ptxas" 240 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 8 16 24 48 \
        --only "bn128 st2 kpb2 wide shift32 sfold" "bn128 st2 kpb2 wide shift32" "bn128 st3 kpb2 wide shift32 ws"
    grep -E "^mixtral1|registers|spill|rc " "$OUT/ptxas.log" | head -60
    logged "rank_profile" 120 python3 benchmarks/moe_engine.py --sweep --profile --rows qwen3:512 --reps 10 \
        --variants "rank=kernel:wgmma,align:rank;count=kernel:wgmma,align:count"
    tail -60 "$OUT/rank_profile.log"
    # and Qwen3 256 tokens' 24-row GEMM2 (3 steps: a 3-deep ring, 90.5 KB, two programs per SM by shared memory
    # though registers allow three) at 2 stages (~60 KB, three per SM). Prediction: 2–5% faster
    logged "q256st2" 100 python3 benchmarks/moe_engine.py --sweep --rows qwen3:256 --reps 80 \
        --variants "v17=kernel:wgmma;st2=kernel:wgmma,stages:2;v17 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/q256st2.log"
elif [ "$part" = 72 ]; then    # prepared in v17 for the next session: the model-shape layer tests through fused_moe on
    # every format the table takes on a GPU, 8-bit included (compressed-tensors 8-bit, GPTQ 8-bit channelwise), not
    # GPU-run since the v14-era part 44 (one format) — the alignment changed since (v16's compare)
    gpu_tests 560 "fused_moe_gpu_shapes"
    grep -E "PASS|FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -22
elif [ "$part" = 73 ] || [ "$part" = 74 ] || [ "$part" = 75 ]; then    # prepared in v17: the rest of a full GPU test
    # run at one commit, with part 72 (no full run has been made: ~104 kernel cases and ~67 layer tests, ~90 s per
    # layer test and worker) — 73: every wgmma kernel case; 74: the layer on the table's weights (all options per
    # regime), the one-kernel decode layer, the pair defaults; 75: the blocked, v16, v17 and combine="add" defaults,
    # and the prefill / batched / backward test
    case "$part" in
        73) k="wgmma_grouped_gemm_gpu" ;;
        74) k="fused_moe_wgmma_gpu_shapes or decode_layer_gpu or pair_defaults_gpu" ;;
        *) k="blocked_defaults_gpu or v16_defaults_gpu or v17_defaults_gpu or combine_add_gpu or gpu_prefill" ;;
    esac
    gpu_tests 570 "$k"
    grep -E "FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -22
elif [ "$part" = 76 ]; then    # v18: the whole GPU suite (183 tests) in one call at one commit, 14 workers on the
    # machine's 16 cores (parts 72-75 planned four calls at 4 workers, ~90 s per layer test and worker, most of it
    # compiling and, before _dot64, the host float64 reference); the slowest 40 listed. Its limit cut it off after
    # 160 passes: part 78 ran what had not finished (from $OUT/finished.txt, the finished node ids), part 79 the rest
    WORKERS=14 PYTEST_EXTRA="--durations=40" gpu_tests 585 "gpu"
    grep -E "FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -30
    grep -oE "(PASSED|FAILED|ERROR) tests/[^ ]+" "$OUT/tests.log" | awk '{print $2}' | sort > "$OUT/finished.txt"
    wc -l "$OUT/finished.txt"
elif [ "$part" = 77 ]; then    # ran in v18 (lazy was then removed: ptxas compiled the same PTX with and
    # without it, the same registers, and it was no faster) — v18: lazy=True, each fold K-block dequantized just
    # before its own wgmmas (half a 256-deep step's register operands live at once), A B A at the folding rows (its GPU cases and ptxas: part 78).
    # Prediction: faster (3-8%) only where fewer registers lift a register limit below the shared-memory one (the 8-
    # and 16-row forms: Mixtral 16 / 32 tokens, Qwen3 64, DeepSeek-V2-Lite 16), else within ±2%. And Qwen3 256
    # tokens' 24-row GEMM2 (3 steps, a 3-deep ring: 90.5 KB, two programs per SM) at 2 stages (~60 KB, three).
    # Prediction: 2-5% faster
    logged "lazy" 270 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,32,64 qwen3:64,256 dsv2lite:16 \
        --reps 80 --variants "v17=kernel:wgmma;lazy=kernel:wgmma,lazy:1;v17 again=kernel:wgmma"
    logged "q256st2" 70 python3 benchmarks/moe_engine.py --sweep --rows qwen3:256 --reps 80 \
        --variants "v17=kernel:wgmma;st2=kernel:wgmma,stages:2;v17 again=kernel:wgmma"
    grep -E "^##|floor  rel|rc |FAIL|rror" "$OUT/lazy.log" "$OUT/q256st2.log"
elif [ "$part" = 78 ]; then    # ran in v18 (its lazy cases and variant no longer exist) — v18: the 23 GPU
    # tests part 76 (160 passed, none failed) did not reach before its limit (layer tests: the combine="add", blocked, v16, v17 defaults, two shape tests, the prefill/backward test),
    # and lazy=True's three kernel cases; then ptxas at 8 / 16 / 24 rows, sfold with and without lazy (v17: 125 / ? /
    # 166 registers; shared memory holds 5 / 4 / 3 programs per SM). Prediction: lazy 10-30 registers fewer
    T=tests/test_pallas_engine.py
    ids=(
        "$T::test_fused_moe_wgmma_gpu_shapes[awq_g128-dsv2lite]"
        "$T::test_fused_moe_wgmma_gpu_shapes[gptq4_channel-mixtral]"
        "$T::test_gpu_prefill_batched_and_backward_qwen3"
        "$T::test_wgmma_blocked_defaults_gpu[awq_g128-dsv2lite]"
        "$T::test_wgmma_blocked_defaults_gpu[awq_g128-qwen3]"
        "$T::test_wgmma_blocked_defaults_gpu[gptq4_g128_actorder-mixtral]"
        "$T::test_wgmma_blocked_defaults_gpu[gptq4_g128_actorder-qwen3]"
        "$T::test_wgmma_combine_add_gpu[awq_g128-dsv2lite]"
        "$T::test_wgmma_combine_add_gpu[awq_g128-mixtral]"
        "$T::test_wgmma_combine_add_gpu[awq_g128-qwen3]"
        "$T::test_wgmma_combine_add_gpu[gptq4_channel-dsv2lite]"
        "$T::test_wgmma_combine_add_gpu[gptq4_channel-mixtral]"
        "$T::test_wgmma_combine_add_gpu[gptq4_channel-qwen3]"
        "$T::test_wgmma_combine_add_gpu[gptq4_g128_actorder-dsv2lite]"
        "$T::test_wgmma_combine_add_gpu[gptq4_g128_actorder-mixtral]"
        "$T::test_wgmma_combine_add_gpu[gptq4_g128_actorder-qwen3]"
        "$T::test_wgmma_v16_defaults_gpu[awq_g128-dsv2lite]"
        "$T::test_wgmma_v16_defaults_gpu[gptq4_g128_actorder-dsv2lite]"
        "$T::test_wgmma_v17_defaults_gpu[awq_g128-qwen3]"
        "$T::test_wgmma_v17_defaults_gpu[gptq4_channel-mixtral]"
        "$T::test_wgmma_v17_defaults_gpu[gptq4_channel-qwen3]"
        "$T::test_wgmma_v17_defaults_gpu[gptq4_g128_actorder-dsv2lite]"
        "$T::test_wgmma_v17_defaults_gpu[gptq4_g128_actorder-qwen3]"
        "$T::test_wgmma_grouped_gemm_gpu[w16-zp1-g128-bm24-s1-block_n128-kpb2-wide1-shift321-sfold1-lazy1-out161-tout1-gatedsilu-stages2-k2048]"
        "$T::test_wgmma_grouped_gemm_gpu[w16-zp0-g128-bm16-s2-block_n128-kpb2-wide1-shift321-sfold1-lazy1-stages2-k2048]"
        "$T::test_wgmma_grouped_gemm_gpu[w16-zp1-g-1-bm8-s1-block_n128-kpb2-wide1-shift321-zfold1-lazy1-out161-tout1-rs1]"
    )
    logged tests 400 python3 -m pytest -v -m gpu "${ids[@]}" -n 13 -p no:cacheprovider --tb=short -rfE \
        --durations=30
    grep -E "FAIL|ERROR|passed|failed|rc " "$OUT/tests.log" | tail -30
    logged "ptxas" 170 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 8 16 24 \
        --only "bn128 st2 kpb2 wide shift32 sfold"
    grep -E "^mixtral1|registers|spill|rc " "$OUT/ptxas.log" | head -40
elif [ "$part" = 79 ]; then    # v18: the four GPU layer tests parts 76 and 78 did not finish (182 passed, none
    # failed): the slowest, each alone on a worker
    T=tests/test_pallas_engine.py
    logged tests 390 python3 -m pytest -v -m gpu -n 4 -p no:cacheprovider --tb=short -rfE --durations=10 \
        "$T::test_fused_moe_wgmma_gpu_shapes[gptq4_channel-mixtral]" "$T::test_wgmma_combine_add_gpu[awq_g128-qwen3]" \
        "$T::test_wgmma_combine_add_gpu[gptq4_g128_actorder-dsv2lite]" \
        "$T::test_wgmma_combine_add_gpu[gptq4_g128_actorder-qwen3]"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -20
elif [ "$part" = 80 ] || [ "$part" = 81 ]; then    # prepared in v18: the whole GPU suite (183) in two calls at 14
    # workers — 80: the kernel cases, the shape tests, the decode layer and the pair defaults (137; part 76 ran them
    # and 23 more inside its 585 s); 81: the other 46 layer tests (the 23 of them part 76 left took 400 + 224 s in
    # parts 78 / 79), now with the float64 reference's rows padded to powers of two (one dot compile per
    # power of two, not per expert row count). Prediction: each call 5-8 minutes
    k="grouped_gemm_gpu or fused_moe_gpu_shapes or decode_layer_gpu or pair_defaults_gpu"
    [ "$part" = 81 ] && k="not ($k)"
    WORKERS=14 PYTEST_EXTRA="--durations=25" gpu_tests 585 "$k"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -34
elif [ "$part" = 82 ]; then    # v19: what of part 80 fits the session's last minutes — the decode-layer, pair-default
    # and Triton-engine shape tests (33) on main as it stands (part 81 ran the other layer tests: 46 passed)
    WORKERS=14 PYTEST_EXTRA="--durations=10" gpu_tests 270 "fused_moe_gpu_shapes or decode_layer_gpu or pair_defaults_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -20
elif [ "$part" = 83 ]; then    # prepared in v19: why Mixtral 64 tokens (24-row fold blocks, 275-295 µs, 1.58-1.69x) is
    # 55-75 µs slower than 16 tokens (8-row, 214-220 µs) for the same bytes (all 8 experts once). The folding GEMMs
    # alone at 8 / 16 / 24 rows, one block per expert (the same weights), then Nsight Compute's stall reasons for the
    # 24-row GEMM1 against part 52's 8-row one (136.5 µs, 77% of DRAM, long-scoreboard). Prediction: GEMM1 8 rows
    # 136-145 µs, 16 rows 145-160, 24 rows 160-180 (3 programs per SM at 166 registers, 12 warps, against 5 at 8 rows);
    # at 24 rows DRAM under 70% and the stalls shifted from long-scoreboard towards wgmma waits and math/dispatch
    V="bn128 st2 kpb2 wide shift32 sfold s1"
    logged "gemm_rows" 200 python3 benchmarks/gemm_kernels.py --gemms mixtral1 mixtral2 --block-m 8 16 24 --reps 20 \
        --only "$V" "bn128 st4 shift32 sfold s1" "bn128 st3 shift32 sfold s1"
    grep -E "^\| m|rc |rror|WRONG|FAIL" "$OUT/gemm_rows.log" | sort -u
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --print-details all"
    M="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
    logged "ncu_mixtral1_bm24" 120 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 1 $S $M \
        python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m 24 --reps 1 --only "$V"
    grep -E "==ERROR|Duration|DRAM Throughput|Achieved Occupancy|Block Limit|Registers Per|Issued Warp|No Eligible|issue_stalled|rc " \
        "$OUT/ncu_mixtral1_bm24.log" | head -60
elif [ "$part" = 84 ]; then    # v20: where the unmet rows' time goes now (JAX profiler, kernel by kernel: Mixtral 1 / 64
    # tokens, Qwen3 512 / 4096), and Mixtral 64 tokens' 24-row fold blocks with 128-deep steps (kpb 1: half the A
    # operands and words in registers, more steps in flight per byte of ring) at 3 / 4 stages. Predictions: Mixtral
    # 1 token GEMM1 33-36 µs, GEMM2 17-19, the rest 8-10; Mixtral 64 GEMM1 ~170, GEMM2 ~85, the rest ~20; Qwen3
    # 4096 GEMMs ~650 of ~800; Qwen3 512 GEMMs ~170 of ~220; the kpb-1 rings within ±3% of the default (275-295)
    logged "profile" 240 python3 benchmarks/moe_engine.py --sweep --profile --rows mixtral:1,64 qwen3:512,4096 \
        --reps 10 --variants "wgmma=kernel:wgmma"
    grep -vE "^#|Warning|warn|^ *ref =|^\s*$" "$OUT/profile.log" | head -150
    logged "sweep64" 200 python3 benchmarks/moe_engine.py --sweep --rows mixtral:64 --reps 40 \
        --variants "wgmma=kernel:wgmma;kpb1 st4=kernel:wgmma,wide:0,stages:4;kpb1 st3=kernel:wgmma,wide:0,stages:3;st3=kernel:wgmma,stages:3;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep64.log"
elif [ "$part" = 85 ]; then    # v20: the row-gather kernel (pallas_kernels/row_gather.py: one bulk copy per row, only
    # the rows of pairs in blocks with an expert) — its GPU tests and the blocked layer tests that run it by default,
    # then the layer with it (default) against XLA's gather (row_gather:0), A B A. Prediction (part 84's profile:
    # XLA's gather 74.7 µs at Qwen3 4096 tokens, 13.5 at 512): Qwen3 4096 25-35 µs faster (~790), Qwen3 512 3-8,
    # Mixtral 4096 5-15, the decode rows (Mixtral 64, DeepSeek-V2-Lite 64) within ±2 µs
    WORKERS=14 PYTEST_EXTRA="--durations=8" gpu_tests 250 "row_gather_gpu or blocked_defaults_gpu or combine_add_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -16
    logged "sweep_gather" 300 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512,4096 mixtral:64,4096 \
        dsv2lite:64 --reps 20 --variants "kernel=kernel:wgmma;xla gather=kernel:wgmma,row_gather:0;kernel again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_gather.log"
elif [ "$part" = 86 ]; then    # v20: the layer shape tests on the row-gather default (9), then the Qwen3 prefill rows
    # of the table with the dense bf16 rate (the prefill target) on it. Prediction: Qwen3 4096 780-800 µs against a
    # dense 470-480 (60-61%), Qwen3 512 185-220
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 300 "wgmma_gpu_shapes"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -10
    logged "table_wgmma" 240 python3 benchmarks/moe_engine.py --reps 20 \
        --skip "engine AWQ,engine GPTQ,engine←Marlin,XLA path,ragged_dot bf16,dequant→ragged_dot" \
        --append "$OUT/RESULTS_engine.md" --json "$OUT/results.json" --rows qwen3:512,4096
    grep -E "^\| |rc |rror|peak" "$OUT/table_wgmma.log"
elif [ "$part" = 87 ]; then    # v20: the other layer tests of part 81 on the row-gather default (parts 85 and 86 ran 18
    # and 9 of its 46)
    k="grouped_gemm_gpu or fused_moe_gpu_shapes or decode_layer_gpu or pair_defaults_gpu"
    k="not ($k or blocked_defaults_gpu or combine_add_gpu or wgmma_gpu_shapes or row_gather_gpu)"
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 330 "$k"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -10
elif [ "$part" = 88 ]; then    # prepared in v20: the new default's kernels (the row gather:
    # row_gather_mosaic_gpu_kernel) at Qwen3 512 / 4096 and Mixtral 512 tokens — how long the gather kernel
    # takes, and which of the ~24 small XLA kernels are left (Qwen3 512: 51 µs of glue in v20's profile). Prediction: the gather 40-50 µs at Qwen3 4096
    # (153 MB written), 5-10 at 512; Qwen3 512's glue still 35-45 µs, most of it the alignment's count and scatters
    logged "profile" 240 python3 benchmarks/moe_engine.py --sweep --profile --profile-top 40 \
        --rows qwen3:512,4096 mixtral:512 --reps 10 --variants "wgmma=kernel:wgmma"
    grep -vE "^#|Warning|warn|^ *ref =|^\s*$" "$OUT/profile.log" | head -150
    # and the persistent stream at Mixtral 1 token, never timed there (v13's sweep stopped before the Mixtral
    # rows): GEMM1's 896 programs run 1.36 waves at 5 per SM; a stream of ~4 programs per SM has no tail wave.
    # Prediction: Mixtral 1 token 60-66 µs against 65-66; Qwen3 1 token no faster (v13: 24 against 21)
    logged "sweep1" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1 qwen3:1 --reps 40 \
        --variants "wgmma=kernel:wgmma;pers=kernel:wgmma,persistent:1;pers s4=kernel:wgmma,persistent:1,split1:4;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep1.log"
elif [ "$part" = 89 ]; then    # v21: the "rank" alignment with its pair rows materialized (an optimization
    # barrier: part 88b's profile showed XLA recomputing the rows' two cumulative sums inside the top-k sum for
    # every output element — that fusion 142.5 µs at Qwen3 512 tokens, 1134 at 4096, against 6.9 / 42.7 counted)
    # and its counts read from the cumulative sum (was a 9.6 µs reduction) — A B A against "count" (the default
    # from 1025 pairs). Prediction: Qwen3 512 8-12 µs faster (glue 31.8 µs in 22 small kernels → ~20 in 14),
    # Qwen3 4096 20-30 µs, DeepSeek-V2-Lite 512 5-10, Mixtral 4096 within its spread; the compare rows (the
    # barrier applies there too) no slower than v16/v20 (Qwen3 64 tokens ~111 µs, DeepSeek-V2-Lite 16 ~96)
    logged "profile" 120 python3 benchmarks/moe_engine.py --sweep --profile --profile-top 30 --rows qwen3:512 \
        --reps 10 --variants "rank=kernel:wgmma,align:rank"
    grep -vE "^#|Warning|warn|^ *ref =|^\s*$|host spans|Pjit|PjRt|Execute|XLA GPU module|command_buffer" \
        "$OUT/profile.log" | head -40
    V="count=kernel:wgmma,align:count;rank=kernel:wgmma,align:rank;count again=kernel:wgmma,align:count"
    logged "sweep_rank" 230 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512,4096 dsv2lite:512 --reps 40 \
        --variants "$V"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_rank.log"
    logged "sweep_compare" 90 python3 benchmarks/moe_engine.py --sweep --rows qwen3:64,128 dsv2lite:16 --reps 40 \
        --variants "auto=kernel:wgmma;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_compare.log"
    logged "sweep_mixtral" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:4096 --reps 12 \
        --variants "$V"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_mixtral.log"
elif [ "$part" = 90 ]; then    # v21: the GPU layer tests whose blocked rows "auto" now aligns by "rank" (beyond
    # 1024 routed pairs: Qwen3 256 / 300 / 512 tokens, DeepSeek-V2-Lite 256 / 300) — every format, float64 reference
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 330 \
        "(wgmma_gpu_shapes or blocked_defaults_gpu or v17_defaults_gpu) and not mixtral"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -10
elif [ "$part" = 91 ]; then    # prepared in v21: (a) Mixtral's folding GEMMs at 16 / 24 rows in 64-column tiles
    # (part 83: the 24-row GEMM1 186.0 µs against 138.7 at 8 rows for the same bytes; 166 registers, 3 programs per
    # SM by registers and by shared memory; a 64-column tile halves the accumulator and the dequantized operand
    # per thread, and the ring per program). Prediction: GEMM1 24 rows 150-165 µs (4-5 programs per SM), 16 rows
    # 145-155; GEMM2 within ±5% of the 128-column tiles. (b) the layer with 64-column tiles at Mixtral 16 / 64
    # tokens (GEMM1 then leaves the activation to XLA: the gated epilogue needs 128-column tiles). Prediction: 64
    # tokens 10-30 µs faster if (a) holds, 16 tokens no faster. (c) the v21 default's profile at Qwen3 512 tokens
    # with its HLO (the 14 small kernels left; notes.md v21)
    logged "gemm_bn64" 200 python3 benchmarks/gemm_kernels.py --gemms mixtral1 mixtral2 --block-m 16 24 --reps 20 \
        --only "bn64 st2 kpb2 wide shift32 sfold s1" "bn64 st4 kpb2 wide shift32 sfold s1" \
        "bn128 st2 kpb2 wide shift32 sfold s1"
    grep -E "^\| m|rc |rror|WRONG|FAIL" "$OUT/gemm_bn64.log" | sort -u
    logged "sweep_bn64" 150 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 --reps 40 \
        --variants "wgmma=kernel:wgmma;bn64=kernel:wgmma,block_n:64;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_bn64.log"
    logged "profile" 100 python3 benchmarks/moe_engine.py --sweep --profile --profile-top 30 --rows qwen3:512 \
        --reps 10 --variants "wgmma=kernel:wgmma" --dump-hlo "$OUT/hlo"
    grep -vE "^#|Warning|warn|^ *ref =|^\s*$|host spans|Pjit|PjRt|Execute|XLA GPU module|command_buffer" \
        "$OUT/profile.log" | head -30
elif [ "$part" = 92 ]; then    # prepared in v21: the Qwen3 prefill rows of the table on the v21 default (rank
    # alignment), with the dense bf16 rate. Prediction: Qwen3 512 190-205 µs, 4096 745-775 (v20: 214 / 808)
    wgmma_table 300 qwen3:512,4096 --reps 20
    grep -E "^\| |rc |rror|peak" "$OUT/table_wgmma.log"
elif [ "$part" = 93 ]; then    # prepared in v22: clusters of column tiles multicasting each step's token rows
    # (`cluster`). Part 91: halving the column tile doubled the rows' share of the copies and cost in proportion —
    # Mixtral GEMM1 16 rows 152.5 → 207.9-212.7 µs, 24 rows 184.5 → 253.5-265.3 — so the copies from L2 (weights
    # plus every program's re-read of its block's rows) set these GEMMs' time, not registers or occupancy. A
    # cluster of 2 reads the rows once per 2 programs. (a) correctness: the kernel cases (plain, fold, ws, the ws
    # stream) and the layer cases with clusters; (b) the fold GEMMs alone. Part 95 times the layer. Prediction:
    # GEMM1 24 rows 140-155 µs (184.5), 16 rows 130-140 (152.5), 8 rows 128-136 (138.7); GEMM2 24 rows 75-85
    # (93.6); cl4 at 16 rows 125-135
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 330 "cluster"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
    logged "gemm_cluster" 190 python3 benchmarks/gemm_kernels.py --gemms mixtral1 mixtral2 --block-m 8 16 24 --reps 20 \
        --only "bn128 st2 kpb2 wide shift32 sfold s1" "bn128 st2 kpb2 wide shift32 sfold cl2 s1" \
        "bn128 st3 kpb2 wide shift32 sfold cl2 s1" "bn128 st2 kpb2 wide shift32 sfold cl4 s1"
    grep -E "^\| m|rc |rror|WRONG|FAIL" "$OUT/gemm_cluster.log" | sort -u
elif [ "$part" = 95 ]; then    # prepared in v22: the layer with clusters of 2, A B A. Prediction: Mixtral 64 tokens
    # 225-250 µs (282), 16 tokens 195-205 (211), 1 token 64-70 (66-68: small rows, and the XLA transpose of the rows
    # costs a launch), Qwen3 64 100-110 (111), DeepSeek-V2-Lite 16 within ±5; where ws runs (the rows split along
    # their 8-row tiles, no transpose): Qwen3 512 (the ws stream, 48-row items copying 0.75 bytes of rows per weight
    # byte) 185-200 (209-216), Mixtral 512 and Qwen3 4096 (144-row ws blocks, 128-deep steps: 2.25 bytes of rows per
    # weight byte, but nearer the math rate: 69% / 63% of the dense rate) 0-10% faster
    logged "sweep_cluster" 230 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16,64 qwen3:64 dsv2lite:16 \
        --reps 40 --variants "wgmma=kernel:wgmma;cl2=kernel:wgmma,cluster:2;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_cluster.log"
    logged "sweep_cluster_ws" 250 python3 benchmarks/moe_engine.py --sweep --rows qwen3:512,4096 mixtral:512 \
        --reps 10 --variants "wgmma=kernel:wgmma;cl2=kernel:wgmma,cluster:2;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_cluster_ws.log"
elif [ "$part" = 96 ]; then    # prepared in v22, for after part 93: what a cluster changes in the 24-row GEMM1 —
    # Nsight Compute on the unclustered and the clustered kernel (one launch each): L2 and DRAM throughput, the
    # bytes L2 serves (lts__t_bytes), occupancy and the stall reasons. Prediction (the bytes model): L2 bytes
    # ~1.75 → ~1.375 × the weights' with the cluster, DRAM throughput up in proportion to the speedup
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --print-details all"
    M="--metrics lts__t_bytes.sum,dram__bytes_read.sum,regex:smsp__average_warps_issue_stalled_(long_scoreboard|barrier|wait|math).*_per_issue_active\.ratio"
    for V in "bn128 st2 kpb2 wide shift32 sfold s1" "bn128 st2 kpb2 wide shift32 sfold cl2 s1"; do
        tag=$(echo "$V" | grep -q cl2 && echo cl2 || echo base)
        logged "ncu_$tag" 130 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 1 $S $M \
            python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m 24 --reps 1 --only "$V"
        grep -E "==ERROR|Duration|DRAM Throughput|L2 Cache Throughput|lts__t_bytes|dram__bytes|Achieved Occupancy|Cluster|issue_stalled|rc " \
            "$OUT/ncu_$tag.log" | head -30
    done
elif [ "$part" = 101 ]; then   # ran in v24 (by hand, two calls: 24 and 8 rows, then 16); prepared in v24: what limits the fold GEMM as its blocks grow (8 → 16 → 24 rows:
    # Mixtral GEMM1 147 → 154 → 185 µs). Two accounts have each missed one resource (v23: bytes into an SM; v24:
    # block_n=256 lost with 2 programs per SM by registers). Nsight Compute, one launch per block size: issue-slot
    # use, pipe use (ALU / FMA / tensor), instructions, warps per scheduler, stall reasons. Prediction: if the
    # dequantization's ALU work limits (3 warpgroups per SM), issue slots ~70%+ busy at every size and the
    # instructions grow with the rows only by the fold (~+20% from 8 to 24); if the copies do, issue use well below
    # that and long-scoreboard / barrier stalls grow with the rows
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy"
    S="$S --section WarpStateStats --section SchedulerStats --section LaunchStats --print-details all"
    V="bn128 st2 kpb2 wide shift32 sfold s1"
    for bm in 8 16 24; do
        logged "ncu_bm$bm" 130 "$NCU" --target-processes all --clock-control none -k regex:mosaic_gpu -c 1 $S \
            python3 benchmarks/gemm_kernels.py --gemms mixtral1 --block-m $bm --reps 1 --only "$V"
        grep -E "==ERROR|Duration|Issue Slots Busy|Issued Ipc|Executed Instructions |Pipe|Registers Per|Achieved Occ|Active Warps Per|Eligible Warps|No Eligible|Stall|rc " \
            "$OUT/ncu_bm$bm.log" | head -40
    done
elif [ "$part" = 102 ]; then   # prepared in v24: token_rows (the pair schedule's GEMM1 reads one 8-row block per
    # token, the kernel's a_div = k, so the XLA spread before it writes k x fewer rows). (a) the kernel's a_div cases
    # (4 with 32-bit words) and the layer test (9), with the pair defaults (9) beside them; (b) A B A at the pair
    # rows and a profile. Prediction: the spread kernel 1.6 -> ~1.0 us (Qwen3 1 token), 2.6 -> ~1.5 (Mixtral 1);
    # layer Qwen3 1 / DeepSeek-V2-Lite 1 0.5-1 us faster, Mixtral 1 0.5-1.5, Qwen3 16 tokens (4 MB spread -> 0.5 MB)
    # 1-2; GEMM1 unchanged (the k pairs' blocks read their token's rows through L2)
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 240 "a_div or token_rows_gpu or pair_defaults_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
    logged "sweep_token_rows" 260 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1 qwen3:1,16 dsv2lite:1 \
        --reps 40 --variants "wgmma=kernel:wgmma;token rows=kernel:wgmma,token_rows:1;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_token_rows.log"
    logged "profile_token_rows" 120 python3 benchmarks/moe_engine.py --sweep --profile --profile-top 8 \
        --rows qwen3:1,16 --reps 10 --variants "wgmma=kernel:wgmma;token rows=kernel:wgmma,token_rows:1"
    grep -E "^##|^  [a-z]|µs  ×1|rc " "$OUT/profile_token_rows.log" | grep -v host
elif [ "$part" = 103 ]; then   # prepared in v24, from part 101 (the decode fold is latency-bound with 3-4 warps per
    # scheduler, registers holding 16-24-row blocks to 3 programs per SM): the scale-only fold in ws programs — two
    # compute warpgroups sharing each step's row tile plus a copy warpgroup. (a) the kernel's GPU cases (4 new) and
    # the layer test with ws=True (9); (b) ptxas: registers per thread (a ws program of 64-column warpgroups needs
    # ~100 or fewer for 2 programs per SM, i.e. 4 compute warpgroups against the plain kernel's 3); (c) the GEMMs at
    # 8/16/24 rows against the plain fold; (d) the layer. Prediction: if 2 ws programs fit per SM, Mixtral GEMM1 at
    # 24 rows 140-155 us (185), 16 rows 135-145 (154); if one, slower than the plain fold (2 compute warpgroups);
    # the layer follows its GEMMs (Mixtral 64 tokens 230-250 with bn64, GEMM1's activation then in XLA)
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 240 "(grouped_gemm_gpu and ws1 and sfold1) or ws_fold_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
    logged "ptx" 120 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 16 24 \
        --only "bn64 st2 kpb2 wide shift32 sfold ws" "bn128 st2 kpb2 wide shift32 sfold ws" "bn128 st2 kpb2 wide shift32 sfold"
    grep -E "^mixtral1|registers|spill|rc " "$OUT/ptx.log" | head -40
    logged "gemm_wsfold" 240 python3 benchmarks/gemm_kernels.py --gemms mixtral1 mixtral2 --block-m 8 16 24 --reps 20 \
        --only "bn128 st2 kpb2 wide shift32 sfold s" "bn64 st2 kpb2 wide shift32 sfold ws" \
        "bn64 st3 kpb2 wide shift32 sfold ws" "bn128 st2 kpb2 wide shift32 sfold ws"
    grep -E "^\| m|rc |rror|WRONG|FAIL" "$OUT/gemm_wsfold.log" | sort -u
    logged "sweep_wsfold" 200 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 qwen3:64 --reps 40 \
        --variants "wgmma=kernel:wgmma;ws fold=kernel:wgmma,ws:1;ws fold bn64=kernel:wgmma,ws:1,block_n:64;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_wsfold.log"
elif [ "$part" = 104 ]; then   # v25 (run by hand): after part 103, the fold on ws at the rows whose default blocks
    # are 24 rows (Mixtral 48 / 64 tokens: K streams of 32 / 112 K-blocks; Qwen3 256, DeepSeek-V2-Lite 128: 16 / 6
    # and 16 / 11), A B A B; and token_rows' device time per kernel at Mixtral 1 and DeepSeek-V2-Lite 1 / 16 tokens
    logged "sweep_wsfold2" 300 python3 benchmarks/moe_engine.py --sweep --rows mixtral:48,64 qwen3:256 dsv2lite:128 \
        --reps 40 --variants "wgmma=kernel:wgmma;ws fold=kernel:wgmma,ws:1;again=kernel:wgmma;ws fold again=kernel:wgmma,ws:1"
    grep -E "^##|µs|rror|rc " "$OUT/sweep_wsfold2.log"
    logged "prof_tr2" 200 python3 benchmarks/moe_engine.py --sweep --profile --profile-top 9 --rows mixtral:1 \
        dsv2lite:1,16 --reps 10 --variants "wgmma=kernel:wgmma;token rows=kernel:wgmma,token_rows:1"
    grep -E "^##|^  [a-z]|µs  ×1|rc " "$OUT/prof_tr2.log" | grep -vE "host|Execute|XLA GPU|command_buffer"
elif [ "$part" = 105 ]; then   # v25: the new default (24-row scale-only fold blocks streaming 32+ K-blocks on ws):
    # the v17-defaults GPU test (Mixtral 48 / 64 tokens now on ws) with the ws-fold test, and the table rows
    # against ws=False (v24's default there). Prediction: Mixtral 48 / 64 10-15 µs faster, the others unchanged
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 200 "v17_defaults_gpu or ws_fold_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
    logged "sweep_v25" 200 python3 benchmarks/moe_engine.py --sweep --rows mixtral:48,64 --reps 40 \
        --variants "default=kernel:wgmma;v24 (ws off)=kernel:wgmma,ws:0;again=kernel:wgmma"
    grep -E "^##|µs|rror|rc " "$OUT/sweep_v25.log"
elif [ "$part" = 110 ] || [ "$part" = 111 ]; then   # v27: the closing table on main (110: Mixtral, 111: Qwen3
    # and DeepSeek-V2-Lite), every alternative the issue names (the wgmma engine on AWQ and GPTQ, the project's XLA path,
    # ragged_dot on bf16 weights, dequantize-then-ragged_dot) and the same-run dense bf16 rate; the Triton-lowered
    # engine's columns and engine<-Marlin (v19 / v22 tables) are left out to fit the device time
    rows=$([ "$part" = 110 ] && echo "mixtral" || echo "qwen3 dsv2lite")
    logged "table_full" 570 python3 benchmarks/moe_engine.py --rows $rows --reps 40 \
        --skip "engine AWQ,engine GPTQ,engine←Marlin" \
        --append "$OUT/RESULTS_engine.md" --json "$OUT/results.json"
    grep -E "^\| |rc |rror" "$OUT/table_full.log"
elif [ "$part" = 107 ]; then   # v26: the GPU layer tests on the shared helper (v26 refactor) that part 106 left out
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 300 \
        "blocked_defaults_gpu or v16_defaults_gpu or cluster_gpu or combine_add_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
elif [ "$part" = 109 ]; then   # v26: the ring depth per GEMM (stages as a pair). At Mixtral 1 token GEMM2 runs 256
    # programs (64 tiles x split 4, 14 steps each), about 2 per SM, at 2 stages: 64 KB in flight per SM, about what
    # 4.3 TB/s needs at ~2 us of latency (32.6 GB/s per SM x 2 us = 65 KB); its 20.7 us are 1.43x its bytes' time
    # (GEMM1, 4 programs per SM: 1.31x). Prediction: GEMM2 with 4 stages 16-18 us, the layer 67 -> 63-65 us; both GEMMs
    # at 4 stages (GEMM1 then 3 programs per SM by shared memory) no better than GEMM2 alone; Mixtral 16 tokens
    # (8-row blocks, ~4 programs per SM) flat or slower; Mixtral 64 (24-row ws, one program per SM) within +-2%
    logged "sweep_stages" 330 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16,64 --reps 40 \
        --variants "wgmma=kernel:wgmma;gemm2 st4=kernel:wgmma,stages:-/4;st4=kernel:wgmma,stages:4;again=kernel:wgmma"
    grep -E "^##|µs|rror|rc " "$OUT/sweep_stages.log"
    logged "prof_stages" 150 python3 benchmarks/moe_engine.py --sweep --profile --profile-top 6 --rows mixtral:1 \
        --reps 10 --variants "wgmma=kernel:wgmma;gemm2 st4=kernel:wgmma,stages:-/4;gemm2 st3=kernel:wgmma,stages:-/3"
    grep -E "^##|^  [a-z]|µs  ×1|rc " "$OUT/prof_stages.log" | grep -vE "host|Execute|XLA GPU|command_buffer"
elif [ "$part" = 108 ]; then   # v26: combine="add" against the bound of its bf16 top-k sum (part 107: 1.59e-2 at Qwen3
    # 64 tokens against the 1.5e-2 of a float32 sum)
    WORKERS=9 PYTEST_EXTRA="--durations=5" gpu_tests 240 "combine_add_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
elif [ "$part" = 106 ]; then   # ran in v26 (half_tiles / unit_wait were removed after it: slower or flat, notes.md v26;
    # it no longer runs). v26: the decode fold with fewer registers (part 101: latency-bound with 3-4 warps
    # per scheduler; 16-row blocks held to 3 programs per SM by 143 registers where shared memory holds 4, 8-row
    # blocks to 4 by 127 where it holds 5). half_tiles: the wide words as one 64-byte-swizzled tile per K-block, each
    # loaded just before its K-block (the second K-block's 16 registers no longer live through the first);
    # unit_wait: each 64-deep unit's wgmmas waited for before the next unit is dequantized (32 registers of
    # operands live instead of 64). (a) ptxas; (b) the kernel's GPU cases (11 runs) and the GPU layer tests on the
    # new shared helper (v26 refactor; the rest in part 107); (c) the GEMMs. Prediction, registers (8 / 16 / 24
    # rows): half ~111 / 127 / 150, uw ~95 / 111 / 134, both ~80 / 95 / 118; GEMMs: 16 rows at 4 programs per SM
    # like today's 8-row blocks (Mixtral GEMM1 ~146 against ~154), 8 rows +0-5% faster if 5 fit (uw may cost its
    # serial wait), 24 rows within +-3% (shared memory holds 3 there); the 64-byte TMA rows could cost 0-5%
    V="wgmma i16 bn128 st2 kpb2 wide shift32 sfold"
    logged "ptx" 150 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 8 16 24 --exact --only \
        "bn128 st2 kpb2 wide shift32 sfold" "bn128 st2 kpb2 wide shift32 sfold half" \
        "bn128 st2 kpb2 wide shift32 sfold uw" "bn128 st2 kpb2 wide shift32 sfold half uw"
    grep -E "^mixtral1|registers|spill|rc " "$OUT/ptx.log" | head -40
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 230 "(grouped_gemm_gpu and (half_tiles1 or unit_wait1)) or \
pair_defaults_gpu or ws_fold_gpu or v17_defaults_gpu or decode_layer_gpu or token_rows_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
    logged "gemm_regs" 200 python3 benchmarks/gemm_kernels.py --gemms mixtral1 mixtral2 --block-m 8 16 24 --reps 20 \
        --exact --only "$V s1" "$V half s1" "$V uw s1" "$V half uw s1"
    grep -E "^\| m|rc |rror|WRONG|FAIL" "$OUT/gemm_regs.log" | sort -u
elif [ "$part" = 94 ]; then    # prepared in v22: the GPU tests not run on main since the row-gather kernel and the
    # rank alignment (v20, v21): combine_add (9), the v16 defaults (9), the row gather (4), the batched prefill and
    # backward (1); and DeepSeek-V2-Lite 1 / 16 tokens A B A against the XLA row gather (the v22 table had them 3-11 µs
    # slower than v19 and v21's sweep)
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 300 \
        "combine_add_gpu or v16_defaults_gpu or row_gather_gpu or prefill_batched_and_backward"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
    logged "sweep_dsv2" 110 python3 benchmarks/moe_engine.py --sweep --rows dsv2lite:1,16 --reps 40 \
        --variants "wgmma=kernel:wgmma;xla gather=kernel:wgmma,row_gather:0;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_dsv2.log"
    # where a clustered layer's time goes (if part 93 passed): the GEMMs against the XLA transposes of their rows
    # into the K-block-major form (what a K-block-major row gather and GEMM1 output would save)
    logged "profile" 120 python3 benchmarks/moe_engine.py --sweep --profile --profile-top 15 --rows mixtral:64 \
        --reps 10 --variants "cl2=kernel:wgmma,cluster:2"
    grep -vE "^#|Warning|warn|^ *ref =|^\s*$|host spans|Pjit|PjRt|Execute|XLA GPU module|command_buffer" \
        "$OUT/profile.log" | head -25
elif [ "$part" = 97 ]; then    # v23: the row gather by XLA below ROW_GATHER_MIN_PAIRS (1024) routed pairs, the
    # kernel from there on. Part 94: DeepSeek-V2-Lite 16 tokens 91.6 µs with XLA's gather against 95.2-96.2 with
    # the kernel. (a) the GPU tests of the decode defaults on the new default; (b) A B A against the kernel forced
    # at the decode rows. Prediction: XLA's gather 2-5 µs faster at every row (one launch fewer, the gather fused
    # into the glue), none slower
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 200 "v16_defaults_gpu or blocked_defaults_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
    logged "sweep_gather" 250 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 qwen3:16,64 \
        dsv2lite:16,64 --reps 40 --variants "wgmma=kernel:wgmma;kernel gather=kernel:wgmma,row_gather:1;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_gather.log"
elif [ "$part" = 98 ]; then    # ran in v24; prepared in v23: where the 1-token rows' time goes on the current default (v20 profiled
    # Mixtral only: GEMMs 58.9 of 65.6 µs). Prediction: Mixtral GEMMs ~58 of ~66 µs; Qwen3 (20 µs) and
    # DeepSeek-V2-Lite (23 µs): the GEMMs 10-14 µs, the glue 5-8 kernels of ~1 µs, the rest idle between kernels
    logged "profile_1tok" 200 python3 benchmarks/moe_engine.py --sweep --profile --profile-top 15 \
        --rows mixtral:1 qwen3:1 dsv2lite:1 --reps 20 --variants "wgmma=kernel:wgmma"
    grep -vE "^#|Warning|warn|^ *ref =|^\s*$|host spans|Pjit|PjRt|Execute|XLA GPU module|command_buffer" \
        "$OUT/profile_1tok.log" | head -80
elif [ "$part" = 99 ]; then    # ran in v24 (block_n=256 since removed: spills, slower); prepared in v23: 256-column fold programs (block_n=256, the plain kernel only). Part 96
    # found the clusters' multicast relieved L2 without speeding the 24-row GEMM1 up; what each SM takes in per
    # weight byte (weights + its block's token rows: 1 + block_m/32 at 128 columns, 1 + block_m/64 at 256) fits
    # parts 91 and 93, above the ~1.2x-floor that 8-row blocks already sit at. (a) the kernel's GPU cases (all; 9
    # new) and the layer test (9); (b) ptxas's registers / spills of the 256-column fold; (c) the GEMMs. Prediction (time =
    # max(8-row time, 101 us x intake)): Mixtral GEMM1 24 rows 140-150 µs (186.4), 16 rows 138-145 (151.8), 8 rows
    # 136-142 (140.3); GEMM2 24 rows 78-82 (89.8), 16 rows 76-80 (82.9) unless its 16 column tiles per block leave
    # SMs idle; if ptxas spills, slower everywhere
    WORKERS=14 PYTEST_EXTRA="--durations=5" gpu_tests 240 "grouped_gemm_gpu or block_n_256_gpu"
    grep -E "FAIL|ERROR|passed|failed|rc |s call" "$OUT/tests.log" | tail -12
    logged "ptx" 120 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 16 24 \
        --only "bn256 st2 kpb2 wide shift32 sfold" "bn128 st2 kpb2 wide shift32 sfold"
    grep -E "^mixtral1|registers|spill|rc " "$OUT/ptx.log" | head -40   # (the cl2/cl4 variants match too)
    logged "gemm_bn256" 200 python3 benchmarks/gemm_kernels.py --gemms mixtral1 mixtral2 qwen3_1 --block-m 8 16 24 \
        --reps 20 --only "bn128 st2 kpb2 wide shift32 sfold s" "bn256 st2 kpb2 wide shift32 sfold s" \
        "bn256 st3 kpb2 wide shift32 sfold s"
    grep -E "^\| [mq]|rc |rror|WRONG|FAIL" "$OUT/gemm_bn256.log" | sort -u
elif [ "$part" = 100 ]; then    # ran in v24 without Mixtral 64 (block_n=256 since removed); prepared in v23, after part 99: the layer with block_n=256 (the scale-fold GEMMs in
    # 256-column programs), A B A. Prediction from part 99's GEMMs; before them (the account): Mixtral 64 tokens
    # (24-row blocks) 225-240 µs (272), Mixtral 16 (8-row blocks) and 1 token within ±5, Qwen3 64 and
    # DeepSeek-V2-Lite 16 / 64 (8- and 16-row blocks, short K) within ±5 — their GEMM2s may lose SMs (fewer tiles)
    logged "sweep_bn256" 400 python3 benchmarks/moe_engine.py --sweep --rows mixtral:1,16,64 qwen3:1,64 \
        dsv2lite:16,64 --reps 40 --variants "wgmma=kernel:wgmma;bn256=kernel:wgmma,block_n:256;again=kernel:wgmma"
    grep -E "^##|µs|FAIL|rc |rror" "$OUT/sweep_bn256.log"
elif [ "$part" = 33 ] || [ "$part" = 34 ]; then    # prepared in v11: the whole table (every alternative) under
    # the differential timing, for the GPU engine issue's closing table — 33: Mixtral, 34: Qwen3 and
    # DeepSeek-V2-Lite (the earlier full tables divided a program's fixed cost into its layers); since v19 with the
    # dense bf16 rate measured in the same run (the prefill target's reference)
    rows=$([ "$part" = 33 ] && echo "mixtral" || echo "qwen3 dsv2lite")
    logged "table_full" 560 python3 benchmarks/moe_engine.py --rows $rows --reps 40 \
        --append "$OUT/RESULTS_engine.md" --json "$OUT/results.json"
    grep -E "^\| |rc |rror" "$OUT/table_full.log"
else
    logged "gemm128" 110 python3 benchmarks/gemm_kernels.py --gemms mixtral1 mixtral2 --block-m 128 --reps 5 \
        --only "bn128 st4 shift32" "bn128 st2 shift32" "triton swap" --append "$OUT/RESULTS_gemm.md"
    grep -E "^\| [mq]|FAIL|WRONG|rc " "$OUT/gemm128.log" | sort -u
    logged "sweep_prefill" 100 python3 benchmarks/moe_engine.py --sweep --rows mixtral:4096 qwen3:4096 --reps 3 \
        --variants "wgmma=kernel:wgmma;st2=kernel:wgmma,stages:2;bm64=kernel:wgmma,block_m:64;bm128 ovl=kernel:wgmma,overlap:1"
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep_prefill.log"
    logged "sweep" 230 python3 benchmarks/moe_engine.py --sweep --rows mixtral:16,64 qwen3:64,512 --reps 10 \
        --variants "wgmma=kernel:wgmma;no zfold=kernel:wgmma,zfold:0;ovl=kernel:wgmma,zfold:0,overlap:1;no wide=kernel:wgmma,wide:0;bm16=kernel:wgmma,block_m:16;bm64 ovl=kernel:wgmma,block_m:64,overlap:1"
    logged "ptxas" 90 python3 benchmarks/ptxas_report.py --gemm mixtral1 --block-m 8 128 --only "st4 kpb2 wide shift32" "bn128 st4 shift32"
    grep -E "^##|µs|FAIL|rc " "$OUT/sweep.log"
    grep -E "^mixtral1|serializ|arning|registers|rc " "$OUT/ptxas.log" | head -40
fi
