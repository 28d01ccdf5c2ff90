//! Logging: `tracing` with structured fields; human format by default, JSON with
//! `FLEET_LOG_FORMAT=json`; level from `RUST_LOG` (default `info,lapin=off`; lapin's targets
//! that log expected events at ERROR stay off whatever it says: [`LAPIN_EXPECTED_ERRORS`]).
//!
//! lapin's own log lines are off by default: it logs at ERROR what fleet handles and reports
//! itself, once and naming the setting — raw `Close { reply_code: 403 … }` frame dumps, and
//! `Connection error: invalid channel state: Closing` on every clean shutdown. `RUST_LOG=
//! info,lapin=debug` brings them back for debugging.
//!
//! **The AMQP client's TRACE lines are dropped whatever `RUST_LOG` says** ([`hides`]): lapin
//! dumps every frame it sends at TRACE, and the `connection.start-ok` frame carries the
//! PLAIN login as bytes (`response: LongString([0, 117, 115, 101, 114, 0, …])`,
//! `\0user\0password`), once per connection — no URL redaction can recognise a password
//! spelled as a byte list, so the lines never reach the formatter. This is a second, global
//! filter after `RUST_LOG`'s, so no directive (`trace`, `lapin=trace`,
//! `lapin::io_loop=trace`) can turn them on; `lapin=debug` still shows lapin's DEBUG lines.
//!
//! Every line goes through one writer that (1) hides URL passwords ([`crate::process::redact`]),
//! (2) escapes control characters ([`crate::process::escape_controls`]) so a task's `kind`, id
//! or error cannot forge lines or colour a terminal (colours are therefore off), and (3) never
//! blocks or fails the caller: lines are handed to a background thread (`tracing-appender`,
//! lossy when its buffer is full) and a failed write to stderr (closed, full pipe) is dropped
//! silently — logging must never kill a task or hold up a shutdown.

use std::io::Write;
use std::sync::Mutex;

use tracing::{Level, Metadata};
use tracing_appender::non_blocking::{NonBlocking, WorkerGuard};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Targets (and their sub-modules) whose TRACE lines dump AMQP frames, login included:
/// lapin's and its protocol crates'.
const FRAME_LOGGERS: [&str; 2] = ["lapin", "amq_protocol"];

/// Whether an event or span is dropped whatever `RUST_LOG` says: TRACE from the AMQP client
/// (see the module docs). Events that come through the `log` crate carry their own target
/// and are caught the same way.
pub fn hides(meta: &Metadata<'_>) -> bool {
    *meta.level() == Level::TRACE
        && FRAME_LOGGERS.iter().any(|t| {
            meta.target().strip_prefix(t).is_some_and(|rest| {
                rest.is_empty() || rest.starts_with("::") || rest.starts_with('_')
            })
        })
}

/// Flushes the background writer when dropped (see [`flush`]).
static GUARD: Mutex<Option<WorkerGuard>> = Mutex::new(None);

/// lapin's targets that log expected events at ERROR: every channel the server closes
/// (`lapin::channel`: a passive declare's 404 NOT_FOUND, a refused consume), every connection
/// that ends (`lapin::channels`: `Connection error … invalid channel state: Closing` on each
/// clean stop; `lapin::io_loop`: `error doing IO` on a node loss), a consumer's channel gone
/// (`lapin::consumer`) and each mandatory message returned (`lapin::returned_messages`, which
/// dumps the message). fleet receives each of these as a value and logs it itself, at the level
/// its meaning has (issue 37 item 6), so they stay off even under `RUST_LOG=info,lapin=warn`;
/// naming one of them in `RUST_LOG` (`lapin::channel=debug`) brings it back.
pub const LAPIN_EXPECTED_ERRORS: [&str; 5] = [
    "lapin::channel",
    "lapin::channels",
    "lapin::io_loop",
    "lapin::consumer",
    "lapin::returned_messages",
];

