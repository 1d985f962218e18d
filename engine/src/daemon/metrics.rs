//! crabd's metrics, in the Prometheus text format (`GET /metrics` on its
//! root-only socket, and on `[crabd.schedule] metrics_address` if set).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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
}

// === impl Metrics ===

impl Metrics {
    /// Fresh metrics, registered.
    pub(super) fn new() -> Self {
        let mut registry = Registry::with_prefix("crab");
        let seconds = || Histogram::new(exponential_buckets(0.000_5, 2.0, 18));
        let m = Metrics {
            turns: Family::default(),
            versions: Family::default(),
            merged_turns: Counter::default(),
            skipped_turns: Counter::default(),
            bytes: Family::default(),
            queue_depth: Gauge::default(),
            queue_wait: seconds(),
            slots_in_use: Gauge::default(),
            urgent_promotions: Counter::default(),
            inspector_decision: seconds(),
            frozen: seconds(),
            checkpoint: seconds(),
            restore: seconds(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register("turns", "Turn ends classified, by class", m.turns.clone());
        r.register("versions", "Versions published, by class", m.versions.clone());
        r.register(
            "merged_turns",
            "Turn ends that shared a queued turn's version",
            m.merged_turns.clone(),
        );
        r.register(
            "skipped_turns",
            "Turn ends that got no version",
            m.skipped_turns.clone(),
        );
        r.register(
            "checkpoint_bytes",
            "Bytes written by checkpoints, by kind",
            m.bytes.clone(),
        );
        r.register(
            "queue_depth",
            "Checkpoints waiting for a slot",
            m.queue_depth.clone(),
        );
        r.register(
            "queue_wait_seconds",
            "Time a checkpoint waited for a slot",
            m.queue_wait.clone(),
        );
        r.register("slots_in_use", "Checkpoint slots in use", m.slots_in_use.clone());
        r.register(
            "urgent_promotions",
            "Queued checkpoints promoted because their answer arrived",
            m.urgent_promotions.clone(),
        );
        r.register(
            "inspector_decision_seconds",
            "Time the inspector took to classify a turn",
            m.inspector_decision.clone(),
        );
        r.register(
            "frozen_seconds",
            "Time a sandbox was frozen for a capture",
            m.frozen.clone(),
        );
        r.register(
            "checkpoint_seconds",
            "Time a checkpoint took, queue wait excluded",
            m.checkpoint.clone(),
        );
        r.register(
            "restore_seconds",
            "Time a rollback's restore took",
            m.restore.clone(),
        );
        Metrics { registry, ..m }
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
