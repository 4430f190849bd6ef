//! Names: a cached file version's [`Key`], a path's [`PathKey`] whatever its version, and
//! the name of a key's data file.
//!
//! Pure functions of their inputs: nothing here reads the index or touches a file. The
//! data file layout (`<xx>/<key>.<generation>`) is documented in the store's module
//! documentation and held by a test; changing a name here orphans every cached file.

use std::fmt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_128;

use crate::backing::Version;

/// Identity of a cached file version: xxh3-128 of (root, canonical path, version).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub [u8; 16]);

impl Key {
    /// The key of `path` under `root` at `version`.
    pub fn of(root: &str, path: &str, v: &Version) -> Self {
        let mut b = Vec::with_capacity(root.len() + path.len() + 48);
        b.extend_from_slice(root.as_bytes());
        b.push(0);
        b.extend_from_slice(path.as_bytes());
        b.push(0);
        for x in [v.size, v.mtime_ns as u64, v.ctime_ns as u64, v.ino, v.dev] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        Key(xxh3_128(&b).to_le_bytes())
    }

    pub(super) fn from_slice(b: &[u8]) -> Option<Self> {
        Some(Key(b.try_into().ok()?))
    }

    /// Lower-case hex, as used in data file names.
    pub fn hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(32);
        for b in self.0 {
            s.push(DIGITS[(b >> 4) as usize] as char);
            s.push(DIGITS[(b & 15) as usize] as char);
        }
        s
    }
}

/// Identity of a path regardless of version: xxh3-128 of (root, canonical path).
pub(super) type PathKey = u128;

pub(super) fn path_key(root: &str, path: &str) -> PathKey {
    let mut b = Vec::with_capacity(root.len() + path.len() + 1);
    b.extend_from_slice(root.as_bytes());
    b.push(0);
    b.extend_from_slice(path.as_bytes());
    xxh3_128(&b)
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.hex())
    }
}

/// `<xx>/<key>.<generation>`, built without the formatting machinery (this is on the
/// path of every client open).
pub(super) fn data_name(key: &Key, generation: u64) -> String {
    let hex = key.hex();
    let mut s = String::with_capacity(56);
    s.push_str(&hex[..2]);
    s.push('/');
    s.push_str(&hex);
    s.push('.');
    let mut digits = [0u8; 20];
    let mut n = generation;
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    s.extend(digits[i..].iter().map(|&d| d as char));
    s
}

pub(super) fn data_path(data_dir: &Path, key: &Key, generation: u64) -> PathBuf {
    data_dir.join(data_name(key, generation))
}
