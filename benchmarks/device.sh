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
#   serve-mix     the request mix through the scheduler and the HTTP server beside the static batch-32
#                 Generator, Qwen3-30B-A3B shape cut to 16 layers (one call of about 8 minutes)
#   serve-mix-mixtral  the same, Mixtral-8x7B shape cut to 8 layers
#   latent-parts  DeepSeek-V2-Lite decode: kv_b_proj as its two parts against one matrix cut per step
#   decode        where a decode step goes (benchmarks/decode_breakdown.py), Qwen3-30B-A3B and
#                 DeepSeek-V2-Lite shapes, batch 1 and 8, no command-buffer variants
#   dsv3-bytes    bytes per device of a DeepSeek-V3-shaped checkpoint (2 layers) on 8 host CPU devices
#                 (the host's memory, not the GPU's: about 60 GiB under ep8)
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
        serve-mix) cmd=(python3 benchmarks/serve.py --model qwen3 --layers 16 --mix --requests 96 --batch-sizes 1 8 32
                        --chunk-sizes 64 512 --streams 1 8 32 --measure-bandwidth) ;;
        serve-mix-mixtral) cmd=(python3 benchmarks/serve.py --model mixtral --layers 8 --mix --requests 96
                                --batch-sizes 1 8 32 --chunk-sizes 64 512 --streams 1 8 32 --measure-bandwidth) ;;
        latent-parts) cmd=(python3 benchmarks/latent_parts.py) ;;
        decode) cmd=(python3 benchmarks/decode_breakdown.py --models qwen3,dsv2lite --batch 1 8 --no-cmdbuf --k) ;;
        dsv3-bytes) cmd=(env XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
                         python3 benchmarks/model_sharding.py --models dsv3 --layers 2 --meshes ep8 ep4xtp2 --bytes-only) ;;
        *) echo "unknown suite: $suite (tests, tests-layers, tests-rest, fingerprints, table, engine, before-after, generate, sharding, serve-mix, serve-mix-mixtral, latent-parts, decode, dsv3-bytes)"; status=2; continue ;;
    esac
    "${cmd[@]}" 2>&1 | tee "$OUT/$suite.log"
    rc=${PIPESTATUS[0]}
    echo "=== $suite: rc $rc"
    [ "$rc" = 0 ] || status=1
done
exit $status
