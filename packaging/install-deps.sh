#!/usr/bin/env bash
# Installs everything Crab's build and tests need. Idempotent; run as root.
#
# Debian 12 (bookworm): base packages from bookworm, docker 26 from Debian 13
# (trixie). Debian 13 / Ubuntu 24.04+: every package from the host's own
# suite. Everywhere: CRIU at one pinned version, built from its Debian
# source package against the host's libraries (see below).
set -euo pipefail

CRIU_PREFIX=${CRIU_PREFIX:-/opt/crab/criu}
CRIU_VERSION=4.2.1
CRIU_SOURCE=${CRIU_SOURCE:-$(dirname "$(readlink -f "$0")")/criu/criu_$CRIU_VERSION.orig.tar.xz}
CRIU_SHA256=${CRIU_SHA256:-29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9}
export DEBIAN_FRONTEND=noninteractive

log() { printf '[install-deps] %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then
  echo "install-deps.sh must run as root" >&2
  exit 1
fi

. /etc/os-release
codename=${VERSION_CODENAME:-unknown}

base_pkgs=(
  containerd runc iptables zfs-fuse btrfs-progs
  clang llvm libbpf-dev bpftool protobuf-compiler libseccomp-dev pkg-config
  busybox-static debootstrap iproute2 procps psmisc curl ca-certificates
  git gcc libc6-dev sqlite3 dpkg-dev debconf
  python3 python3-pip python3-venv jq util-linux e2fsprogs
  # htpasswd (bcrypt), for the registry test that asks for credentials
  apache2-utils
  nodejs
  fonts-dejavu-core
  chromium chromium-driver
  # CRI pods' network (bridge, host-local, loopback)
  containernetworking-plugins
  # CRIU's build (below)
  make libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev libnl-3-dev
  libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev
)

missing=()
for p in "${base_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if [ "$codename" = bookworm ]; then
  # Trixie for docker 26 only, pinned low so nothing else moves.
  if [ ! -f /etc/apt/sources.list.d/crab-trixie.sources ]; then
    log "adding the trixie source (pinned to priority 100)"
    cat >/etc/apt/sources.list.d/crab-trixie.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    cat >/etc/apt/preferences.d/crab-trixie <<'PIN'
Package: *
Pin: release n=trixie
Pin-Priority: 100
PIN
    apt-get update -q
  fi
  if ! command -v dockerd >/dev/null || ! dockerd --version | grep -q 'version 2[6-9]'; then
    missing+=(docker.io/trixie docker-cli/trixie)
  fi
else
  missing_extra=(docker.io)
  for p in "${missing_extra[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
fi

if [ ${#missing[@]} -gt 0 ]; then
  log "installing: ${missing[*]}"
  apt-get update -q || true
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# docker.io's postinst may start services through init scripts; tests start
# their own daemons, so nothing here needs to stay running.

# An image registry for crabctl push/pull's tests: Debian's docker-registry
# binary alone, in /opt/crab/registry (its package would also run a
# registry service on every interface's :5000).
if [ ! -x /opt/crab/registry/docker-registry ]; then
  log "unpacking Debian's docker-registry into /opt/crab/registry"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -q docker-registry 2>/dev/null) ||
    (cd "$tmp" && chown _apt "$tmp" && apt-get download -q docker-registry)
  dpkg-deb -x "$tmp"/docker-registry_*.deb "$tmp/x"
  mkdir -p /opt/crab/registry
  cp "$tmp/x/usr/bin/docker-registry" /opt/crab/registry/
  rm -rf "$tmp"
fi

# checkpointctl (the checkpoint-archive tests read crabctl's checkpoint
# layout with it). Debian 13 packages it; on Debian 12 its trixie build runs
# under trixie's own C library, kept beside it in /opt/crab/checkpointctl
# (the host's libraries are not touched).
if ! checkpointctl --help >/dev/null 2>&1; then
  if [ "$codename" = bookworm ]; then
    log "installing checkpointctl from trixie, with trixie's C library beside it"
    cpdir=/opt/crab/checkpointctl
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -q checkpointctl/trixie libc6/trixie 2>/dev/null) ||
      (cd "$tmp" && chown _apt "$tmp" && apt-get download -q checkpointctl/trixie libc6/trixie)
    rm -rf "$cpdir" && mkdir -p "$cpdir"
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/x"; done
    cp "$tmp/x/usr/bin/checkpointctl" "$cpdir/"
    multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
    cp -a "$tmp/x/usr/lib/$multiarch/." "$cpdir/lib/" 2>/dev/null || cp -a "$tmp/x/lib/$multiarch/." "$cpdir/lib/"
    rm -rf "$tmp"
    loader=$(cd "$cpdir/lib" && ls ld-linux*.so.* | head -1)
    cat >/usr/local/bin/checkpointctl <<WRAP
#!/bin/sh
exec $cpdir/lib/$loader --library-path $cpdir/lib $cpdir/checkpointctl "\$@"
WRAP
    chmod 755 /usr/local/bin/checkpointctl
  else
    apt-get install -y -q --no-install-recommends checkpointctl
  fi
  checkpointctl --help >/dev/null || { echo "checkpointctl does not run: see above" >&2; exit 1; }
fi

# CRIU, pinned: version $CRIU_VERSION from its Debian source package. The
# upstream tarball Debian ships as criu_<version>.orig.tar.xz is kept in
# packaging/criu/ (byte for byte, sha256 as in Debian's signed .dsc) and
# checked again here; it is built against this host's own libraries into
# $CRIU_PREFIX and linked as /usr/local/sbin/criu. Nothing is downloaded, so
# no upload to any Debian suite can change or break it. (Distributions'
# binaries do not do: bookworm's 3.17 fails on current kernels, trixie's
# 4.1 cannot dump TCP sockets on Linux >= 6.16, sid's need trixie's glibc.)
criu_stamp="criu $CRIU_VERSION $CRIU_SHA256"
criu_fail() {
  printf 'install-deps.sh: %s\n' "$@" >&2
  exit 1
}
if [ "$(cat "$CRIU_PREFIX/BUILT" 2>/dev/null)" != "$criu_stamp" ] \
  || [ "$(readlink /usr/local/sbin/criu 2>/dev/null)" != "$CRIU_PREFIX/sbin/criu" ] \
  || ! "$CRIU_PREFIX/sbin/criu" --version >/dev/null 2>&1; then
  # Only a prefix this script made is replaced (BUILT; usr/sbin/criu from
  # before the pin), never a directory someone named by mistake.
  if [ -e "$CRIU_PREFIX" ] && ! [ -e "$CRIU_PREFIX/BUILT" ] && ! [ -x "$CRIU_PREFIX/usr/sbin/criu" ]; then
    criu_fail "CRIU_PREFIX=$CRIU_PREFIX exists and is not a CRIU this script built: refusing to replace it." \
      "  Fix: set CRIU_PREFIX to a new directory (the default is /opt/crab/criu)."
  fi
  log "building CRIU $CRIU_VERSION from $CRIU_SOURCE into $CRIU_PREFIX"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  case $CRIU_SOURCE in
    http://* | https://* | file://*)
      curl -fsSL --retry 3 -o "$tmp/criu.tar.xz" "$CRIU_SOURCE" \
        || criu_fail "cannot download CRIU's source from $CRIU_SOURCE." \
          "  Fix: set CRIU_SOURCE to a reachable CRIU >= 4.2 source tarball (and CRIU_SHA256 to its sha256)," \
          "  or unset it to build the copy in packaging/criu/." ;;
    *) cp "$CRIU_SOURCE" "$tmp/criu.tar.xz" \
        || criu_fail "cannot read CRIU's source $CRIU_SOURCE (a fresh clone has it in packaging/criu/)." ;;
  esac
  got=$(sha256sum "$tmp/criu.tar.xz" | cut -d' ' -f1)
  [ "$got" = "$CRIU_SHA256" ] \
    || criu_fail "CRIU's source $CRIU_SOURCE has sha256 $got, not $CRIU_SHA256: refusing to build it." \
      "  Fix: restore packaging/criu/ from git, or set CRIU_SHA256 to the sha256 of a CRIU >= 4.2 source you trust."
  mkdir "$tmp/src"
  tar -xf "$tmp/criu.tar.xz" -C "$tmp/src" --strip-components=1
  # The binary alone: no documentation, Python bindings or plugins.
  if ! make -C "$tmp/src" -j"$(nproc)" criu >"$tmp/build.log" 2>&1; then
    tail -30 "$tmp/build.log" >&2
    cp "$tmp/build.log" /var/log/crab-criu-build.log || true
    criu_fail "building CRIU $CRIU_VERSION failed (above; the whole log is /var/log/crab-criu-build.log)." \
      "  Fix: install its build dependencies (libprotobuf-c-dev protobuf-c-compiler libnl-3-dev" \
      "  libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev; this script's" \
      "  apt step does) and, on a /tmp mounted noexec, run again with TMPDIR on another filesystem."
  fi
  rm -rf "$CRIU_PREFIX.new"
  install -D -m 0755 "$tmp/src/criu/criu" "$CRIU_PREFIX.new/sbin/criu"
  echo "$criu_stamp" >"$CRIU_PREFIX.new/BUILT"
  rm -rf "$CRIU_PREFIX"
  mv -T "$CRIU_PREFIX.new" "$CRIU_PREFIX"
  ln -sfn "$CRIU_PREFIX/sbin/criu" /usr/local/sbin/criu
  rm -rf "$tmp"
  trap - EXIT
