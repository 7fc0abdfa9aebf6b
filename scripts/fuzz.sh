#!/usr/bin/env bash
# Builds the fuzzers with clang (libFuzzer + ASan + UBSan) and runs each for
# a bounded time from a generated seed corpus: the patch decoder, then the
# pull protocol's parsers (both directions) and its sealed messages, then
# what a puller parses of an object store (manifests, S3's XML).
#   scripts/fuzz.sh [SECONDS]   (default 60, split between the two)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
build=build-fuzz
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DWSYNC_FUZZ=ON -DWSYNC_SANITIZE=address,undefined -DWSYNC_BUILD_TESTS=ON -DWSYNC_CUDA=OFF > /dev/null
ninja -C "$build" patch_fuzzer patch_fuzz_seeds exchange_fuzzer exchange_fuzz_seeds store_fuzzer store_fuzz_seeds \
  > /dev/null
# The patch decoder and the pull protocol share the time; the store's parsers (small) take a tenth.
for target in patch exchange store; do
  corpus="$build/fuzz-corpus-$target"
  mkdir -p "$corpus"
  "$build/tests/fuzz/${target}_fuzz_seeds" "$corpus"
  share=$((seconds * 9 / 20))
  [ "$target" = store ] && share=$((seconds / 10))
  echo "-- ${target}_fuzzer (${share} s)"
  "$build/tests/fuzz/${target}_fuzzer" -max_total_time="$share" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 "$corpus" 2>&1 | tail -n 15
done
