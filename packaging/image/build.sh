#!/usr/bin/env bash
# `make image`: builds the Dockerfile with nothing from a registry. The base
# is a Debian 12 made here by debootstrap from Debian's archive and imported
# as crab/debian:bookworm; the image is tagged crab:latest and its binaries
# are copied to target/image/. Uses the host's docker when it answers, else a
# private dockerd (no bridge, no iptables: the build runs on the host's
# network) under target/image-docker/, stopped at the end. The base trusts
# the certificate authorities the host trusts. Run as root.
set -euo pipefail
cd "$(dirname "$0")/../.."
base=crab/debian:bookworm
out=target/image
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { printf '[image] %s\n' "$*" >&2; }

# One cleanup for every exit: the base's root being made, the private
# dockerd and the namespace mount it leaves when stopped.
root=
dockerd_pid=
cleanup() {
  [ -n "$root" ] && rm -rf "$root" "$root.log"
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
    for m in "$dir"/exec/netns/*; do
      mountpoint -q "$m" && umount "$m"
    done
  fi
  return 0
}
trap cleanup EXIT

if docker info >/dev/null 2>&1; then
  docker=(docker)
else
  dir=$PWD/target/image-docker
  mkdir -p "$dir"
  chmod 700 "$dir"
  log "starting a private dockerd in $dir"
  dockerd --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$dir/dockerd.pid" \
    -H "unix://$dir/d.sock" --bridge=none --iptables=false --ip6tables=false \
    >"$dir/dockerd.log" 2>&1 &
  dockerd_pid=$!
  docker=(docker -H "unix://$dir/d.sock")
  for _ in $(seq 100); do
    "${docker[@]}" info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { cat "$dir/dockerd.log" >&2; echo "dockerd did not start" >&2; exit 1; }
    sleep 0.2
  done
fi

if ! "${docker[@]}" image inspect "$base" >/dev/null 2>&1; then
  log "making $base with debootstrap from $mirror"
  root=$(mktemp -d /tmp/crab-base.XXXXXX)
  if ! debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1; then
    tail -20 "$root.log" >&2
    echo "debootstrap failed (above)" >&2
    exit 1
  fi
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  # The certificate authorities the host trusts (a proxy's, say): the build
  # reaches the same servers the host does, and ca-certificates takes them
  # in when the Dockerfile installs it.
  mkdir -p "$root/usr/local/share/ca-certificates"
  if [ -r /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$root/usr/local/share/ca-certificates/host-bundle.crt"
  fi
  tar -C "$root" -c . | "${docker[@]}" import - "$base" >/dev/null
  rm -rf "$root" "$root.log"
  root=
fi

log "building crab:latest on $base"
"${docker[@]}" build --network host --build-arg BASE="$base" -t crab:latest .
id=$("${docker[@]}" create --entrypoint /usr/bin/crabctl crab:latest)
rm -rf "$out"
mkdir -p "$out"
"${docker[@]}" cp "$id:/usr/bin/." "$out/"
"${docker[@]}" rm "$id" >/dev/null
ls -l "$out" >&2
log "done: crab:latest, binaries in $out/"
