#!/usr/bin/python3
"""deploy/ tested without a container engine.

1. The image's runtime: the root deploy/Dockerfile's final stage describes
   (Debian 12 from debootstrap, the packages its `apt-get install` names,
   read from the Dockerfile itself), with the built `wsyncd` and `wsync` in
   /usr/local/bin; inside it (chroot, the test's own mount and network
   namespaces, as the image's user 65534) a coordinator, a source and a
   sink start and sync two versions bit for bit. The root is cached by its
   package list (WSYNC_ROOTFS_CACHE, default ~/.cache/wsync).
2. The systemd units: `systemd-analyze verify` (this host's systemd, in a
   mount namespace where /usr/local/bin holds the built binaries), and each
   ExecStart run with --check-config inside the root (the daemon's own
   option parsing; the files they name present).
3. The Kubernetes manifests: validated against the Kubernetes API schemas
   (kubernetes-validate, from the package index, in a virtual environment
   made once), and each wsync container's command run with --check-config
   inside the root, with the environment the manifest gives it.

    deploy_test.py BUILD          (root: chroot, mounts, namespaces)
"""
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.abspath(os.path.join(HERE, "..", ".."))
CACHE = os.environ.get("WSYNC_ROOTFS_CACHE", os.path.expanduser("~/.cache/wsync"))
TOKEN = "deploy-test-token-0123456789abcdef"
failures = []


