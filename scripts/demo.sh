#!/usr/bin/env bash
# The demo command (README): installs dependencies, builds, installs the
# Python package `wsync` into Debian's Python, starts the real system on
# loopback (a coordinator, a source, three sinks, one of them behind a relay)
# and syncs every snapshot of a real RL run through it, verifying every sink
# bit for bit; runs the Python examples (a PyTorch trainer and two inference
# servers) against it; then shows the codec against its baselines.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${WSYNC_DATA_DIR:-$(cd .. && pwd)/shared/data}"

bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
ninja -C build wsync wsyncd wsync-bench wsync_python
bash scripts/install-python.sh build

if [ ! -d "$data/rl-small-lr1e-6" ]; then
  echo "demo: no snapshots in $data (set WSYNC_DATA_DIR)" >&2
  exit 1
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
run="$data/rl-small-lr1e-6"

echo
echo "== the system on loopback: coordinator, source, 3 sinks (fan-out 2: one behind a relay), a cluster token, the data plane encrypted"
UCX_TLS=tcp /usr/bin/python3 scripts/system_demo.py --build build --data "$run" --sinks 3 --fanout 2 \
  --token "$(head -c 18 /dev/urandom | base64)" --data-security encrypt

echo
echo "== from Python: examples/trainer.py (AdamW on FP32 masters) and two examples/inference.py servers"
UCX_TLS=tcp /usr/bin/python3 scripts/python_demo.py --build build --steps 6

echo
echo "== one optimizer step of a real RL run: diff, inspect, apply, verify"
./build/client/wsync diff "$run/step_0000.safetensors" "$run/step_0001.safetensors" -o "$out/p01"
./build/client/wsync inspect "$out/p01" --base "$run/step_0000.safetensors" | tail -n 4
./build/client/wsync apply "$run/step_0000.safetensors" "$out/p01" -o "$out/step1.safetensors"

echo
echo "== three steps merged into one patch (no intermediate weights needed)"
./build/client/wsync diff "$run/step_0001.safetensors" "$run/step_0002.safetensors" -o "$out/p12" > /dev/null
./build/client/wsync diff "$run/step_0002.safetensors" "$run/step_0003.safetensors" -o "$out/p23" > /dev/null
./build/client/wsync merge --base "$run/step_0000.safetensors" "$out/p01" "$out/p12" -o "$out/p02" > /dev/null
./build/client/wsync merge --base "$run/step_0000.safetensors" "$out/p02" "$out/p23" -o "$out/p03"
./build/client/wsync apply "$run/step_0000.safetensors" "$out/p03" -o "$out/step3.safetensors"
./build/client/wsync keyframe "$run/step_0003.safetensors" -o "$out/kf3"

echo
./build/bench/wsync-bench codec "$run"
echo
./build/bench/wsync-bench codec "$run" --gap 4
echo
./build/bench/wsync-bench codec "$data/rl-small-lr1e-5"
echo
./build/bench/wsync-bench synth --params 134217728 --steps 2
