"""The environment a vLLM on this machine's CPU runs in, for the tests and
benchmarks that start one (scripts/install-vllm.sh makes its Python).

prepare_cpu() sets vLLM's CPU backend up for a small shared machine and works
around one machine fault: some virtual machines advertise Intel AMX (the CPU
flags, and so torch.cpu._is_amx_tile_supported()) without letting a process
use the tile registers, and vLLM's AMX kernels then die with SIGILL on the
first forward pass. A probe runs one AMX instruction in a child process; if
it fails, every Python process started afterwards (vLLM's engine core and
workers too) sees torch report no AMX, and vLLM takes its AVX-512 kernels.
"""
import os
import subprocess
import sys
import tempfile

_PROBE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return 2;
  uint8_t cfg[64];
  memset(cfg, 0, sizeof cfg);
  cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;  /* palette 1; tile 0: 16 rows of 64 bytes */
  _tile_loadconfig(cfg);
  _tile_zero(0);
  _tile_release();
  return 0;
}
"""

_SHIM = "import torch\ntorch.cpu._is_amx_tile_supported = lambda: False\n"


def amx_usable() -> bool:
    """Whether a process here can execute AMX tile instructions."""
    d = tempfile.mkdtemp(prefix="wsync_amx_")
    src, exe = os.path.join(d, "probe.c"), os.path.join(d, "probe")
    with open(src, "w") as f:
        f.write(_PROBE)
    if subprocess.run(["cc", "-O1", "-mamx-tile", src, "-o", exe], capture_output=True).returncode != 0:
        return False
    return subprocess.run([exe], capture_output=True).returncode == 0


def prepare_cpu() -> None:
    """Call before vLLM is imported."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")        # GiB of KV cache per engine
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # engines, daemons and trainer share the cores
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the tests' functions
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    if not torch.cpu._is_amx_tile_supported() or amx_usable():
        return
    print("vllm_env: this CPU advertises AMX but a process cannot use it; vLLM is made to use AVX-512", flush=True)
    shim = tempfile.mkdtemp(prefix="wsync_noamx_")
    with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
        f.write(_SHIM)
    os.environ["PYTHONPATH"] = os.pathsep.join([shim] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    exec(_SHIM)
    sys.path.insert(0, shim)


def shm_names() -> set:
    """The names in /dev/shm now."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def remove_leaked_vllm_shm(before: set) -> list:
    """vLLM's CPU backend at TP > 1 shares memory between its ranks through
    /dev/shm (``vllm_dist_*``), and ranks it SIGKILLs at shutdown never
    unlink theirs. Unlinks those that appeared since `before` and that no
    live process maps; returns their names."""
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find("/dev/shm/")
                    if at >= 0:
                        mapped.add(line[at + len("/dev/shm/"):].strip().removesuffix(" (deleted)"))
        except OSError:
            continue  # gone, or not ours to read
    removed = []
    for name in sorted(shm_names() - before):
        if name.startswith("vllm_dist_") and name not in mapped:
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except OSError:
                pass
    return removed
