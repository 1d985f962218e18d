//! Progress bars for transfers (hidden with `--json` or off a terminal).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-counting bar labelled `what`; hidden when `quiet`.
pub fn bar(quiet: bool, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    if quiet {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec}")
            .expect("a valid template"),
    );
    bar.set_message(what.to_owned());
    bar
}

/// Moves `bar` to `n` bytes of `total`.
pub fn tick(bar: &ProgressBar, n: u64, total: Option<u64>) {
    if let Some(t) = total {
        bar.set_length(t);
    }
    bar.set_position(n);
}

/// Moves `bar` to `n` bytes of `total` of `phase`, relabelled (and
/// restarted) when the phase changes.
pub fn phase(bar: &ProgressBar, phase: &'static str, n: u64, total: Option<u64>) {
    if bar.message() != phase {
        bar.set_message(phase);
        bar.reset();
    }
    tick(bar, n, total);
}