/// The log filter of `spec` (`RUST_LOG`; `None` or invalid: `info,lapin=off`), with each of
/// [`LAPIN_EXPECTED_ERRORS`] the spec does not name turned off.
pub fn filter(spec: Option<&str>) -> EnvFilter {
    let spec = spec.filter(|s| !s.trim().is_empty());
    let mut filter = spec
        .and_then(|s| EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| EnvFilter::new("info,lapin=off"));
    let named = |target: &str| {
        spec.is_some_and(|s| {
            s.split(',')
                .any(|d| d.trim().split(['=', '[']).next() == Some(target))
        })
    };
    for target in LAPIN_EXPECTED_ERRORS {
        if !named(target) {
            if let Ok(d) = format!("{target}=off").parse() {
                filter = filter.add_directive(d);
            }
        }
    }
    filter
}

/// Installs the global subscriber (once; later calls do nothing).
pub fn init(format: &str) {
    let filter = filter(std::env::var("RUST_LOG").ok().as_deref());
    let (writer, guard) = tracing_appender::non_blocking(Stderr);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(false)
        .log_internal_errors(false)
        .with_writer(Sanitizing(writer));
    let frames = filter_fn(|meta| !hides(meta));
    let installed = if format == "json" {
        builder.json().finish().with(frames).try_init().is_ok()
    } else {
        builder.finish().with(frames).try_init().is_ok()
    };
    if installed {
        if let Ok(mut g) = GUARD.lock() {
            *g = Some(guard);
        }
    }
}

/// Writes out the lines still queued (up to the appender's own timeout). Call before exit.
pub fn flush() {
    let guard = GUARD.lock().ok().and_then(|mut g| g.take());
    drop(guard);
}

/// stderr, with write errors swallowed (a closed stderr is not the task's problem).
struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// The log writer: redacts and escapes each formatted line, then queues it.
#[derive(Clone)]
struct Sanitizing(NonBlocking);

impl<'a> MakeWriter<'a> for Sanitizing {
    type Writer = SanitizingLine;
    fn make_writer(&'a self) -> Self::Writer {
        SanitizingLine(self.0.clone())
    }
}

struct SanitizingLine(NonBlocking);

impl Write for SanitizingLine {
    /// Called with one whole formatted event (the formatter writes its buffer at once).
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.0.write_all(sanitize(buf).as_bytes());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One formatted line, made safe to print: its trailing newline kept, every other control
/// character escaped, every URL password hidden.
pub fn sanitize(buf: &[u8]) -> String {
    let text = String::from_utf8_lossy(buf);
    let (body, newline) = match text.strip_suffix('\n') {
        Some(b) => (b, "\n"),
        None => (text.as_ref(), ""),
    };
    let escaped = crate::process::escape_controls(body);
    format!("{}{newline}", crate::process::redact(&escaped))
}

#[cfg(test)]
mod tests {
    #[test]
    fn lapin_expected_errors_stay_off_unless_named() {
        let f = super::filter(Some("info,lapin=warn")).to_string();
        for t in super::LAPIN_EXPECTED_ERRORS {
            assert!(f.contains(&format!("{t}=off")), "{t} in {f}");
        }
        assert!(f.contains("lapin=warn"), "{f}");
        let f = super::filter(Some("info,lapin::channel=debug")).to_string();
        assert!(
            f.contains("lapin::channel=debug") && !f.contains("lapin::channel=off"),
            "{f}"
        );
        assert!(f.contains("lapin::channels=off"), "{f}");
        let f = super::filter(None).to_string();
        assert!(f.contains("lapin=off") && f.contains("info"), "{f}");
    }

    #[test]
    fn a_line_is_made_safe() {
        let line =
            super::sanitize(b"INFO kind=echo\nFAKE level=ERROR \x1b[31m url=AMQP://u:hunter2@h/\n");
        assert_eq!(
            line,
            "INFO kind=echo\\nFAKE level=ERROR \\u{1b}[31m url=AMQP://***@h/\n"
        );
    }
}
