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

pub fn flag(name: &str) -> bool {
    matches!(
        std::env::var(name).as_deref(),
        Ok("1") | Ok("true") | Ok("yes") | Ok("on")
    )
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
        assert_eq!(parse_size("99999999999T"), None);
    }
}
