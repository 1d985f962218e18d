#!/usr/bin/env bash
# Builds Crab's .deb (cargo-deb; the metadata is [package.metadata.deb] in
# cli/Cargo.toml) and prints its path.
#
#   packaging/deb/build.sh                  release build, then the package
#   packaging/deb/build.sh --binaries DIR   package the binaries already
#                                           built in DIR (the tests use
#                                           target/debug)
#   --fast                                  faster compression, a bigger file
#   --out DIR                               where the .deb goes
#                                           (default target/debian)
#
# The five binaries and crabctl's shell completions are staged in a
# private target directory, where cargo-deb's `target/release/` points,
# so it never strips the build's own binaries in place.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
export PATH="$HOME/.cargo/bin:$PATH"
bins=
fast=
out=$top/target/debian
while [ $# -gt 0 ]; do
  case $1 in
    --binaries) bins=$(cd "$2" && pwd); shift 2 ;;
    --fast) fast=--fast; shift ;;
    --out) mkdir -p "$2"; out=$(cd "$2" && pwd); shift 2 ;;
    *) echo "usage: $0 [--binaries DIR] [--fast] [--out DIR]" >&2; exit 2 ;;
  esac
done
if ! command -v cargo-deb >/dev/null; then
  echo "cargo-deb is missing: run packaging/install-deps.sh (or: cargo install cargo-deb --locked)" >&2
  exit 1
fi
if [ -z "$bins" ]; then
  (cd "$top" && cargo build --release --locked --workspace --bins)
  bins=$top/target/release
fi
mkdir -p "$top/target"
stage=$(mktemp -d "$top/target/deb-stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/release/completions"
for b in containerd-shim-crab-v2 crabd crabctl containerd-crab-snapshotter crab-bench; do
  if [ ! -x "$bins/$b" ]; then
    echo "$bins/$b is missing: build the workspace first (cargo build --workspace)" >&2
    exit 1
  fi
  cp "$bins/$b" "$stage/release/$b"
done
crabctl=$stage/release/crabctl
"$crabctl" completions bash > "$stage/release/completions/crabctl.bash"
"$crabctl" completions zsh > "$stage/release/completions/_crabctl"
"$crabctl" completions fish > "$stage/release/completions/crabctl.fish"
cd "$top"
CARGO_TARGET_DIR=$stage cargo deb --no-build --quiet $fast -p crab-cli --output "$out"
