//! Diagnostics on stderr, in the spirit of `NCCL_DEBUG`: `SYMMALLOC_DEBUG=INFO` prints the
//! version, each device heap (backend, size), each communicator (ranks, devices, settings), the
//! algorithm AUTO picks for each new message size, and every segment exchange with the peer
//! mappings it made; `TRACE` adds a line per collective call. Each line starts with
//! `symmalloc:PID LEVEL`, and lines about a communicator name its rank.
//!
//! Each line is formatted whole and written with one `write(2)`, so the lines of ranks sharing
//! a terminal or a pipe never interleave mid-line (a pipe takes up to `PIPE_BUF`, 4 KiB, in one
//! piece; `eprintln!` writes each formatted piece apart).
//!
//! Invariants: off by default, and free when off: the `info!`/`trace!` macros test the level (one
//! relaxed atomic load once the variable has been read, expanded where they are written:
//! `debug_enabled!`) before formatting anything. The variable is
//! read once per process, through `config::debug_level` (config/settings.rs owns `Level`; the
//! levels: `OFF` and `WARN` are off, `INFO`, `TRACE`, any case). An unknown value fails the
//! allocator's creation (`heap::global`, so the first allocator call or `symm_comm_init`) with
//! `SYMM_ERR_INVALID_ARGUMENT` naming it; should diagnostics be asked for before that, one warning
//! names it and they stay off.

pub use crate::config::Level;
use std::sync::atomic::{AtomicU8, Ordering};

#[doc(hidden)]
pub const UNREAD: u8 = u8::MAX;
/// The level read (`UNREAD` until the variable is read); only `debug_enabled!` and `enabled`
/// look at it.
#[doc(hidden)]
pub static LEVEL: AtomicU8 = AtomicU8::new(UNREAD);

/// `debug_enabled!(level)`: whether messages of `level` are printed, tested where it is written
/// (one relaxed load once the variable has been read; `enabled` reads it the first time). The
/// `info!`/`trace!` macros use it, so a call's path with diagnostics off runs nothing of this
/// file.
#[macro_export]
macro_rules! debug_enabled {
    ($level:expr) => {{
        let l = $crate::debug::LEVEL.load(::std::sync::atomic::Ordering::Relaxed);
        if l == $crate::debug::UNREAD {
            $crate::debug::enabled($level)
        } else {
            l >= $level as u8
        }
    }};
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
    // config/settings.rs parses the value; an unknown one also fails the allocator's creation
    // (heap::global), so this warning only shows where diagnostics are asked for first.
    let value = crate::config::var("SYMMALLOC_DEBUG");
    let level = crate::config::debug_level().unwrap_or_else(|why| {
        write_line(
            &mut std::io::stderr(),
            &line(
                "WARN",
                format_args!("{} (diagnostics stay off)", why.message),
            ),
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
    write_line(&mut std::io::stderr(), &line(tag, args));
}

/// `symmalloc:PID TAG message\n`, formatted whole.
fn line(tag: &str, args: std::fmt::Arguments<'_>) -> String {
    format!("symmalloc:{} {tag} {args}\n", std::process::id())
}

/// Writes `line` with one `write(2)` (std's stderr is unbuffered and `write_all` hands it the
/// whole buffer; only a partial write, which a pipe never makes below `PIPE_BUF`, takes more).
/// A failed write is dropped: diagnostics never fail the call that prints them.
fn write_line(out: &mut impl std::io::Write, line: &str) {
    let _ = out.write_all(line.as_bytes());
}

/// `info!("...", args)`: a diagnostic line at INFO, formatted only when enabled.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => {
        if $crate::debug_enabled!($crate::debug::Level::Info) {
            $crate::debug::emit($crate::debug::Level::Info, format_args!($($arg)*));
        }
    };
}

/// `trace!("...", args)`: a diagnostic line at TRACE, formatted only when enabled.
#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => {
        if $crate::debug_enabled!($crate::debug::Level::Trace) {
            $crate::debug::emit($crate::debug::Level::Trace, format_args!($($arg)*));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::{line, write_line};
    use std::io::Read;
    use std::os::fd::FromRawFd;

    /// Writers that share a pipe with no lock between them (as ranks share a stderr): every line
    /// read back is one writer's whole line, so each line went out in one write.
    #[test]
    fn lines_from_concurrent_writers_never_interleave() {
        let mut fds = [0; 2];
        // SAFETY: fds is a valid array of two ints for pipe(2) to fill.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just created and are owned by these Files alone.
        let (mut rd, wr) = unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        };
        const WRITERS: usize = 4;
        const LINES: usize = 500;
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let mut out = wr.try_clone().unwrap();
                std::thread::spawn(move || {
                    for i in 0..LINES {
                        let fill = char::from(b'a' + w as u8).to_string().repeat(100 + i % 300);
                        let l = line("TRACE", format_args!("writer {w} line {i} {fill}"));
                        write_line(&mut out, &l);
                    }
                })
            })
            .collect();
        drop(wr);
        let mut all = String::new();
        rd.read_to_string(&mut all).unwrap();
        for t in writers {
            t.join().unwrap();
        }
        let mut seen = [0usize; WRITERS];
        for l in all.lines() {
            let rest = l
                .strip_prefix(&format!("symmalloc:{} TRACE writer ", std::process::id()))
                .unwrap_or_else(|| panic!("a line that is not whole: {l:?}"));
            let mut f = rest.split(' ');
            let w: usize = f.next().unwrap().parse().unwrap();
            assert_eq!(f.next(), Some("line"), "{l:?}");
            let i: usize = f.next().unwrap().parse().unwrap();
            let fill = char::from(b'a' + w as u8).to_string().repeat(100 + i % 300);
            assert_eq!(f.next(), Some(fill.as_str()), "{l:?}");
            assert_eq!(f.next(), None, "{l:?}");
            assert_eq!(i, seen[w], "writer {w}'s lines arrive in order");
            seen[w] += 1;
        }
        assert_eq!(seen, [LINES; WRITERS]);
    }
}