fi

# The official OpenAI and Anthropic Python SDKs, for the proxy's SDK tests
# (proxy/tests/sdk.rs), and the official MCP SDK, for the agent tool's test
# (tests/tests/agent_tools.rs), in a private venv so the system Python stays
# as it is.
SDK_VENV=${SDK_VENV:-/opt/crab/sdk-venv}
if ! "$SDK_VENV/bin/python3" -c 'import openai, anthropic, mcp' 2>/dev/null; then
  log "installing the openai, anthropic and mcp SDKs into $SDK_VENV"
  /usr/bin/python3 -m venv "$SDK_VENV" 2>/dev/null || python3 -m venv "$SDK_VENV"
  "$SDK_VENV/bin/pip" install -q --disable-pip-version-check 'openai>=1.40,<3' 'anthropic>=0.34,<1' 'mcp>=1.9,<2'
fi

# mini-swe-agent, an unmodified agent the integration tests run on the host
# against a crab container through crabd's host listener
# (tests/tests/mini_swe_agent.rs), in a venv of its own (it needs Python 3.10+).
MINI_VENV=${MINI_VENV:-/opt/crab/mini-venv}
# (Found, not imported: importing them writes config and reaches the network.)
if ! "$MINI_VENV/bin/python3" -c 'import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ("minisweagent", "litellm"))))' 2>/dev/null; then
  log "installing mini-swe-agent into $MINI_VENV"
  /usr/bin/python3 -m venv "$MINI_VENV" 2>/dev/null || python3 -m venv "$MINI_VENV"
  "$MINI_VENV/bin/pip" install -q --disable-pip-version-check 'mini-swe-agent>=2.4,<3'
