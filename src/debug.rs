//! Diagnostics on stderr, in the spirit of `NCCL_DEBUG`: `SYMMALLOC_DEBUG=INFO` prints the
//! version, each device heap (backend, size), each communicator (ranks, devices, settings), the
//! algorithm AUTO picks for each new message size, and every segment exchange with the peer
//! mappings it made; `TRACE` adds a line per collective call. Each line starts with
//! `symmalloc:PID LEVEL`, and lines about a communicator name its rank.
//!
//! Invariants: off by default, and free when off: the `info!`/`trace!` macros test the level (one
//! relaxed atomic load once the variable has been read) before formatting anything. The variable is
//! read once per process, through `config::debug_level` (config/settings.rs owns `Level`; the
//! levels: `OFF` and `WARN` are off, `INFO`, `TRACE`, any case). An unknown value fails the
//! allocator's creation (`heap::global`, so the first allocator call or `symm_comm_init`) with
//! `SYMM_ERR_INVALID_ARGUMENT` naming it; should diagnostics be asked for before that, one warning
//! names it and they stay off.

pub use crate::config::Level;
use std::sync::atomic::{AtomicU8, Ordering};

const UNREAD: u8 = u8::MAX;
static LEVEL: AtomicU8 = AtomicU8::new(UNREAD);

/// Whether messages of `level` are printed.
#[inline]
pub fn enabled(level: Level) -> bool {
    let l = LEVEL.load(Ordering::Relaxed);
    let current = if l == UNREAD { read_env() } else { l };
    current >= level as u8
}

#[cold]
fn read_env() -> u8 {
    // config/settings.rs parses the value; an unknown one also fails the allocator's creation
    // (heap::global), so this warning only shows where diagnostics are asked for first.
    let value = crate::config::var("SYMMALLOC_DEBUG");
    let level = crate::config::debug_level().unwrap_or_else(|why| {
        eprintln!(
            "symmalloc:{} WARN {} (diagnostics stay off)",
            std::process::id(),
            why.message
        );
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
