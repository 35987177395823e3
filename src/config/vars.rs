//! The parsing of environment variables: [`var`], the one read of the process environment; a
//! [`Lookup`] over it or over a map (tests); and [`Vars`], the five typed parsers every setting
//! goes through ([`Vars::size`], [`Vars::duration_s`], [`Vars::boolean`], [`Vars::count`],
//! [`Vars::enumeration`]), with [`parse_size`] for sizes. Which variable holds which setting,
//! with its default and limits, is settings.rs's.
//!
//! Invariants (the rules of mod.rs): unset or blank means the default; any other value that is
//! not accepted is an `SYMM_ERR_INVALID_ARGUMENT` naming the variable, the value (quoted) and
//! what is accepted (`Vars::bad`); never a panic, never a silent default.

use crate::error::{Error, Result};
use std::time::Duration;

/// The one read of the process environment. A value that is not UTF-8 comes back converted
/// lossily, so that a parser names it instead of taking it for unset.
pub fn var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// A variable lookup: [`var`] for the process, a map in tests.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The settings over a lookup. `Vars::process()` reads the process environment; tests pass a
/// map, so they need no process-global state.
#[derive(Clone, Copy)]
pub struct Vars<'a> {
    get: Lookup<'a>,
}

const PROCESS: Lookup<'static> = &var;

const SIZE_ACCEPTED: &str =
    "a byte count with an optional K/M/G/T suffix (binary units, e.g. 4096, 64K, 2M), below 2^64";
const BOOL_ACCEPTED: &str = "one of 0, 1, true, false, on, off";

impl<'a> Vars<'a> {
    pub fn new(get: Lookup<'a>) -> Self {
        Vars { get }
    }

    pub fn process() -> Vars<'static> {
        Vars { get: PROCESS }
    }

    /// The raw value, `None` when unset or blank (both mean the default).
    pub(super) fn raw(&self, name: &str) -> Option<String> {
        (self.get)(name).filter(|v| !v.trim().is_empty())
    }

    pub(super) fn bad(name: &str, value: &str, accepted: &str) -> Error {
        Error::invalid(format!(
            "{name}={value:?} is not accepted; expected {accepted}"
        ))
    }

    /// A size: `Ok(None)` when unset or blank.
    pub fn size(&self, name: &str) -> Result<Option<u64>> {
        let Some(v) = self.raw(name) else {
            return Ok(None);
        };
        parse_size(v.trim())
            .map(Some)
            .ok_or_else(|| Self::bad(name, &v, SIZE_ACCEPTED))
    }

    /// A duration in seconds (decimal, e.g. `60` or `2.5`): finite, within `[min, max]`.
    pub fn duration_s(&self, name: &str, default: f64, min: f64, max: f64) -> Result<Duration> {
        let Some(v) = self.raw(name) else {
            return Ok(Duration::from_secs_f64(default));
        };
        match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && (min..=max).contains(&s) => Ok(Duration::from_secs_f64(s)),
            _ => Err(Self::bad(
                name,
                &v,
                &format!("a number of seconds from {min} to {max} (e.g. 60 or 2.5)"),
            )),
        }
    }

    /// A boolean: exactly `0/1/true/false/on/off` (any case); unset or blank is `default`.
    pub fn boolean(&self, name: &str, default: bool) -> Result<bool> {
        let Some(v) = self.raw(name) else {
            return Ok(default);
        };
        match v.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "on" => Ok(true),
            "0" | "false" | "off" => Ok(false),
            _ => Err(Self::bad(name, &v, BOOL_ACCEPTED)),
        }
    }

    /// A whole number from 0 to `max` (decimal digits only); unset or blank is `default`.
    pub fn count(&self, name: &str, default: u64, max: u64) -> Result<u64> {
        let Some(v) = self.raw(name) else {
            return Ok(default);
        };
        let t = v.trim();
        match t.parse::<u64>() {
            Ok(n) if n <= max && t.bytes().all(|b| b.is_ascii_digit()) => Ok(n),
            _ => Err(Self::bad(
                name,
                &v,
                &format!("a whole number from 0 to {max}"),
            )),
        }
    }

    /// One of `choices` (any case); unset or blank is `default`.
    pub fn enumeration<T: Copy>(&self, name: &str, choices: &[(&str, T)], default: T) -> Result<T> {
        let Some(v) = self.raw(name) else {
            return Ok(default);
        };
        let t = v.trim();
        if let Some((_, c)) = choices.iter().find(|(k, _)| k.eq_ignore_ascii_case(t)) {
            return Ok(*c);
        }
        let names: Vec<&str> = choices.iter().map(|(k, _)| *k).collect();
        Err(Self::bad(
            name,
            &v,
            &format!("one of {} (any case)", names.join(", ")),
        ))
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