def check(cond, what):
    print(("  ok: " if cond else "  FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, **kw)


def runtime_packages():
    """The packages the Dockerfile's final stage installs."""
    text = open(os.path.join(TOP, "deploy", "Dockerfile")).read().replace("\\\n", " ")
    final = text[text.rindex("\nFROM "):]
    m = re.search(r"apt-get install ([^&]*)", final)
    if not m:
        raise SystemExit("deploy/Dockerfile: no apt-get install in the final stage")
    return sorted(w for w in m.group(1).split() if not w.startswith("-"))


def rootfs(packages):
    """Debian 12 minbase with `packages`, made once per package list."""
    key = hashlib.sha256(" ".join(packages).encode()).hexdigest()[:12]
    root = os.path.join(CACHE, f"rootfs-bookworm-{key}")
    if os.path.exists(os.path.join(root, ".wsync-complete")):
        return root, 0.0
    t0 = time.time()
    if not shutil.which("debootstrap"):
        raise SystemExit("debootstrap is not installed (scripts/install-deps.sh installs it)")
    tmp = root + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(CACHE, exist_ok=True)
    p = run(["debootstrap", "--variant=minbase", "bookworm", tmp])
    if p.returncode:
        raise SystemExit(f"debootstrap failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    shutil.copy("/etc/resolv.conf", os.path.join(tmp, "etc", "resolv.conf"))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
                 ["apt-get", "clean"]):
        p = run(["chroot", tmp, *argv], env=env)
        if p.returncode:
            raise SystemExit(f"{' '.join(argv)} in the root failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    open(os.path.join(tmp, ".wsync-complete"), "w").close()
    os.rename(tmp, root)
    return root, time.time() - t0


def write_safetensors(path, tensors):
    """tensors: {name: (shape, bytes)} as BF16."""
    header, offset = {}, 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for _, data in tensors.values():
            f.write(data)


def read_tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    return {k: raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


# The scenario inside the root: its own mount and network namespaces; /proc,
# /sys, /dev and a fresh /dev/shm mounted into it; every daemon as 65534.
SCENARIO = r"""
set -eu
root="$1"
ip link set lo up
mount --make-rprivate /
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
in_root() { chroot --userspec=65534:65534 "$root" env -i PATH=/usr/local/bin:/usr/bin:/bin UCX_TLS=tcp \
  WSYNC_COORDINATOR=unix:/w/coord.sock "$@"; }
in_root wsyncd coordinator --listen unix:/w/coord.sock --store-dir /w/store > "$root/w/coordinator.log" 2>&1 &
# Each daemon's socket within 60 s, or its log says why it is not there.
wait_for() { for i in $(seq 1200); do [ -S "$root/w/$1.sock" ] && return 0; sleep 0.05; done; cat "$root/w/$2.log" >&2; exit 1; }
wait_for coord coordinator
in_root wsyncd source --name source --local unix:/w/source.sock --listen 127.0.0.1:7700 > "$root/w/source.log" 2>&1 &
in_root wsyncd sink --name sink --local unix:/w/sink.sock --listen 127.0.0.1:7701 > "$root/w/sink.log" 2>&1 &
wait_for source source
wait_for sink sink
in_root wsync serve-buffers --local unix:/w/sink.sock --like /w/v1.safetensors > "$root/w/buffers.log" 2>&1 &
for v in 1 2; do
  in_root wsync publish --local unix:/w/source.sock /w/v$v.safetensors --version $v
  for i in $(seq 600); do
    in_root wsync dump --local unix:/w/sink.sock -o /w/out$v.safetensors --version $v > /dev/null 2>&1 && break
    sleep 0.05
  done
done
in_root wsync status > "$root/w/status.txt"
"""


def image_runtime(build, root):
    print("== the image's runtime (chroot)", flush=True)
    bin_dir = os.path.join(root, "usr", "local", "bin")
    for exe in ("daemon/wsyncd", "client/wsync"):
        shutil.copy2(os.path.join(build, exe), bin_dir)
    for exe in ("wsyncd", "wsync"):
        p = run(["chroot", root, "ldd", f"/usr/local/bin/{exe}"])
        missing = [line.split()[0] for line in p.stdout.splitlines() if "not found" in line]
        check(p.returncode == 0 and not missing, f"{exe}: every shared library is in the image {missing}")
        p = run(["chroot", "--userspec=65534:65534", root, f"/usr/local/bin/{exe}", "--help"])
        check(p.returncode == 0, f"{exe} --help runs in the image as 65534 {p.stderr.strip()[-200:]}")
    work = os.path.join(root, "w")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "store"))
    import random
    rnd = random.Random(7)
    v1 = {f"layers.{i}.weight": ((256, 512), bytes(rnd.getrandbits(8) for _ in range(256 * 512 * 2))) for i in range(2)}
    v2 = {}
    for name, (shape, data) in v1.items():
        b = bytearray(data)
        for j in rnd.sample(range(0, len(b), 2), len(b) // 200):
            b[j] ^= 1  # one-ulp-ish changes in 1% of elements
        v2[name] = (shape, bytes(b))
    write_safetensors(os.path.join(work, "v1.safetensors"), v1)
    write_safetensors(os.path.join(work, "v2.safetensors"), v2)
    subprocess.run(["chown", "-R", "65534:65534", work], check=True)
    t0 = time.time()
    # A PID namespace too: whatever the scenario leaves running ends with it.
    p = run(["unshare", "--mount", "--net", "--pid", "--fork", "bash", "-c", SCENARIO, "scenario", root], timeout=300)
    took = time.time() - t0
    for v, want in ((1, v1), (2, v2)):
        out = os.path.join(work, f"out{v}.safetensors")
        got = read_tensors(out) if os.path.exists(out) else {}
        same = got.keys() == want.keys() and all(got[k] == want[k][1] for k in want)
        check(same, f"version {v} synced from the source to the sink inside the image, bit for bit")
    if failures:
        for log in ("coordinator", "source", "sink", "buffers"):
            path = os.path.join(work, log + ".log")
            if os.path.exists(path):
                print(f"--- {log}.log\n" + open(path).read()[-1500:])
        print(p.stdout[-1500:], p.stderr[-1500:])
    print(f"  the scenario took {took:.1f} s", flush=True)


def check_config(root, argv, env, what):
    """`argv` (the daemon's command line) with --check-config, inside the root."""
    exe, args = argv[0], argv[1:]
    envs = [f"{k}={v}" for k, v in env.items()]
    p = run(["chroot", root, "env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", "UCX_LOG_LEVEL=fatal", *envs, exe,
             "--check-config", *args])
    check(p.returncode == 0 and "configuration ok" in p.stdout,
          f"{what}: the daemon accepts `{' '.join(args)}` {(p.stdout + p.stderr).strip()[-200:]}")


def files_the_deployment_names(root):
    etc = os.path.join(root, "etc", "wsync")
    os.makedirs(etc, exist_ok=True)
    shutil.copy(os.path.join(TOP, "config", "coordinator.example.toml"), os.path.join(etc, "coordinator.toml"))
    with open(os.path.join(etc, "token"), "w") as f:
        f.write(TOKEN + "\n")
    with open(os.path.join(etc, "env"), "w") as f:
        f.write(f"WSYNC_COORDINATOR=coordinator.example:7600\nWSYNC_TOKEN={TOKEN}\n")


def systemd_units(build, root):
    print("== systemd units", flush=True)
    import tempfile
    units = sorted(glob.glob(os.path.join(TOP, "deploy", "systemd", "*.service")))
    unit_dir, bin_dir = tempfile.mkdtemp(prefix="wsync_units_"), tempfile.mkdtemp(prefix="wsync_bin_")
    for exe in ("daemon/wsyncd", "client/wsync"):
        shutil.copy2(os.path.join(build, exe), bin_dir)
    for u in units:
        name = os.path.basename(u)
        instance = name.replace("@.service", "@unit-check.service")  # a template is verified as an instance
        shutil.copy(u, os.path.join(unit_dir, instance))
        # This host's systemd, in a mount namespace of its own where /usr/local/bin holds the built binaries.
        script = f"mount --make-rprivate / && mount --bind {bin_dir} /usr/local/bin && " \
                 f"systemd-analyze verify {os.path.join(unit_dir, instance)}"
        p = run(["unshare", "--mount", "--fork", "bash", "-c", script])
        check(p.returncode == 0, f"systemd-analyze verify {instance} {(p.stdout + p.stderr).strip()[-300:]}")
        text = open(u).read()
        env = {}
        m = re.search(r"^EnvironmentFile=-?(\S+)", text, re.M)
        if m:
            for line in open(os.path.join(root, m.group(1).lstrip("/"))):
                k, _, v = line.strip().partition("=")
                env[k] = v
        for line in re.findall(r"^ExecStart=(.+)$", text, re.M):
            argv = [a.replace("%i", "unit-check") for a in shlex.split(line)]
            check_config(root, argv, env, f"{name} ExecStart")
    shutil.rmtree(unit_dir, ignore_errors=True)
    shutil.rmtree(bin_dir, ignore_errors=True)


def kube_validate():
    venv = os.path.join(CACHE, "deploy-tools")
    exe = os.path.join(venv, "bin", "kubernetes-validate")
    if not os.path.exists(exe):
        for argv in (["/usr/bin/python3", "-m", "venv", venv],
                     [os.path.join(venv, "bin", "pip"), "install", "-q", "--disable-pip-version-check",
                      "kubernetes-validate==1.37.0"]):
            p = run(argv)
            if p.returncode:
                raise SystemExit(f"{' '.join(argv)} failed:\n{p.stderr[-2000:]}")
    return exe


def kubernetes(root):
    print("== Kubernetes manifests", flush=True)
    import yaml  # Debian's python3-yaml
    exe = kube_validate()
    manifests = sorted(glob.glob(os.path.join(TOP, "deploy", "kubernetes", "*.yaml")))
    for m in manifests:
        p = run([exe, "--strict", m])
        check(p.returncode == 0, f"{os.path.basename(m)}: valid against the Kubernetes API schemas "
                                 f"{(p.stdout + p.stderr).strip()[-400:]}")
        for doc in yaml.safe_load_all(open(m)):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                if not c.get("image", "").startswith("wsync"):
                    continue
                env = {}
                for e in c.get("env", []):
                    if "value" in e:
                        env[e["name"]] = e["value"]
                    elif "secretKeyRef" in e.get("valueFrom", {}):
                        env[e["name"]] = TOKEN
                    else:  # fieldRef: a pod's name or IP
                        env[e["name"]] = "10.0.0.7" if "IP" in e["name"] else "rollout-0"
                expand = lambda a: re.sub(r"\$\((\w+)\)", lambda mm: env.get(mm.group(1), mm.group(0)), a)
                argv = [expand(a) for a in c.get("command", ["/usr/local/bin/wsyncd"]) + c.get("args", [])]
                check_config(root, argv, env, f"{os.path.basename(m)} container {c['name']}")


def main():
    build = os.path.abspath(sys.argv[1])
    if os.geteuid() != 0:
        print("SKIP: the deployment test needs root (chroot, mounts, namespaces)")
        return
    packages = runtime_packages()
    print(f"the image's runtime packages (deploy/Dockerfile): {' '.join(packages)}", flush=True)
    root, made = rootfs(packages)
    print(f"root: {root}" + (f" (made in {made:.0f} s)" if made else " (cached)"), flush=True)
    image_runtime(build, root)
    files_the_deployment_names(root)
    systemd_units(build, root)
    kubernetes(root)
    print("PASS" if not failures else f"FAIL: {len(failures)} checks")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
