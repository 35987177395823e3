//! The settings: for every `SYMMALLOC_*` variable but `SYMMALLOC_UNIQUE_ID`, which variable it
//! is, its typed value ([`Level`], [`BackendKind`], sizes, counts, ...), its default and the
//! limits it is accepted within, read through one of the parsers of vars.rs (the `Vars` methods
//! named after the settings), and [`parse_grid`] for `SYMMALLOC_LL_GRID`.
//!
//! Invariant: a setting's default and limits live here once; its parser and the rest of the
//! library read them from here.

use super::vars::Vars;
use crate::error::Result;
use std::time::Duration;

/// The diagnostics level of `SYMMALLOC_DEBUG` ([`debug_level`](super::debug_level); debug.rs
/// prints at it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off = 0,
    Info = 1,
    Trace = 2,
}

/// Which memory backend the process uses (`SYMMALLOC_BACKEND=cuda|host`, default cuda).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cuda,
    Host,
}

/// The longest `SYMMALLOC_TIMEOUT_S` accepted (about 11.6 days): far beyond any wait worth
/// having, and far below what `Duration` or a nanosecond count in a `u64` can hold.
pub const MAX_TIMEOUT_S: f64 = 1e6;
/// The shortest `SYMMALLOC_TIMEOUT_S` accepted (1 ms): shorter rounds towards zero.
pub const MIN_TIMEOUT_S: f64 = 1e-3;
/// `SYMMALLOC_TIMEOUT_S` when unset.
pub const DEFAULT_TIMEOUT_S: f64 = 60.0;

/// Split slots a communicator made by `symm_comm_init` reserves by default
/// (`SYMMALLOC_SPLIT_SLOTS`; comm/group/slots.rs): two children (a TP and an EP group split from
/// the world) cost no new device memory, and a split costs a small part of a fresh init
/// (bench/RESULTS.md, "Groups"), for 32 MiB of device memory per communicator made by init.
pub const DEFAULT_SPLIT_SLOTS: u64 = 2;
/// The most split slots one communicator reserves (a free-slot mask is one word).
pub const MAX_SPLIT_SLOTS: u64 = 64;

/// The default arena: 1/64 of the heap, at least 256M (a communicator's LL buffers take up to
/// 20M), at most a quarter of the heap.
pub fn default_comm_arena_bytes(heap: u64) -> u64 {
    (heap / 64).max(256 << 20).min(heap / 4)
}

/// The longest `SYMMALLOC_HOST_ID` accepted (it travels in the unique id, which has 55 bytes
/// for a host name).
pub const MAX_HOST_ID: usize = 55;

/// Default capacity of the one-shot LL kernel's slots (`SYMMALLOC_LL_BYTES`) by world size:
/// each rank pushes world - 1 copies, so LL pays off to smaller sizes in wider worlds.
pub fn default_ll_bytes(world: usize) -> u64 {
    match world {
        0..=2 => 4 << 20,
        3..=4 => 1 << 20,
        _ => 256 << 10,
    }
}
/// The largest LL slot accepted (its buffers take 2 x world x the slot of device memory).
pub const MAX_LL_BYTES: u64 = 256 << 20;

/// Default grid of the one-shot LL kernel: blocks x the most threads per block
/// (`SYMMALLOC_LL_GRID`). One SM's stores to a peer are the limit, so a message is spread over
/// every block (bench/NOTES.md, "The LL kernels").
pub const DEFAULT_LL_GRID: (u32, u32) = (128, 512);

/// "64x256" -> (64, 256), within the LL kernel's limits.
pub fn parse_grid(v: &str) -> Option<(u32, u32)> {
    let (b, t) = v.trim().split_once(['x', 'X'])?;
    let (b, t) = (b.trim().parse::<u32>().ok()?, t.trim().parse::<u32>().ok()?);
    ((1..=128).contains(&b) && (32..=512).contains(&t) && t % 32 == 0).then_some((b, t))
}

