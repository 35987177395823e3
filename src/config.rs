//! Environment variables, read in one place. Each accessor documents its variable; the README's
//! table lists the same set. Values are read when first needed (per call for the cheap ones).

use crate::error::{Error, Result};
use std::time::Duration;

/// Which memory backend the process uses (`SYMMALLOC_BACKEND=cuda|host`, default cuda).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cuda,
    Host,
}

pub fn backend_kind() -> Result<BackendKind> {
    match std::env::var("SYMMALLOC_BACKEND").as_deref() {
        Err(_) | Ok("") | Ok("cuda") => Ok(BackendKind::Cuda),
        Ok("host") => Ok(BackendKind::Host),
        Ok(other) => Err(Error::invalid(format!(
            "SYMMALLOC_BACKEND={other:?} is not a backend; expected \"cuda\" or \"host\""
        ))),
    }
}

fn parse_u64(name: &str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => parse_size(v.trim()).map(Some).ok_or_else(|| {
            Error::invalid(format!(
                "{name}={v:?} is not a size; expected a number with optional K/M/G/T suffix"
            ))
        }),
    }
}

/// Parses "123", "64K", "2M", "8G", "1T" (binary units).
pub fn parse_size(s: &str) -> Option<u64> {
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        (i, 't' | 'T') => (&s[..i], 1 << 40),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mult)
}

/// `SYMMALLOC_HEAP_SIZE`: virtual size of each device's symmetric heap. `None` = backend default.
pub fn heap_size() -> Result<Option<u64>> {
    parse_u64("SYMMALLOC_HEAP_SIZE")
}

/// `SYMMALLOC_TIMEOUT_S`: every wait on a peer (bootstrap, exchange, kernel barrier) gives up
/// after this many seconds. Default 60.
pub fn timeout() -> Duration {
    let secs = std::env::var("SYMMALLOC_TIMEOUT_S")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0 && s.is_finite())
        .unwrap_or(60.0);
    Duration::from_secs_f64(secs)
}

/// `SYMMALLOC_CHECK_SYMMETRY=1`: every collective compares buffer offsets and count across ranks.
pub fn check_symmetry() -> bool {
    flag("SYMMALLOC_CHECK_SYMMETRY")
}

/// `SYMMALLOC_THREAD_CACHE=0` turns off the per-thread caches in front of the heap
/// (heap/tcache.rs); on by default.
pub fn thread_cache() -> bool {
    !matches!(
        std::env::var("SYMMALLOC_THREAD_CACHE").as_deref(),
        Ok("0") | Ok("false") | Ok("no") | Ok("off")
    )
}

/// `SYMMALLOC_SHARED_GPU=1`: several ranks (processes) may use one GPU. For testing the
/// collectives' protocol at N ranks on a machine with fewer GPUs: without MPS the ranks' kernels
/// time-slice, so each wait on a peer can last a scheduler time slice (milliseconds). Correct,
/// never fast; multicast stays off. Must match on all ranks.
pub fn shared_gpu() -> bool {
    flag("SYMMALLOC_SHARED_GPU")
}

pub fn flag(name: &str) -> bool {
    matches!(
        std::env::var(name).as_deref(),
        Ok("1") | Ok("true") | Ok("yes") | Ok("on")
    )
}

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

/// `SYMMALLOC_LL_BYTES`: the largest message the one-shot LL kernel takes; each communicator
/// holds 2 x world x this much device memory for it (default `default_ll_bytes`). A multiple
/// of 1 KiB, at most 256M; must match on all ranks.
pub fn ll_bytes(world: usize) -> Result<u64> {
    let v = parse_u64("SYMMALLOC_LL_BYTES")?.unwrap_or(default_ll_bytes(world));
    if v == 0 || v % 1024 != 0 || v > MAX_LL_BYTES {
        return Err(Error::invalid(format!(
            "SYMMALLOC_LL_BYTES={v} is not a positive multiple of 1K up to {MAX_LL_BYTES}"
        )));
    }
    Ok(v)
}

/// Default grid of the one-shot LL kernel: blocks x the most threads per block
/// (`SYMMALLOC_LL_GRID`). Measured on 2x H200 (bench/RESULTS.md): one SM's stores to a peer
/// are the limit, so a message is spread over every block (128x512: 6.2 us at 1 MiB and
/// 16.6 at 4 MiB graphed; 32x512: 8.4 at 1 MiB).
pub const DEFAULT_LL_GRID: (u32, u32) = (128, 512);

/// `SYMMALLOC_LL_GRID=BLOCKSxTHREADS`: the most blocks of an LL call (each call runs on just
/// the blocks that have items: launch.rs) and the most threads per block (each call uses just
/// enough, at least 64, to spread its message over the blocks); at most 128 blocks of at most
/// 512 threads, threads a multiple of 32; must match on all ranks.
pub fn ll_grid() -> Result<(u32, u32)> {
    let Ok(v) = std::env::var("SYMMALLOC_LL_GRID") else {
        return Ok(DEFAULT_LL_GRID);
    };
    parse_grid(&v).ok_or_else(|| {
        Error::invalid(format!(
            "SYMMALLOC_LL_GRID={v:?}; expected BLOCKSxTHREADS with 1..=128 blocks and 32..=512 \
             threads, a multiple of 32 (e.g. 64x256)"
        ))
    })
}

/// "64x256" -> (64, 256), within the LL kernel's limits.
pub fn parse_grid(v: &str) -> Option<(u32, u32)> {
    let (b, t) = v.trim().split_once(['x', 'X'])?;
    let (b, t) = (b.trim().parse::<u32>().ok()?, t.trim().parse::<u32>().ok()?);
    ((1..=128).contains(&b) && (32..=512).contains(&t) && t % 32 == 0).then_some((b, t))
}

/// An AUTO threshold override (`SYMMALLOC_ONE_SHOT_MAX_BYTES`), a size like the others.
pub fn auto_threshold(name: &str) -> Result<Option<u64>> {
    parse_u64(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size("2m"), Some(2 << 20));
        assert_eq!(parse_size("8G"), Some(8 << 30));
        assert_eq!(parse_size("1T"), Some(1 << 40));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_grid("64x256"), Some((64, 256)));
        assert_eq!(parse_grid(" 128 X 512 "), Some((128, 512)));
        for bad in ["0x256", "129x256", "64x48", "64x1024", "64", "ax256"] {
            assert_eq!(parse_grid(bad), None, "{bad}");
        }
        assert_eq!(parse_size("99999999999T"), None);
    }
}
