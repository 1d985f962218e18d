//! crabd's metrics, in the Prometheus text format (`GET /metrics` on its
//! root-only socket, and on `[crabd.schedule] metrics_address` if set).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

use crab_api::Class;

/// A turn's or version's class, as a label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ClassLabel {
    class: ClassValue,
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum ClassValue {
    none,
    fs,
    proc,
    full,
}

/// What checkpoint bytes were written for, as a label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabel {
    kind: &'static str,
}

/// Every metric crabd keeps.
#[derive(Debug)]
pub(super) struct Metrics {
    registry: Registry,
    /// Turn ends classified, by the class the inspector chose.
    pub turns: Family<ClassLabel, Counter>,
    /// Versions published, by class.
    pub versions: Family<ClassLabel, Counter>,
    /// Turn ends that shared another turn's version (merged while queued).
    pub merged_turns: Counter,
    /// Turn ends that got no version (a rollback came first, or it failed).
    pub skipped_turns: Counter,
    /// Bytes written by checkpoints, by kind (`process_image`).
    pub bytes: Family<KindLabel, Counter>,
    /// Checkpoints waiting for a slot.
    pub queue_depth: Gauge,
    /// Seconds a checkpoint waited for its slot.
    pub queue_wait: Histogram,
    /// Slots in use.
    pub slots_in_use: Gauge,
    /// Queued checkpoints promoted because their turn's answer arrived.
    pub urgent_promotions: Counter,
    /// Seconds the inspector took to classify a turn.
    pub inspector_decision: Histogram,
    /// Seconds a sandbox was frozen for a capture.
    pub frozen: Histogram,
    /// Seconds a checkpoint took, queue wait excluded.
    pub checkpoint: Histogram,
    /// Seconds a rollback's restore took.
    pub restore: Histogram,
    /// Sandboxes recovered after a crash.
    pub recoveries: Counter,
    /// Turns rolled back because they broke a safety rule.
    pub safety_rollbacks: Counter,
    /// Captures refused because the checkpoint store had no room.
    pub store_full: Counter,
}

// === impl Metrics ===

impl Metrics {
    /// Fresh metrics, registered.
    pub(super) fn new() -> Self {
        let mut registry = Registry::with_prefix("crab");
        let r = &mut registry;
        let seconds = || Histogram::new(exponential_buckets(0.000_5, 2.0, 18));
        Metrics {
            turns: add(r, "turns", "Turn ends classified, by class", Family::default()),
            versions: add(r, "versions", "Versions published, by class", Family::default()),
            merged_turns: add(
                r,
                "merged_turns",
                "Turn ends that shared a queued turn's version",
                Counter::default(),
            ),
            skipped_turns: add(
                r,
                "skipped_turns",
                "Turn ends that got no version",
                Counter::default(),
            ),
            bytes: add(
                r,
                "checkpoint_bytes",
                "Bytes written by checkpoints, by kind",
                Family::default(),
            ),
            queue_depth: add(
                r,
                "queue_depth",
                "Checkpoints waiting for a slot",
                Gauge::default(),
            ),
            queue_wait: add(
                r,
                "queue_wait_seconds",
                "Time a checkpoint waited for a slot",
                seconds(),
            ),
            slots_in_use: add(r, "slots_in_use", "Checkpoint slots in use", Gauge::default()),
            urgent_promotions: add(
                r,
                "urgent_promotions",
                "Queued checkpoints promoted because their answer arrived",
                Counter::default(),
            ),
            inspector_decision: add(
                r,
                "inspector_decision_seconds",
                "Time the inspector took to classify a turn",
                seconds(),
            ),
            frozen: add(
                r,
                "frozen_seconds",
                "Time a sandbox was frozen for a capture",
                seconds(),
            ),
            checkpoint: add(
                r,
                "checkpoint_seconds",
                "Time a checkpoint took, queue wait excluded",
                seconds(),
            ),
            restore: add(r, "restore_seconds", "Time a rollback's restore took", seconds()),
            recoveries: add(
                r,
                "recoveries",
                "Sandboxes restored after their init crashed",
                Counter::default(),
            ),
            safety_rollbacks: add(
                r,
                "safety_rollbacks",
                "Turns rolled back because they broke a safety rule",
                Counter::default(),
            ),
            store_full: add(
                r,
                "store_full",
                "Captures refused because the checkpoint store had no room",
                Counter::default(),
            ),
            registry,
        }
    }

    /// The label of `class`.
    pub(super) fn class(class: Class) -> ClassLabel {
        let class = match class {
            Class::None => ClassValue::none,
            Class::Fs => ClassValue::fs,
            Class::Proc => ClassValue::proc,
            Class::Full => ClassValue::full,
        };
        ClassLabel { class }
    }

    /// The label of bytes written for `kind`.
    pub(super) fn kind(kind: &'static str) -> KindLabel {
        KindLabel { kind }
    }

    /// Every metric, in the Prometheus text format.
    pub(super) fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}

/// Registers `metric` in `r` as `name` and answers it (a handle that shares
/// its value with the registered one).
fn add<M: Metric + Clone>(r: &mut Registry, name: &str, help: &str, metric: M) -> M {
    r.register(name, help, metric.clone());
    metric
}
