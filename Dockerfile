# Builds every Crab binary, BPF programs included, reproducibly (Cargo.lock
# pinned, --locked), into an image that holds only them under /usr/bin.
#
#   make image    # offline from any registry: a Debian base made here by
#                 # debootstrap (packaging/image/build.sh), binaries copied
#                 # to target/image/
#   docker build --network host --build-arg BASE=debian:bookworm -t crab .
#
# BASE is any Debian 12 image; the Rust toolchain comes from rustup, the
# rest from Debian's archive.
ARG BASE=docker.io/library/debian:bookworm
FROM ${BASE} AS build
ARG RUST_VERSION=1.95.0
ENV DEBIAN_FRONTEND=noninteractive PATH=/root/.cargo/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl gcc libc6-dev \
      pkg-config protobuf-compiler libseccomp-dev clang llvm libbpf-dev bpftool \
 && rm -rf /var/lib/apt/lists/*
RUN curl --proto '=https' --tlsv1.2 -sSf -o /tmp/rustup-init \
      "https://static.rust-lang.org/rustup/dist/$(uname -m)-unknown-linux-gnu/rustup-init" \
 && chmod 755 /tmp/rustup-init \
 && /tmp/rustup-init -y --profile minimal --default-toolchain "$RUST_VERSION" \
 && rm /tmp/rustup-init
WORKDIR /src
COPY . .
# The inspector's build reads the build host's kernel BTF for vmlinux.h
# and fails the image (not a stub object) when it cannot.
RUN test -r /sys/kernel/btf/vmlinux \
 && cargo build --release --locked --workspace --bins \
 && ! grep -qs "BPF programs not built" target/release/build/crab-inspector-*/output

FROM scratch
COPY --from=build /src/target/release/containerd-shim-crab-v2 /src/target/release/crabd \
  /src/target/release/crabctl /src/target/release/containerd-crab-snapshotter \
  /src/target/release/crab-bench /usr/bin/
COPY packaging/crab.toml /etc/crab/crab.toml
