//! The shim's one `tracing` subscriber: every event (the shim's own, the
//! proxy's and the other libraries' it runs) goes to containerd's log FIFO
//! through containerd-shim's logger, with its fields and those of the
//! spans it is in (`sandbox`, `turn`, `version`, `class`, `pid`,
//! `elapsed_ms`, …) as logrus key-values, so containerd's log says
//! `level=warn sandbox="s1" turn="3" … msg="turn hook failed; answer released"`.
//!
//! containerd-shim installs its FIFO logger as the `log` crate's logger and
//! sets its level from containerd's `-debug` flag and `RUST_LOG`; this
//! layer hands each event to that logger, so both honour one level.

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;

/// Installs the subscriber (once per process; later calls do nothing).
///
/// Not `try_init`: where the workspace enables tracing-subscriber's
/// `tracing-log` feature, that would also take the `log` crate's logger,
/// which containerd-shim must install itself.
pub fn init() {
    let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(ToLog));
}

/// The layer: each event becomes one `log` record.
struct ToLog;

/// A span's fields, kept in its extensions.
#[derive(Default)]
struct Fields(Vec<(&'static str, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name(), format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name(), value.to_owned()));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        // The whole chain: containerd's log must say why, not only what.
        self.0.push((field.name(), crab_api::error_chain(value)));
    }
}

fn level(level: &Level) -> log::Level {
    match *level {
        Level::ERROR => log::Level::Error,
        Level::WARN => log::Level::Warn,
        Level::INFO => log::Level::Info,
        Level::DEBUG => log::Level::Debug,
        Level::TRACE => log::Level::Trace,
    }
}

/// `value` as it may stand between the quotes of a logrus value.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for ToLog {
    fn enabled(&self, meta: &tracing::Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        // Spans are kept whatever their level: their fields label the
        // events inside. libcontainer's debug events print whole specs
        // (environments): never below warn.
        let level = level(meta.level());
        meta.is_span()
            || (level <= log::max_level()
                && (level <= log::Level::Warn || !meta.target().starts_with("libcontainer")))
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        // Formatted before the span's extensions are locked: a value's
        // `Debug` may itself log.
        let mut more = Fields::default();
        values.record(&mut more);
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                fields.0.extend(more.0);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let meta = event.metadata();
        let log_meta = log::Metadata::builder()
            .level(level(meta.level()))
            .target(meta.target())
            .build();
        let logger = log::logger();
        if !logger.enabled(&log_meta) {
            return;
        }
        // Outer spans' fields first; an inner field of the same name wins.
        let mut pairs: Vec<(&'static str, String)> = Vec::new();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<Fields>() {
                    pairs.extend(fields.0.iter().map(|(k, v)| (*k, escape(v))));
                }
            }
        }
        let mut own = Fields::default();
        event.record(&mut own);
        let mut message = String::new();
        for (name, value) in own.0 {
            match name {
                "message" => message = value,
                _ => pairs.push((name, escape(&value))),
            }
        }
        let mut seen = std::collections::HashSet::new();
        let mut kvs: Vec<(&str, String)> = Vec::new();
        for (name, value) in pairs.into_iter().rev() {
            if seen.insert(name) {
                kvs.push((name, value));
            }
        }
        kvs.reverse();
        let kvs: Vec<(&str, &str)> = kvs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let text = escape(&message);
        logger.log(
            &log::Record::builder()
                .metadata(log_meta)
                .module_path(meta.module_path())
                .file(meta.file())
                .line(meta.line())
                .key_values(&kvs)
                .args(format_args!("{text}"))
                .build(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(value: &str, expected: &str) {
        assert_eq!(escape(value), expected, "{value:?}");
    }

    #[test]
    fn values_stay_inside_their_quotes_and_line() {
        check("plain", "plain");
        check(r#"invalid sandbox id "x""#, r#"invalid sandbox id \"x\""#);
        check("a\\b", "a\\\\b");
        check("criu said:\nError (x)\r", "criu said:\\nError (x)\\r");
    }
}
