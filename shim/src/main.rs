//! `containerd-shim-crab-v2`: see the `crab_shim` crate.

fn main() {
    crab_shim::run();
}
