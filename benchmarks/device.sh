#!/usr/bin/env bash
# Run named suites on a GPU machine, from the repository root, with the preinstalled jax:
#
#     bash benchmarks/device.sh SUITE [SUITE ...]      (OUT=DIR for the logs; default ./device-out)
#
# Suites:
#   tests         every GPU test (pytest -m gpu), 8 workers (more than one 10-minute call: use the two below)
#   tests-layers  the GPU tests of the layers at model shapes (test_wgmma_layer.py, test_triton_layer.py)
#   tests-rest    every other GPU test
#   fingerprints  the engine's default programs hashed (benchmarks/program_fingerprints.py)
#   table         the performance table: Mixtral, Qwen3-30B-A3B and DeepSeek-V2-Lite shapes × their
#                 token counts, the wgmma engine (AWQ and GPTQ) against XLA's alternatives
#   engine        the same rows, the wgmma engine's two columns only
#   before-after  the wgmma engine of the tree in $BEFORE (default .before: an older commit unpacked
#                 with `git archive TAG | tar -x -C .before`, named in the call's carry) against this
#                 tree, the two timed in turn on the same GPU ($ROWS: default the 15-row table)
#   generate      whole-model generation, Qwen3-30B-A3B and Mixtral-8x7B shapes, batch 1 / 8 / 64
#   sharding      one layer on one GPU vs EP=2 (all-gather, all-to-all) and TP=2, Mixtral-8x7B and
#                 Qwen3-30B-A3B shapes at 1 / 16 / 256 / 4096 tokens (needs two GPUs)
# Each suite writes OUT/<suite>.log; the table, generate and sharding suites also append their tables to
# OUT/RESULTS.md and OUT/results.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
for suite in "$@"; do
    echo "=== $suite"
    case "$suite" in
        tests) cmd=(python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests) ;;
        tests-layers) cmd=(python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --durations=20
                           tests/test_wgmma_layer.py tests/test_triton_layer.py) ;;
        tests-rest) cmd=(python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --durations=20 tests
                         --deselect tests/test_wgmma_layer.py --deselect tests/test_triton_layer.py) ;;
        fingerprints) cmd=(python3 benchmarks/program_fingerprints.py --out "$OUT/fingerprints.json") ;;
        table) cmd=(python3 benchmarks/moe_engine.py --rows mixtral qwen3 dsv2lite --reps 40
                    --skip "engine AWQ,engine GPTQ,engine←Marlin" --append "$OUT/RESULTS.md" --json "$OUT/results.json") ;;
        engine) cmd=(python3 benchmarks/moe_engine.py --rows mixtral qwen3 dsv2lite --reps 40
                     --skip "engine AWQ,engine GPTQ,engine←Marlin,XLA path,ragged_dot bf16,dequant→ragged_dot,dense bf16") ;;
        before-after) cmd=(python3 benchmarks/before_after.py --before "${BEFORE:-.before}" --after .
                           ${ROWS:+--rows $ROWS} --append "$OUT/RESULTS.md") ;;
        generate) cmd=(python3 benchmarks/generate.py --append "$OUT/RESULTS.md") ;;
        sharding) cmd=(python3 benchmarks/sharding.py --append "$OUT/RESULTS.md" --json "$OUT/sharding.json") ;;
        *) echo "unknown suite: $suite (tests, tests-layers, tests-rest, fingerprints, table, engine, before-after, generate, sharding)"; status=2; continue ;;
    esac
    "${cmd[@]}" 2>&1 | tee "$OUT/$suite.log"
    rc=${PIPESTATUS[0]}
    echo "=== $suite: rc $rc"
    [ "$rc" = 0 ] || status=1
done
exit $status
