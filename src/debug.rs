//! Diagnostics on stderr, in the spirit of `NCCL_DEBUG`: `SYMMALLOC_DEBUG=INFO` prints the
//! version, each device heap (backend, size), each communicator (ranks, devices, settings), the
//! algorithm AUTO picks for each new message size, and every segment exchange with the peer
//! mappings it made; `TRACE` adds a line per collective call. Each line starts with
//! `symmalloc:PID LEVEL`, and lines about a communicator name its rank.
//!
//! Invariants: off by default, and free when off: the `info!`/`trace!` macros test the level (one
//! relaxed atomic load once the variable has been read) before formatting anything. The
//! variable is read once per process; an unknown value prints one warning naming it and leaves
//! diagnostics off.

use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off = 0,
    Info = 1,
    Trace = 2,
}

const UNREAD: u8 = u8::MAX;
static LEVEL: AtomicU8 = AtomicU8::new(UNREAD);

/// The level a `SYMMALLOC_DEBUG` value asks for (case-insensitive; `WARN` and `OFF` are off, as
/// symmalloc reports every error through its return values).
pub fn parse(value: Option<&str>) -> std::result::Result<Level, String> {
    match value.map(|v| v.trim().to_ascii_uppercase()).as_deref() {
        None | Some("") | Some("OFF") | Some("WARN") => Ok(Level::Off),
        Some("INFO") => Ok(Level::Info),
        Some("TRACE") => Ok(Level::Trace),
        Some(_) => Err(format!(
            "SYMMALLOC_DEBUG={:?} is not a level; expected OFF, WARN, INFO or TRACE \
             (diagnostics stay off)",
            value.unwrap_or_default()
        )),
    }
}

/// Whether messages of `level` are printed.
#[inline]
pub fn enabled(level: Level) -> bool {
    let l = LEVEL.load(Ordering::Relaxed);
    let current = if l == UNREAD { read_env() } else { l };
    current >= level as u8
}

#[cold]
fn read_env() -> u8 {
    let value = std::env::var("SYMMALLOC_DEBUG").ok();
    let level = parse(value.as_deref()).unwrap_or_else(|why| {
        eprintln!("symmalloc:{} WARN {why}", std::process::id());
        Level::Off
    });
    // Only the first reader announces the version (the variable is read once per process).
    if LEVEL
        .compare_exchange(UNREAD, level as u8, Ordering::Relaxed, Ordering::Relaxed)
        .is_ok()
        && level >= Level::Info
    {
        emit(
            Level::Info,
            format_args!(
                "symmalloc {}, SYMMALLOC_DEBUG={}",
                env!("CARGO_PKG_VERSION"),
                value.unwrap_or_default()
            ),
        );
    }
    LEVEL.load(Ordering::Relaxed)
}

/// Prints one diagnostic line (callers test `enabled` first; the macros do).
pub fn emit(level: Level, args: std::fmt::Arguments<'_>) {
    let tag = if level == Level::Trace {
        "TRACE"
    } else {
        "INFO"
    };
    eprintln!("symmalloc:{} {tag} {args}", std::process::id());
}

/// `info!("...", args)`: a diagnostic line at INFO, formatted only when enabled.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => {
        if $crate::debug::enabled($crate::debug::Level::Info) {
            $crate::debug::emit($crate::debug::Level::Info, format_args!($($arg)*));
        }
    };
}

/// `trace!("...", args)`: a diagnostic line at TRACE, formatted only when enabled.
#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => {
        if $crate::debug::enabled($crate::debug::Level::Trace) {
            $crate::debug::emit($crate::debug::Level::Trace, format_args!($($arg)*));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_case_insensitively_and_unknown_ones_are_named() {
        assert_eq!(parse(None), Ok(Level::Off));
        assert_eq!(parse(Some("")), Ok(Level::Off));
        assert_eq!(parse(Some("warn")), Ok(Level::Off));
        assert_eq!(parse(Some("Info")), Ok(Level::Info));
        assert_eq!(parse(Some(" TRACE ")), Ok(Level::Trace));
        let e = parse(Some("LOUD")).unwrap_err();
        assert!(e.contains("\"LOUD\"") && e.contains("INFO or TRACE"), "{e}");
        assert!(Level::Trace > Level::Info && Level::Info > Level::Off);
    }
}
