#!/usr/bin/env bash
# The crab runtime end to end on embedded defaults: a private containerd in a
# temporary directory, a busybox image built locally, and a sandbox run with
# `ctr --runtime io.containerd.crab.v2`. Leaves nothing behind. Run as root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
bin=$top/target/release
work=$(mktemp -d /tmp/crab-demo.XXXXXX)
# The inspector's BPF objects are pinned for the life of the host; the
# demo's go in a directory of their own, removed on exit.
pins=/sys/fs/bpf/$(basename "$work" | tr . -)  # bpffs names take no dots
ctd_pid=
cleanup() {
  ctr -a "$work/c.sock" task kill -s SIGKILL demo >/dev/null 2>&1 || true
  sleep 0.3
  ctr -a "$work/c.sock" task delete demo >/dev/null 2>&1 || true
  ctr -a "$work/c.sock" container rm demo >/dev/null 2>&1 || true
  for c in $(ctr -a "$work/c.sock" container ls -q 2>/dev/null); do
    ctr -a "$work/c.sock" task kill -s SIGKILL "$c" >/dev/null 2>&1 || true
    sleep 0.3
    ctr -a "$work/c.sock" task delete "$c" >/dev/null 2>&1 || true
    ctr -a "$work/c.sock" container rm "$c" >/dev/null 2>&1 || true
  done
  if [ -f "$work/crabd/crabd.pid" ]; then
    crabd_pid=$(cat "$work/crabd/crabd.pid")
    kill "$crabd_pid" 2>/dev/null || true
    for _ in $(seq 50); do [ -e "/proc/$crabd_pid/exe" ] || break; sleep 0.1; done
  fi
  for _ in $(seq 20); do rm -rf "$pins" 2>/dev/null && break; sleep 0.2; done
  [ -n "$ctd_pid" ] && kill "$ctd_pid" 2>/dev/null && wait "$ctd_pid" 2>/dev/null || true
  umount -R "$work/root" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

cat >"$work/config.toml" <<CFG
version = 2
root = "$work/root"
state = "$work/state"
[grpc]
  address = "$work/c.sock"
CFG
# Embedded defaults, except that transcripts, crabd's socket and its versions
# stay in the demo's directory.
printf '[shim.proxy]\ntranscript_dir = "%s/transcripts"\n[crabd]\nsocket = "%s/crabd.sock"\nroot = "%s/crabd"\ninspector_pin_dir = "%s"\n' \
  "$work" "$work" "$work" "$pins" >"$work/crab.toml"
CRAB_CONFIG=$work/crab.toml PATH=$bin:$PATH containerd --config "$work/config.toml" >"$work/containerd.log" 2>&1 &
ctd_pid=$!
for _ in $(seq 100); do ctr -a "$work/c.sock" version >/dev/null 2>&1 && break; sleep 0.1; done
C="ctr -a $work/c.sock"

say "a busybox image, built locally"
"$top/tests/fixtures/mkimage.sh" "$work/busybox.tar" docker.io/crab/busybox:demo
$C image import "$work/busybox.tar"

say "ctr run --rm --runtime io.containerd.crab.v2 ... (exit status 3 comes back)"
set +e
$C run --rm --runtime io.containerd.crab.v2 docker.io/crab/busybox:demo hello \
  sh -c 'echo "hello from a crab sandbox: $(uname -sr), pid $$"; exit 3'
echo "exit status: $?"
set -e

say "a long-running sandbox: exec, ps, pause/resume, metrics"
$C run -d --runtime io.containerd.crab.v2 docker.io/crab/busybox:demo demo \
  sh -c 'while true; do date > /tmp/now; sleep 1; done'
$C task exec --exec-id look demo sh -c 'echo "inside: $(cat /tmp/now)"; cat /proc/1/cgroup | grep "^0::"'
$C task ps demo
$C task pause demo && $C task ls
$C task resume demo && $C task ls
$C task metrics demo >"$work/metrics"
head -8 "$work/metrics"

say "the agent's LLM proxy, injected into the sandbox's own network namespace"
$C task exec --exec-id env demo sh -c 'echo "OPENAI_BASE_URL=$OPENAI_BASE_URL ANTHROPIC_BASE_URL=$ANTHROPIC_BASE_URL"; netstat -ltn 2>/dev/null | grep 7878 || true'

say "checkpoint, change, roll back: the shell's counter (memory) and its file come back"
CRABCTL="$bin/crabctl --socket $work/crabd.sock"
$C task kill -s SIGKILL demo >/dev/null; sleep 0.5; $C task delete demo >/dev/null 2>&1; $C container rm demo >/dev/null
$C run -d --runtime io.containerd.crab.v2 docker.io/crab/busybox:demo demo \
  sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/n; sleep 0.1; done'
for _ in $(seq 50); do $CRABCTL ps 2>/dev/null | grep -q demo && break; sleep 0.1; done
$CRABCTL ps
$CRABCTL checkpoint demo
echo "at the checkpoint: $($C task exec --exec-id n1 demo cat /tmp/n)"
sleep 1
echo "a second later:    $($C task exec --exec-id n2 demo cat /tmp/n)"
$CRABCTL rollback demo 1
echo "rolled back:       $($C task exec --exec-id n3 demo cat /tmp/n)"
$CRABCTL versions demo

say "the inspector: what did a turn change? (a read: none; a write: fs, or full if the counter loop ran in that turn too)"
$CRABCTL turn demo >/dev/null
$C task exec --exec-id r1 demo ls / >/dev/null
$CRABCTL turn demo
$C task exec --exec-id w1 demo sh -c 'echo hello > /greeting'
$CRABCTL turn demo

say "fork version 1: a second sandbox runs on from the same state"
$CRABCTL fork demo 1 --name demo-fork
sleep 0.5
echo "fork counts from:  $($C task exec --exec-id n4 demo-fork cat /tmp/n)"
$C task ls

say "what happened to the sandbox, as crabd logged it (crabctl ui: the same, live, as a page)"
$CRABCTL logs demo -n 12

say "done: containerd, crabd, the sandboxes and every file are removed on exit"
