#!/usr/bin/env bash
# Installs everything Crab's build and tests need. Idempotent; run as root.
#
# Debian 12 (bookworm): base packages from bookworm; docker 26 from Debian 13
# (trixie); CRIU 4.2 from sid with trixie's libraries. bookworm's CRIU 3.17
# fails on Linux >= 6.x ("Unexpected rt vDSO area bounds"), trixie's 4.1
# cannot dump TCP sockets on Linux >= 6.16, and both newer ones need glibc
# 2.38, so CRIU is unpacked into a private prefix with its own loader
# instead of being installed system-wide.
#
# Debian 13 / Ubuntu 24.04+: every package comes from the host's own suite
# (on Linux >= 6.16 their CRIU must be 4.2 or newer for sockets).
set -euo pipefail

CRIU_PREFIX=${CRIU_PREFIX:-/opt/crab/criu}
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
  nodejs
  fonts-dejavu-core
  chromium chromium-driver
)

missing=()
for p in "${base_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if [ "$codename" = bookworm ]; then
  # Trixie for docker 26 and CRIU 4.x only, pinned low so nothing else moves.
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
  missing_extra=(docker.io criu)
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

if [ "$codename" = bookworm ]; then
  if ! [ -x /usr/local/sbin/criu ] || ! /usr/local/sbin/criu --version 2>/dev/null | grep -q 'Version: 4\.[2-9]'; then
    # CRIU >= 4.2: 4.1 cannot dump TCP sockets on Linux >= 6.16 (the kernel
    # refuses SO_PASSSEC on them; checkpoint-restore/criu#2718). CRIU 4.2
    # and the two libraries it needs newer come from sid, read through a
    # private apt state so the system's sources stay as they are; the rest
    # comes from trixie.
    log "unpacking CRIU 4.2 (sid) and its libraries (trixie) into $CRIU_PREFIX"
    criu_pkgs=(libc6 libbsd0 libgnutls30t64 libnftables1
      libprotobuf-c1 libuuid1 libmd0 libp11-kit0 libidn2-0
      libunistring5 libtasn1-6 libnettle8t64 libhogweed6t64 libgmp10 libjansson4
      libmnl0 libnftnl11 libxtables12 libffi8 libedit2 libtinfo6 libbpf1
      libelf1t64 zlib1g libzstd1 libcap2)
    sid_pkgs=(criu libcompel1 libnet9 libnl-3-200)
    tmp=$(mktemp -d); chmod 755 "$tmp"
    mkdir -p "$tmp/lists/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main" >"$tmp/sid.list"
    sid=(-o Dir::Etc::sourcelist="$tmp/sid.list" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$tmp/lists")
    apt-get -q "${sid[@]}" update
    (cd "$tmp" && apt-get download -q $(printf '%s/trixie ' "${criu_pkgs[@]}"))
    (cd "$tmp" && apt-get download -q "${sid[@]}" "${sid_pkgs[@]}")
    rm -rf "$CRIU_PREFIX.new"
    mkdir -p "$CRIU_PREFIX.new"
    # sid's packages last: they replace trixie's where both have a file.
    for deb in $(ls "$tmp"/*.deb | grep -v -e /criu_ -e /libcompel1_ -e /libnet9_ -e /libnl-3-200_); do dpkg-deb -x "$deb" "$CRIU_PREFIX.new"; done
    for deb in "$tmp"/criu_*.deb "$tmp"/libcompel1_*.deb "$tmp"/libnet9_*.deb "$tmp"/libnl-3-200_*.deb; do dpkg-deb -x "$deb" "$CRIU_PREFIX.new"; done
    rm -rf "$tmp" "$CRIU_PREFIX"
    mv "$CRIU_PREFIX.new" "$CRIU_PREFIX"
    cat >/usr/local/sbin/criu <<WRAP
#!/bin/sh
# CRIU 4.2 (Debian sid) with Debian 13 libraries, run through its own loader (installed by Crab's install-deps.sh).
P=$CRIU_PREFIX
exec "\$P/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "\$P/usr/lib/x86_64-linux-gnu" "\$P/usr/sbin/criu" "\$@"
WRAP
    chmod 755 /usr/local/sbin/criu
  fi
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
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
    sh -s -- -y --profile minimal --component rustfmt,clippy
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

log "done: $(cargo --version); $(containerd --version | head -1); runc $(runc --version | head -1 | awk '{print $3}'); $(dockerd --version); criu $(criu --version | head -1)"
