#!/usr/bin/env bash
# End-to-end test of the wsync CLI's codec commands on real snapshots:
# diff/apply/merge/keyframe/inspect round-trip bit for bit, and bad input gives
# one clear error line and a non-zero exit.
#   cli_test.sh WSYNC_BINARY DATA_DIR
set -euo pipefail
wsync="$1"
data="$2/rl-small-lr1e-6"
if [ ! -d "$data" ]; then echo "SKIP: no snapshots in $data"; exit 0; fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# Tensor bytes of a safetensors file, in name order (headers may differ).
tensor_digest() {
  python3 - "$1" <<'PY'
import hashlib, json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
m = hashlib.sha256()
for k in sorted(k for k in h if k != "__metadata__"):
    s, e = h[k]["data_offsets"]
    m.update(k.encode()); m.update(h[k]["dtype"].encode()); m.update(str(h[k]["shape"]).encode())
    m.update(b[8 + n + s:8 + n + e])
print(m.hexdigest())
PY
}

s0="$data/step_0000.safetensors"; s1="$data/step_0001.safetensors"; s2="$data/step_0002.safetensors"
"$wsync" diff "$s0" "$s1" -o "$tmp/p01" --threads 2 > /dev/null
"$wsync" diff "$s1" "$s2" -o "$tmp/p12" > /dev/null
"$wsync" apply "$s0" "$tmp/p01" -o "$tmp/out1.safetensors" > /dev/null
[ "$(tensor_digest "$tmp/out1.safetensors")" = "$(tensor_digest "$s1")" ] || fail "apply p01"

"$wsync" merge --base "$s0" "$tmp/p01" "$tmp/p12" -o "$tmp/p02" > /dev/null
"$wsync" apply "$s0" "$tmp/p02" -o "$tmp/out2.safetensors" > /dev/null
[ "$(tensor_digest "$tmp/out2.safetensors")" = "$(tensor_digest "$s2")" ] || fail "merged apply"

"$wsync" keyframe "$s2" -o "$tmp/kf2" > /dev/null
"$wsync" apply "$tmp/kf2" -o "$tmp/kf2.safetensors" > /dev/null
[ "$(tensor_digest "$tmp/kf2.safetensors")" = "$(tensor_digest "$s2")" ] || fail "keyframe apply"

"$wsync" inspect "$tmp/p01" --base "$s0" | grep -q "conditional entropy bound" || fail "inspect bounds"
"$wsync" inspect "$tmp/p01" --json | python3 -c "import json,sys; j=json.load(sys.stdin); assert j['kind']=='patch' and j['changed']>0 and len(j['tensors'])==51" || fail "inspect json"

# Errors: one line naming the problem, non-zero exit, no output file.
if "$wsync" apply "$s1" "$tmp/p01" -o "$tmp/bad.safetensors" 2> "$tmp/err"; then fail "wrong base accepted"; fi
grep -q "FailedPrecondition" "$tmp/err" && grep -q "base version" "$tmp/err" || fail "wrong-base message: $(cat "$tmp/err")"
[ ! -e "$tmp/bad.safetensors" ] || fail "output written on error"
head -c 1000 "$tmp/p01" > "$tmp/trunc"
if "$wsync" apply "$s0" "$tmp/trunc" -o "$tmp/bad.safetensors" 2> "$tmp/err"; then fail "truncated patch accepted"; fi
grep -q "truncated" "$tmp/err" || fail "truncation message: $(cat "$tmp/err")"
if "$wsync" apply "$tmp/p01" -o "$tmp/x" 2> "$tmp/err"; then fail "patch without base accepted"; fi
grep -q "needs its base" "$tmp/err" || fail "no-base message: $(cat "$tmp/err")"
if "$wsync" merge "$tmp/p01" "$tmp/p12" -o "$tmp/x" 2> "$tmp/err"; then fail "conditioned merge without base"; fi
grep -q -- "--base" "$tmp/err" || fail "merge message: $(cat "$tmp/err")"
if "$wsync" diff "$s0" /nonexistent -o "$tmp/x" 2> "$tmp/err"; then fail "missing file accepted"; fi
[ "$(wc -l < "$tmp/err")" -le 2 ] || fail "error is more than a line or two"
echo "PASS"
