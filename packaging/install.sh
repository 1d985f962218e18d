#!/usr/bin/env bash
# Installs the crab runtime where containerd finds it, and the default
# configuration. Run as root after `cargo build --release --workspace`.
#
#   PREFIX     where binaries go (default /usr/local; containerd looks the
#              shim up on its PATH as containerd-shim-crab-v2)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
PREFIX=${PREFIX:-/usr/local}
bin=$top/target/release/containerd-shim-crab-v2
if [ ! -x "$bin" ]; then
  echo "build first: cargo build --release --workspace" >&2
  exit 1
fi
install -D -m 0755 "$bin" "$PREFIX/bin/containerd-shim-crab-v2"
install -D -m 0755 "$top/target/release/containerd-crab-snapshotter" "$PREFIX/bin/containerd-crab-snapshotter"
# crabd is started by the first shim that needs it ([crabd] autostart), or
# by its systemd unit; crabctl is the user's command.
install -D -m 0755 "$top/target/release/crabd" "$PREFIX/bin/crabd"
install -D -m 0755 "$top/target/release/crabctl" "$PREFIX/bin/crabctl"
install -D -m 0644 "$top/README.md" "$PREFIX/share/doc/crab/README.md"
if [ -d /etc/systemd/system ]; then
  # The units name the .deb's paths (/usr/bin, /usr/share/doc).
  for unit in containerd-crab-snapshotter.service crabd.service; do
    sed -e "s#/usr/bin/#$PREFIX/bin/#" -e "s#/usr/share/doc/#$PREFIX/share/doc/#" "$here/systemd/$unit" > "/etc/systemd/system/$unit"
    chmod 0644 "/etc/systemd/system/$unit"
  done
fi
if [ ! -e /etc/crab/crab.toml ]; then
  install -D -m 0644 "$here/crab.toml" /etc/crab/crab.toml
fi
cat <<MSG
installed $PREFIX/bin/{containerd-shim-crab-v2,crabd,crabctl} and /etc/crab/crab.toml

  ctr:        ctr run --runtime io.containerd.crab.v2 IMAGE ID CMD...
  docker:     docker run --runtime io.containerd.crab.v2 IMAGE CMD...
              or merge $here/docker/daemon.json into /etc/docker/daemon.json,
              restart dockerd, then: docker run --runtime crab IMAGE CMD...
  Kubernetes: merge $here/containerd/config.toml into containerd's config and
              create a RuntimeClass with handler "crab"
  ZFS snapshotter: set [snapshotter] dataset in /etc/crab/crab.toml, merge
              $here/containerd/snapshotter.toml into containerd's config,
              systemctl enable --now containerd-crab-snapshotter, then:
              ctr run --snapshotter crabzfs ...
  checkpoints: crabctl ps | checkpoint ID | versions ID | rollback ID N |
              fork ID N | export ID N FILE | import FILE
MSG
