#!/usr/bin/env bash
# The checks only a GPU can run, in one go: the device codec's tests, CUDA IPC
# between processes, the Python client with CUDA tensors, the whole system and
# its fault scenarios with every weight in GPU memory, `wsync-bench gpu`, and
# (with WSYNC_VLLM_PYTHON) a real vLLM's BF16 and FP8 engines on the GPU.
# Logs go to LOGS (default $OUT or /tmp/wsync-gpu); a table of results is
# printed last. The steps run most telling first; with WSYNC_GPU_BUDGET_S set,
# each step's limit is cut to the time left and a step with under 20 s left is
# skipped, so a lease that ends early still brings back the first results.
# WSYNC_GPU_STEPS (names, space-separated) runs only those steps.
#
#   scripts/gpu_check.sh BUILD SNAPSHOT_DIR [LOGS]
# BUILD is a CUDA build (ninja -C build) or an unpacked scripts/gpu_bundle.sh;
# SNAPSHOT_DIR holds consecutive *.safetensors snapshots (rl-small-lr1e-6).
set -uo pipefail
build=$(realpath "${1:?usage: gpu_check.sh BUILD SNAPSHOT_DIR [LOGS]}")
data=$(realpath "${2:?usage: gpu_check.sh BUILD SNAPSHOT_DIR [LOGS]}")
logs=${3:-${OUT:-/tmp/wsync-gpu}}
src=$(dirname "$(dirname "$(realpath "$0")")")
py=${PYTHON:-python3}
mkdir -p "$logs"
rm -f "$logs/results.txt"
export UCX_TLS=${UCX_TLS:-tcp} PYTHONUNBUFFERED=1
results=()

budget=${WSYNC_GPU_BUDGET_S:-0}

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  if [ -n "${WSYNC_GPU_STEPS:-}" ] && [[ " $WSYNC_GPU_STEPS " != *" $name "* ]]; then
    return
  fi
  if [ "$budget" -gt 0 ]; then
    local left=$((budget - SECONDS))
    if [ $left -lt 20 ]; then
      results+=("$(printf '%-22s %-6s' "$name" skip) (out of WSYNC_GPU_BUDGET_S)")
      echo "${results[-1]}" >> "$logs/results.txt"
      return
    fi
    [ $left -lt "$limit" ] && limit=$left
  fi
  echo "== $name" >&2
  timeout -k 10 "$limit" "$@" > "$logs/$name.log" 2>&1
  rc=$?
  tail -n 5 "$logs/$name.log" >&2
  results+=("$(printf '%-22s %-6s %4ds' "$name" "$([ $rc -eq 0 ] && echo ok || echo "rc=$rc")" $((SECONDS - t0)))")
  echo "${results[-1]}" >> "$logs/results.txt"
}

nvidia-smi -L > "$logs/device.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >> "$logs/device.txt" 2>&1
cat "$logs/device.txt" >&2
step device_codec 150 env WSYNC_DATA_DIR="$data" "$build/tests/cuda_device_test"
step cuda_ipc 60 env WSYNC_IPC_PEER="$build/tests/cuda_ipc_peer" "$build/tests/cuda_ipc_test"
# WSYNC_BENCH_BEFORE: another build's wsync-bench, run beside this one's on the same device.
if [ -n "${WSYNC_BENCH_BEFORE:-}" ]; then
  step bench_before_16 90 "$WSYNC_BENCH_BEFORE" gpu --params 536870912 --steps 2 --host-threads 16
fi
step bench_gpu_16 90 "$build/bench/wsync-bench" gpu --params 536870912 --steps 2 --host-threads 16
step python_cuda_ipc 150 bash -c "cd '$src' && $py tests/python/client_test.py '$build' gpu"
step system_gpu 150 "$py" "$src/scripts/system_demo.py" --build "$build" --data "$data" --sinks 3 --fanout 2 --device 0
if [ -n "${WSYNC_BENCH_BEFORE:-}" ]; then
  step bench_before_2 120 "$WSYNC_BENCH_BEFORE" gpu --params 536870912 --steps 2 --host-threads 2
fi
step bench_gpu_2 120 "$build/bench/wsync-bench" gpu --params 536870912 --steps 2 --host-threads 2
# A sink's pause at scale: 3.5 B parameters (7 GB BF16; the host holds the generator's FP32 masters
# and momenta), the commit of every change staged on the device.
step bench_gpu_3b 420 "$build/bench/wsync-bench" gpu --params 3500000000 --steps 1 --repeat 2 --host-threads 16 \
  --tp 0
step faults_gpu 300 env WSYNC_TEST_DEVICE=0 "$py" "$src/tests/python/system_faults_test.py" "$build" "$data"
step system_gpu_host_base 150 "$py" "$src/scripts/system_demo.py" --build "$build" --data "$data" --sinks 2 \
  --fanout 2 --device 0 --device-base host
# WSYNC_VLLM_PYTHON: a Python with a CUDA build of vLLM 0.32 and this build's wsync package installed.
# vLLM's FP8 engines generate on the GPU (docs/fp8.md): a BF16 engine and FP8 engines per tensor, per channel
# and per 128x128 block on vLLM's own GPU kernels (not the CPU tests' stand-ins), TP 1, each version
# bit-identical to vLLM's own load of that step (per tensor: its CUDA quantization kernel, which the trainer
# then runs too) and its tokens and logprobs to a fresh engine's. A kernel that processes the codes or scales
# after quantizing them (DeepGEMM) is refused at registration, naming it, hence VLLM_USE_DEEP_GEMM=0.
if [ -n "${WSYNC_VLLM_PYTHON:-}" ]; then
  step vllm_fp8_gpu 600 env VLLM_USE_DEEP_GEMM=0 "$WSYNC_VLLM_PYTHON" "$src/tests/python/vllm_test.py" "$build" --families llama,llama_fp8,llama_fp8_block,llama_fp8_tensor,llama_fp8_ckpt,qwen3_moe_fp8_block --tp 1
else
  results+=("$(printf '%-22s %-6s' vllm_fp8_gpu skip) (set WSYNC_VLLM_PYTHON to a CUDA vLLM's Python)")
fi

echo "== wsync-bench gpu" >&2
for f in "$logs"/bench_*.log; do
  [ -e "$f" ] || continue
  echo "-- $(basename "$f" .log)" >&2
  grep -A28 "^device codec" "$f" | grep -v "^device codec" >&2
done
echo "== results ($(head -1 "$logs/device.txt"))" >&2
printf '%s\n' "${results[@]}" >&2
