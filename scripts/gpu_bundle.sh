#!/usr/bin/env bash
# Packs the GPU checks for a GPU machine that has the NVIDIA driver and a
# Python with a CUDA build of torch but none of wsync's build dependencies:
# the stripped binaries (behind wrappers that point them at the libraries
# packed beside them), the shared libraries they load (glibc and the driver
# excepted), UCX's transport modules, the Python package and, optionally, a
# snapshot directory. Unpack anywhere and run scripts/gpu_check.sh on it.
#
#   scripts/gpu_bundle.sh BUILD OUT.tar.xz [SNAPSHOT_DIR]
set -euo pipefail
build=$(realpath "${1:?usage: gpu_bundle.sh BUILD OUT.tar.xz [SNAPSHOT_DIR]}")
out=$(realpath -m "${2:?usage: gpu_bundle.sh BUILD OUT.tar.xz [SNAPSHOT_DIR]}")
data=${3:-}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

bins=(daemon/wsyncd client/wsync bench/wsync-bench tests/cuda_device_test tests/cuda_ipc_test tests/cuda_ipc_peer
      tests/exchange_attacker)
mkdir -p "$stage/bin" "$stage/lib/ucx"
for b in "${bins[@]}"; do
  [ -x "$build/$b" ] || { echo "gpu_bundle: $build/$b is missing (build with nvcc and tests on)" >&2; exit 1; }
  name=$(basename "$b")
  strip -o "$stage/bin/$name" "$build/$b"
  mkdir -p "$stage/build/$(dirname "$b")"
  cat > "$stage/build/$b" <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")/../..
LD_LIBRARY_PATH="\$here/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/bin/$name" "\$@"
WRAP
  chmod +x "$stage/build/$b"
done
cp -r "$build/python" "$stage/build/python"

# The libraries the binaries load, less those every Linux has in a
# compatible version (glibc) and the driver's own.
for b in "${bins[@]}"; do ldd "$build/$b"; done | awk '/=> \//{print $3}' | sort -u |
  grep -v -E '/(libc|libm|libpthread|libdl|librt|libutil|ld-linux[^/]*|libcuda)\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
ucx_modules=$(dirname "$(ldd "$build/daemon/wsyncd" | awk '/libucs\.so/{print $3}')")/ucx
for m in "$ucx_modules"/libuct_cma.so.0; do cp -L "$m" "$stage/lib/ucx/"; done

if [ -n "$data" ]; then
  mkdir -p "$stage/data"
  cp -r "$data" "$stage/data/"
fi
# xz's window holds a whole snapshot, so a run of snapshots costs about one.
tar -C "$stage" -cf - . | xz -9e -T1 > "$out"
echo "gpu_bundle: $(du -h "$out" | cut -f1) in $out"
