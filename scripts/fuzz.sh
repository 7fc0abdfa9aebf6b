#!/usr/bin/env bash
# Builds the patch decoder fuzzer with clang (libFuzzer + ASan + UBSan) and
# runs it for a bounded time from a generated seed corpus.
#   scripts/fuzz.sh [SECONDS]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
build=build-fuzz
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DWSYNC_FUZZ=ON -DWSYNC_SANITIZE=address,undefined -DWSYNC_BUILD_TESTS=ON -DWSYNC_CUDA=OFF > /dev/null
ninja -C "$build" patch_fuzzer patch_fuzz_seeds > /dev/null
corpus="$build/fuzz-corpus"
mkdir -p "$corpus"
"$build/tests/fuzz/patch_fuzz_seeds" "$corpus"
"$build/tests/fuzz/patch_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 "$corpus" 2>&1 | tail -n 15
