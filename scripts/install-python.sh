#!/usr/bin/env bash
# Installs the Python package `wsync` (assembled by the build in BUILD/python)
# into Debian's Python (/usr/bin/python3), in its site directory for locally
# installed packages. Needs root (or sudo). Usage: install-python.sh [BUILD]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
[ -f "$build/python/wsync/v1/local_pb2.py" ] || { echo "install-python: build first ($build/python is incomplete)" >&2; exit 1; }
site="$(/usr/bin/python3 -c 'import site; print(site.getsitepackages()[0])')"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO mkdir -p "$site"
$SUDO rm -rf "$site/wsync"
$SUDO cp -r "$build/python/wsync" "$site/wsync"
$SUDO find "$site/wsync" -name __pycache__ -prune -exec rm -rf {} +
(cd / && /usr/bin/python3 -c 'import wsync, sys; sys.stdout.write("install-python: wsync installed in %s\n" % wsync.__path__[0])')
