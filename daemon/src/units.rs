//! Units the settings are written in: sizes (`4MiB`, `80%`) and durations (`250ms`).
//! Plain values and their parsers, shared by the configuration and the parts that take
//! sizes from it (the store resolves a [`SizeSpec`] against its file system); nothing
//! here knows of either.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A size in bytes, or a percentage of the cache file system's size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizeSpec {
    /// An absolute number of bytes.
    Bytes(u64),
    /// A percentage (0–100) of the cache file system's total size.
    Percent(f64),
}

impl SizeSpec {
    /// Resolves against a file system of `fs_size` bytes.
    pub fn resolve(self, fs_size: u64) -> u64 {
        match self {
            SizeSpec::Bytes(b) => b,
            SizeSpec::Percent(p) => (fs_size as f64 * p / 100.0) as u64,
        }
    }
}

impl fmt::Display for SizeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeSpec::Bytes(b) => write!(f, "{b}"),
            SizeSpec::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// Splits `"4.5 MiB"` into `(4.5, "MiB")`; `what` names the expected form in errors.
fn number_and_unit<'a>(s: &'a str, what: &str) -> Result<(f64, &'a str), String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n = num.parse().map_err(|_| format!("`{s}` is not {what}"))?;
    Ok((n, unit.trim()))
}

/// Parses `123`, `4KiB`, `4MiB`, `10GiB`, `1TiB`, `4MB`, `1G` (binary units either way).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let (n, unit) = number_and_unit(s, "a size (expected e.g. 4MiB)")?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => {
            return Err(format!(
                "`{s}`: unknown size unit `{u}` (use B, KiB, MiB, GiB, TiB)"
            ));
        }
    };
    Ok((n * mult as f64) as u64)
}

/// Parses `0`, `250ms`, `1s`, `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = number_and_unit(s, "a duration (expected e.g. 1s)")?;
    let secs = match unit {
        "us" | "µs" => n / 1e6,
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        u => {
            return Err(format!(
                "`{s}`: unknown duration unit `{u}` (use ms, s, m, h)"
            ));
        }
    };
    Ok(Duration::from_secs_f64(secs))
}

impl FromStr for SizeSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().strip_suffix('%') {
            Some(p) => {
                let p: f64 = p
                    .trim()
                    .parse()
                    .map_err(|_| format!("`{s}` is not a percentage"))?;
                if !(0.0..=100.0).contains(&p) {
                    return Err(format!("`{s}`: a percentage must be between 0 and 100"));
                }
                Ok(SizeSpec::Percent(p))
            }
            None => parse_bytes(s).map(SizeSpec::Bytes),
        }
    }
}
