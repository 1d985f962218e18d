# Builds every Crab binary reproducibly (Cargo.lock pinned, --locked).
#   docker build --output type=local,dest=out .
FROM docker.io/library/rust:1.95-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libseccomp-dev pkg-config clang llvm libbpf-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --workspace --bins

FROM scratch
COPY --from=build /src/target/release/containerd-shim-crab-v2 /src/target/release/crab-bench /