fi

# Mounts that BPF and tests use.
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf || true
mountpoint -q /sys/kernel/tracing || mount -t tracefs none /sys/kernel/tracing || true

# The Rust toolchain (rustup's stable, with rustfmt and clippy for `make
# lint`), when the machine has none; an existing one is only completed.
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null; then
  log "installing Rust (rustup, stable, with rustfmt and clippy)"
  # rustup-init itself (what sh.rustup.rs fetches), from the host that
  # serves the toolchains: one name fewer to resolve.
  # It must be named rustup-init: rustup acts on the name it is run as.
  rustup_dir=$(mktemp -d)
  curl --proto '=https' --tlsv1.2 -sSf -o "$rustup_dir/rustup-init" \
    "https://static.rust-lang.org/rustup/dist/$(uname -m)-unknown-linux-gnu/rustup-init"
  chmod 755 "$rustup_dir/rustup-init"
  "$rustup_dir/rustup-init" -y --profile minimal --component rustfmt,clippy
  rm -rf "$rustup_dir"
elif command -v rustup >/dev/null; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
  done
fi

# cargo-deb builds the .deb (packaging/deb/build.sh, `make deb`, and the
# test that installs it), at a version known to take our metadata.
CARGO_DEB_VERSION=3.8.0
if [ "$(cargo-deb --version 2>/dev/null | awk '{print $2}')" != "$CARGO_DEB_VERSION" ]; then
  log "installing cargo-deb $CARGO_DEB_VERSION"
  cargo install --locked --quiet cargo-deb --version "=$CARGO_DEB_VERSION"
fi

# Last, so that a host where CRIU cannot work still gets everything else.
if ! criu_out=$(/usr/local/sbin/criu check 2>&1); then
  printf '%s\n' "$criu_out" >&2
  echo "install-deps.sh: 'criu check' fails on this host (above): sandboxes could not be checkpointed." >&2
  echo "  Fix: run on a kernel built with CONFIG_CHECKPOINT_RESTORE (Debian's and Ubuntu's are), as" >&2
  echo "  root and outside a restricted container; or rebuild CRIU: rm $CRIU_PREFIX/BUILT, run again." >&2
  exit 1
fi

log "done: $(cargo --version); $(containerd --version | head -1); runc $(runc --version | head -1 | awk '{print $3}'); $(dockerd --version); criu $(criu --version | head -1)"
