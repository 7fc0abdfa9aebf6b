#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this):
#   1. installs dependencies (apt, Debian 12; virtual environments with
#      vLLM's CPU build and with SeaweedFS from the package index, reused
#      when present),
#   2. builds with gcc and runs every test (unit, real data, CLI, real vLLM),
#   3. builds with ASan + UBSan and the portable (non-AVX2) kernels and runs
#      the unit tests again,
#   4. fuzzes the patch decoder and the pull protocol for a bounded time
#      (WSYNC_FUZZ_SECONDS, 90, split between them).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="$(nproc)"
# Each phase's heading says how long the run has taken so far.
phase() { echo "== $1 ($((SECONDS / 60)) min $((SECONDS % 60)) s in)"; }

bash scripts/install-deps.sh
# SeaweedFS: the real S3-compatible server the object-store tests run against.
bash scripts/install-seaweedfs.sh > /dev/null
# nvcc (when installed) builds the CUDA library; its device tests skip without a GPU.
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc > /dev/null; then export PATH="$PATH:/usr/local/cuda/bin"; fi

# The vLLM environment (a real vLLM on the CPU, for python.vllm) is made
# while the build runs: mostly downloads, the first time only.
mkdir -p build
bash scripts/install-vllm.sh - > build/install-vllm.log 2>&1 &
vllm_env=$!

phase "build (gcc, RelWithDebInfo)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWSYNC_BUILD_TESTS=ON > /dev/null
ninja -C build -j "$jobs"

phase "the vLLM environment"
wait "$vllm_env" || { cat build/install-vllm.log >&2; exit 1; }
cat build/install-vllm.log
vllm_python="$(bash scripts/install-vllm.sh build | tail -n 1)"
cmake -S . -B build -DWSYNC_VLLM_PYTHON="$vllm_python" > /dev/null

phase "sanitizers (ASan + UBSan, portable kernels)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DWSYNC_SANITIZE=address,undefined \
  -DWSYNC_X86_64_V3=OFF -DWSYNC_CUDA=OFF -DWSYNC_BUILD_TESTS=ON > /dev/null
# Only the unit-test executables (the integration tiers run in the main build).
ninja -C build-asan -j "$jobs" util_test codec_test buffers_test regress_test regress_control_test control_test daemon_config_test \
  version_history_test sink_weights_test sink_core_test source_core_test cuda_logic_test exchange_wire_test
(cd build-asan && ctest -j "$jobs" -L unit --output-on-failure --timeout 600) ||
  { python3 scripts/failed_tails.py build-asan; exit 1; }

phase "fuzz the patch decoder and the pull protocol (${WSYNC_FUZZ_SECONDS:-90} s)"
bash scripts/fuzz.sh "${WSYNC_FUZZ_SECONDS:-90}"

phase "all tests"
# A failed test's own words come again at the end, where a log cut to its
# head and tail keeps them.
(cd build && ctest -j "$jobs" --output-on-failure --timeout 900) || { python3 scripts/failed_tails.py build; exit 1; }
phase "done"