impl Vars<'_> {
    /// `SYMMALLOC_BACKEND`: `cuda` (default) or `host`.
    pub fn backend_kind(&self) -> Result<BackendKind> {
        self.enumeration(
            "SYMMALLOC_BACKEND",
            &[("cuda", BackendKind::Cuda), ("host", BackendKind::Host)],
            BackendKind::Cuda,
        )
    }

    /// `SYMMALLOC_HEAP_SIZE`: virtual size of each device's heap; `None` = the backend's default.
    pub fn heap_size(&self) -> Result<Option<u64>> {
        self.size("SYMMALLOC_HEAP_SIZE")
    }

    /// `SYMMALLOC_COMM_ARENA_SIZE`: a positive size; `None` when unset.
    pub fn comm_arena_size(&self) -> Result<Option<u64>> {
        const NAME: &str = "SYMMALLOC_COMM_ARENA_SIZE";
        match self.size(NAME)? {
            Some(0) => Err(Self::bad(NAME, "0", "a positive size")),
            v => Ok(v),
        }
    }

    /// `SYMMALLOC_SPLIT_SLOTS`: a count, `0..=MAX_SPLIT_SLOTS`, default `DEFAULT_SPLIT_SLOTS`.
    pub fn split_slots(&self) -> Result<u64> {
        self.count(
            "SYMMALLOC_SPLIT_SLOTS",
            DEFAULT_SPLIT_SLOTS,
            MAX_SPLIT_SLOTS,
        )
    }

    /// `SYMMALLOC_TIMEOUT_S`: seconds, `MIN_TIMEOUT_S..=MAX_TIMEOUT_S`, default 60.
    pub fn timeout(&self) -> Result<Duration> {
        self.duration_s(
            "SYMMALLOC_TIMEOUT_S",
            DEFAULT_TIMEOUT_S,
            MIN_TIMEOUT_S,
            MAX_TIMEOUT_S,
        )
    }

    /// `SYMMALLOC_CHECK_SYMMETRY`: a boolean, default off.
    pub fn check_symmetry(&self) -> Result<bool> {
        self.boolean("SYMMALLOC_CHECK_SYMMETRY", false)
    }

    /// `SYMMALLOC_THREAD_CACHE`: a boolean, default on.
    pub fn thread_cache(&self) -> Result<bool> {
        self.boolean("SYMMALLOC_THREAD_CACHE", true)
    }

    /// `SYMMALLOC_SHARED_GPU`: a boolean, default off.
    pub fn shared_gpu(&self) -> Result<bool> {
        self.boolean("SYMMALLOC_SHARED_GPU", false)
    }

    /// `SYMMALLOC_ENABLE_MULTICAST`: a boolean, default off. Only the opt-in: the multicast gate
    /// also needs every disabling variable absent, no shared GPU, and device support.
    pub fn enable_multicast(&self) -> Result<bool> {
        self.boolean("SYMMALLOC_ENABLE_MULTICAST", false)
    }

    /// `SYMMALLOC_DEBUG`: `OFF`/`WARN` (both off), `INFO` or `TRACE`, any case; default off.
    pub fn debug_level(&self) -> Result<Level> {
        self.enumeration(
            "SYMMALLOC_DEBUG",
            &[
                ("OFF", Level::Off),
                ("WARN", Level::Off),
                ("INFO", Level::Info),
                ("TRACE", Level::Trace),
            ],
            Level::Off,
        )
    }

    /// `SYMMALLOC_HOST_ID`: this process's host identity, in place of the one the library
    /// reads (boot id and network namespace; `ipc/host.rs`). 1 to `MAX_HOST_ID` printable ASCII
    /// characters without spaces; `None` when unset or blank. For tests that simulate several
    /// hosts on one machine, and containers whose ranks cannot share sockets although the
    /// kernel says they may; must name one host alike on every rank of that host.
    pub fn host_id(&self) -> Result<Option<String>> {
        const NAME: &str = "SYMMALLOC_HOST_ID";
        let Some(v) = self.raw(NAME) else {
            return Ok(None);
        };
        let t = v.trim();
        if t.len() > MAX_HOST_ID || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Self::bad(
                NAME,
                &v,
                &format!(
                    "1 to {MAX_HOST_ID} printable ASCII characters without spaces (e.g. node-a)"
                ),
            ));
        }
        Ok(Some(t.to_string()))
    }

    /// `SYMMALLOC_LL_BYTES`: a size, a positive multiple of 1K up to `MAX_LL_BYTES`.
    pub fn ll_bytes(&self, world: usize) -> Result<u64> {
        const NAME: &str = "SYMMALLOC_LL_BYTES";
        let Some(v) = self.size(NAME)? else {
            return Ok(default_ll_bytes(world));
        };
        if v == 0 || v % 1024 != 0 || v > MAX_LL_BYTES {
            return Err(Self::bad(
                NAME,
                &self.raw(NAME).unwrap_or_default(),
                &format!("a positive multiple of 1K up to {MAX_LL_BYTES} (256M)"),
            ));
        }
        Ok(v)
    }

    /// `SYMMALLOC_LL_GRID`: `BLOCKSxTHREADS`, default `DEFAULT_LL_GRID`.
    pub fn ll_grid(&self) -> Result<(u32, u32)> {
        const NAME: &str = "SYMMALLOC_LL_GRID";
        let Some(v) = self.raw(NAME) else {
            return Ok(DEFAULT_LL_GRID);
        };
        parse_grid(&v).ok_or_else(|| {
            Self::bad(
                NAME,
                &v,
                "BLOCKSxTHREADS with 1..=128 blocks and 32..=512 threads, a multiple of 32 \
                 (e.g. 64x256)",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;
    use std::collections::HashMap;

    /// Reads through `f` with `name` set to `value` and nothing else.
    fn with<T>(name: &str, value: &str, f: impl Fn(Vars<'_>) -> Result<T>) -> Result<T> {
        let m: HashMap<String, String> = [(name.to_string(), value.to_string())].into();
        let get = |k: &str| m.get(k).cloned();
        f(Vars::new(&get))
    }

    fn unset<T>(f: impl Fn(Vars<'_>) -> Result<T>) -> Result<T> {
        f(Vars::new(&|_| None))
    }

    /// A refusal names the variable, the value (quoted) and what is accepted, as invalid input.
    fn refused<T: std::fmt::Debug>(
        name: &str,
        value: &str,
        accepted: &str,
        f: impl Fn(Vars<'_>) -> Result<T>,
    ) {
        let e = with(name, value, f).unwrap_err();
        assert_eq!(e.status, Status::ErrInvalidArgument, "{}", e.message);
        let quoted = format!("{name}={value:?}");
        assert!(
            e.message.contains(&quoted) && e.message.contains(accepted),
            "{name}={value:?}: {}",
            e.message
        );
    }

    /// Values no setting accepts.
    const BAD: [&str; 7] = [
        "abc",
        "-1",
        "99999999999999999999999",
        "nan",
        "NaN",
        "inf",
        "-inf",
    ];

    #[test]
    fn grids_parse_within_the_ll_kernels_limits() {
        assert_eq!(parse_grid("64x256"), Some((64, 256)));
        assert_eq!(parse_grid(" 128 X 512 "), Some((128, 512)));
        for bad in ["0x256", "129x256", "64x48", "64x1024", "64", "ax256"] {
            assert_eq!(parse_grid(bad), None, "{bad}");
        }
    }

    #[test]
    fn sizes_refuse_everything_else() {
        for name in [
            "SYMMALLOC_HEAP_SIZE",
            "SYMMALLOC_LL_MAX_BYTES",
            "SYMMALLOC_ONE_SHOT_MAX_BYTES",
        ] {
            let read = |v: Vars<'_>| v.size(name);
            assert_eq!(unset(read).unwrap(), None);
            assert_eq!(with(name, "", read).unwrap(), None);
            assert_eq!(with(name, "  ", read).unwrap(), None);
            assert_eq!(with(name, "0", read).unwrap(), Some(0));
            assert_eq!(with(name, " 16G ", read).unwrap(), Some(16 << 30));
            assert_eq!(with(name, "4096", read).unwrap(), Some(4096));
            for bad in BAD.iter().chain(&["1.5G", "16GB", "0x10", "20000000T"]) {
                refused(name, bad, "K/M/G/T suffix", read);
            }
        }
        // The accessors read these names.
        refused("SYMMALLOC_HEAP_SIZE", "abc", "suffix", |v| v.heap_size());
    }

    #[test]
    fn the_timeout_is_finite_positive_and_bounded() {
        let name = "SYMMALLOC_TIMEOUT_S";
        let read = |v: Vars<'_>| v.timeout();
        assert_eq!(unset(read).unwrap(), Duration::from_secs(60));
        assert_eq!(with(name, "", read).unwrap(), Duration::from_secs(60));
        assert_eq!(with(name, "3", read).unwrap(), Duration::from_secs(3));
        assert_eq!(
            with(name, " 2.5 ", read).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            with(name, "1e6", read).unwrap(),
            Duration::from_secs(1_000_000)
        );
        assert_eq!(with(name, "0.001", read).unwrap(), Duration::from_millis(1));
        for bad in BAD.iter().chain(&[
            "0", "-0", "0.0001", "1000001", "1e300", "infinity", "60s", "1,5",
        ]) {
            refused(name, bad, "seconds from 0.001 to 1000000", read);
        }
    }

    #[test]
    fn booleans_are_exactly_0_1_true_false_on_off() {
        for (name, default) in [
            ("SYMMALLOC_CHECK_SYMMETRY", false),
            ("SYMMALLOC_THREAD_CACHE", true),
            ("SYMMALLOC_SHARED_GPU", false),
            ("SYMMALLOC_ENABLE_MULTICAST", false),
        ] {
            let read = |v: Vars<'_>| match name {
                "SYMMALLOC_CHECK_SYMMETRY" => v.check_symmetry(),
                "SYMMALLOC_THREAD_CACHE" => v.thread_cache(),
                "SYMMALLOC_SHARED_GPU" => v.shared_gpu(),
                _ => v.enable_multicast(),
            };
            assert_eq!(unset(read).unwrap(), default, "{name}");
            assert_eq!(with(name, "", read).unwrap(), default, "{name}");
            for on in ["1", "true", "on", "TRUE", "On", " 1 "] {
                assert!(with(name, on, read).unwrap(), "{name}={on}");
            }
            for off in ["0", "false", "off", "False", "OFF", "0\n"] {
                assert!(!with(name, off, read).unwrap(), "{name}={off}");
            }
            for bad in BAD.iter().chain(&["yes", "no", "2", "01", "enable", "1.0"]) {
                refused(name, bad, "0, 1, true, false, on, off", read);
            }
        }
    }

    #[test]
    fn enumerations_name_their_choices() {
        let name = "SYMMALLOC_BACKEND";
        let read = |v: Vars<'_>| v.backend_kind();
        assert_eq!(unset(read).unwrap(), BackendKind::Cuda);
        assert_eq!(with(name, "", read).unwrap(), BackendKind::Cuda);
        assert_eq!(with(name, "cuda", read).unwrap(), BackendKind::Cuda);
        assert_eq!(with(name, "host", read).unwrap(), BackendKind::Host);
        assert_eq!(with(name, " HOST ", read).unwrap(), BackendKind::Host);
        for bad in BAD.iter().chain(&["gpu", "0"]) {
            refused(name, bad, "one of cuda, host", read);
        }

        let name = "SYMMALLOC_DEBUG";
        let read = |v: Vars<'_>| v.debug_level();
        assert_eq!(unset(read).unwrap(), Level::Off);
        assert_eq!(with(name, "", read).unwrap(), Level::Off);
        assert_eq!(with(name, "warn", read).unwrap(), Level::Off);
        assert_eq!(with(name, "OFF", read).unwrap(), Level::Off);
        assert_eq!(with(name, "Info", read).unwrap(), Level::Info);
        assert_eq!(with(name, " TRACE ", read).unwrap(), Level::Trace);
        for bad in BAD.iter().chain(&["LOUD", "1", "DEBUG"]) {
            refused(name, bad, "one of OFF, WARN, INFO, TRACE", read);
        }
    }

    #[test]
    fn the_ll_settings_refuse_what_the_kernel_cannot_take() {
        let name = "SYMMALLOC_LL_BYTES";
        let read = |v: Vars<'_>| v.ll_bytes(2);
        assert_eq!(unset(read).unwrap(), 4 << 20);
        assert_eq!(with(name, "", read).unwrap(), 4 << 20);
        assert_eq!(unset(|v| v.ll_bytes(8)).unwrap(), 256 << 10);
        assert_eq!(with(name, "64K", read).unwrap(), 64 << 10);
        assert_eq!(with(name, "256M", read).unwrap(), 256 << 20);
        for bad in BAD {
            refused(name, bad, "K/M/G/T suffix", read);
        }
        for bad in ["0", "1000", "512M", "1T"] {
            refused(name, bad, "a positive multiple of 1K up to", read);
        }

        let name = "SYMMALLOC_LL_GRID";
        let read = |v: Vars<'_>| v.ll_grid();
        assert_eq!(unset(read).unwrap(), DEFAULT_LL_GRID);
        assert_eq!(with(name, "", read).unwrap(), DEFAULT_LL_GRID);
        assert_eq!(with(name, "64x256", read).unwrap(), (64, 256));
        for bad in BAD.iter().chain(&["64", "0x256", "-1x32", "64x1024"]) {
            refused(name, bad, "BLOCKSxTHREADS", read);
        }
    }

    #[test]
    fn the_split_slots_are_a_small_whole_number() {
        let name = "SYMMALLOC_SPLIT_SLOTS";
        let read = |v: Vars<'_>| v.split_slots();
        assert_eq!(unset(read).unwrap(), DEFAULT_SPLIT_SLOTS);
        assert_eq!(with(name, "", read).unwrap(), DEFAULT_SPLIT_SLOTS);
        assert_eq!(with(name, "0", read).unwrap(), 0);
        assert_eq!(with(name, " 3 ", read).unwrap(), 3);
        assert_eq!(with(name, "64", read).unwrap(), MAX_SPLIT_SLOTS);
        for bad in BAD.iter().chain(&["65", "2K", "+2", "1.0", "two", "0x2"]) {
            refused(name, bad, "a whole number from 0 to 64", read);
        }
    }

    #[test]
    fn the_host_id_is_a_short_printable_word() {
        let name = "SYMMALLOC_HOST_ID";
        let read = |v: Vars<'_>| v.host_id();
        assert_eq!(unset(read).unwrap(), None);
        assert_eq!(with(name, "", read).unwrap(), None);
        assert_eq!(with(name, "  ", read).unwrap(), None);
        assert_eq!(
            with(name, "node-a", read).unwrap().as_deref(),
            Some("node-a")
        );
        assert_eq!(with(name, " n1 ", read).unwrap().as_deref(), Some("n1"));
        let longest = "x".repeat(MAX_HOST_ID);
        assert_eq!(with(name, &longest, read).unwrap(), Some(longest.clone()));
        for bad in [
            "node a",
            "tab\there",
            "caf\u{e9}",
            "nul\0",
            &"x".repeat(MAX_HOST_ID + 1),
        ] {
            refused(name, bad, "printable ASCII characters without spaces", read);
        }
    }

    #[test]
    fn a_value_that_is_not_utf8_is_named_not_taken_for_unset() {
        let get = |_: &str| Some(String::from_utf8_lossy(b"\xff1").into_owned());
        let e = Vars::new(&get).thread_cache().unwrap_err();
        assert!(
            e.message.contains("SYMMALLOC_THREAD_CACHE=\"\u{fffd}1\""),
            "{}",
            e.message
        );
    }
}
