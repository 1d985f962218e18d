# Crab: the two commands a newcomer needs (run as root on Debian 12/13 or
# Ubuntu 24.04+):
#   make demo    install dependencies, build, run the demo on embedded defaults
#   make test    install dependencies, check formatting and lints, run every test
# Rust as packaging/install-deps.sh installs it when the machine has none.
export PATH := $(HOME)/.cargo/bin:$(PATH)

.PHONY: deps build release demo test lint bench install deb image

deps:
	packaging/install-deps.sh

build:
	cargo build --workspace --locked

release:
	cargo build --release --workspace --locked

demo: deps release
	packaging/demo.sh

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --locked -- -D warnings

# The integration tests run the built binaries (containerd starts the shim
# from PATH), which `cargo test` alone does not build. --no-fail-fast: one
# failing test binary must not hide the others.
test: deps lint build
	cargo test --workspace --locked --no-fail-fast

bench: deps release
	target/release/crab-bench runtime
	target/release/crab-bench fs
	target/release/crab-bench checkpoint --mb 100,500,1000 --runs 5
	target/release/crab-bench recovery
	target/release/crab-bench fastforward
	target/release/crab-bench proxy
	target/release/crab-bench proxy --think-ms 20
	target/release/crab-bench turn
	target/release/crab-bench inspector
	target/release/crab-bench faults
	target/release/crab-bench density
	target/release/crab-bench eval --quick --out target/eval-report

install: release
	packaging/install.sh

# target/debian/crab_<version>_<arch>.deb: all five binaries, the default
# /etc/crab/crab.toml, systemd units, completions (packaging/deb).
deb: deps release
	packaging/deb/build.sh --binaries target/release

# The Dockerfile, built with nothing from a registry (a Debian base made by
# debootstrap); crab:latest, its binaries copied to target/image/.
image: deps
	packaging/image/build.sh
