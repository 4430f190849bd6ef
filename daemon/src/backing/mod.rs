//! The backing store: where the training data really lives (a mounted parallel file
//! system, later an object store). The daemon reads it only through the [`Backing`]
//! trait, which has a POSIX implementation ([`posix`]), an in-memory one ([`mem`]) and
//! wrappers that change its behaviour without touching it ([`throttle`], [`fault`], and
//! [`watch`], which every root runs behind: a root or file that stops answering is
//! refused at once instead of holding the daemon's threads).
//!
//! A backing store owns path resolution: [`Backing::stat`] turns a path relative to the
//! store's root into its canonical form (symlinks followed, never out of the root) and
//! returns, beside the file's version, the owner and mode of every directory a client's
//! own open would need to search — from `/`, through the directories above the root, to
//! the file's parent — so that the daemon can decide what a client may read
//! ([`crate::access`]) without opening anything on the client's behalf. Everything a
//! stat reports about an object was learnt from that one object (never from a second
//! lookup of its name), and [`Backing::open`] reads only the object whose version the
//! stat reported.
//!
//! This module does not cache: metadata caching lives in [`crate::meta`], data in
//! [`crate::store`].

use std::fmt;
use std::io;

pub mod fault;
pub mod mem;
pub mod posix;
pub mod throttle;
pub mod watch;

#[cfg(test)]
mod conformance;

/// The identity of one version of a backing file. Any change in any field is a new
/// version, and a cached copy of an old version is never served for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Version {
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// Status-change time, nanoseconds since the epoch.
    pub ctime_ns: i64,
    /// Inode number.
    pub ino: u64,
    /// Device number of the file system holding the file.
    pub dev: u64,
}

/// Who owns a file or directory and its permission bits, as far as access decisions go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Owner {
    /// Owning user id.
    pub uid: u32,
    /// Owning group id.
    pub gid: u32,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// The object carries an access control list, which the daemon does not evaluate.
    pub acl: bool,
}

/// What [`Backing::stat`] learns about a regular file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    /// Canonical path relative to the root: `/`-separated, no `.`/`..`, no symlinks.
    pub path: String,
    /// Every directory whose search permission a client's own open needs: `/` first,
    /// then each directory down to the root, the root, and every directory traversed
    /// below it (those left again by `..` or an absolute symlink included); the file's
    /// parent last.
    pub dirs: Vec<Owner>,
    /// The file's own owner and mode.
    pub owner: Owner,
    /// The file's version.
    pub version: Version,
}

/// Kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (not followed by [`Backing::list`]).
    Symlink,
    /// Anything else (device, socket, fifo).
    Other,
}

/// One entry of [`Backing::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// The entry's name within its directory.
    pub name: String,
    /// What it is.
    pub kind: EntryKind,
}

/// Errors of a backing store.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// No such file or directory.
    #[error("{0}: not found")]
    NotFound(String),
    /// The path leaves the root (through `..`, a symlink, or an absolute link target).
    #[error("{0}: escapes the backing root")]
    Escapes(String),
    /// The path names something other than a regular file.
    #[error("{0}: not a regular file")]
    NotAFile(String),
    /// The path is malformed.
    #[error("{path}: invalid path: {why}")]
    Invalid {
        /// The path as given.
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The file is no longer the version the caller expected.
    #[error("{0}: changed on the backing store")]
    Changed(String),
    /// The root's path no longer leads to the directory the store opened (it was moved,
    /// replaced or mounted over): nothing under it is resolved until it does again.
    #[error(
        "{0}: the backing root's path no longer leads to the directory opened at start \
         (moved, replaced or mounted over); clients read it themselves until it does again \
         or the daemon is restarted"
    )]
    RootReplaced(String),
    /// The root, or this file on it, is not answering: the call was refused at once
    /// without reaching the store ([`watch`] says why).
    #[error("{0}")]
    Stalled(String),
    /// The store itself failed.
    #[error("{path}: {source}")]
    Io {
        /// The path being accessed.
        path: String,
        /// The underlying error.
        source: io::Error,
    },
}

/// A backing store, rooted at one directory.
///
/// All methods block: callers run them on threads that may block (the daemon's fill
/// workers and connection threads), never on an async executor.
pub trait Backing: Send + Sync + fmt::Debug {
    /// Resolves `path` (relative to the root, `/`-separated) to a regular file and
    /// returns its canonical path, version, and the owners of every directory on the way
    /// (see [`Stat::dirs`]). The path is resolved as the kernel would: a file followed by
    /// anything (`f/`, `f/.`, `f/..`) is [`BackingError::NotFound`], `..` needs search on
    /// the directory it leaves.
    fn stat(&self, path: &str) -> Result<Stat, BackingError>;

    /// [`Backing::stat`] of each of `paths`, in order (what a loader's batch of opens
    /// asks). The default stats them one after another; a backing store that runs its
    /// calls on threads of its own ([`watch::WatchedBacking`]) hands them over together,
    /// a few per hop, not one hop per path.
    fn stat_many(&self, paths: &[&str]) -> Vec<Result<Stat, BackingError>> {
        paths.iter().map(|p| self.stat(p)).collect()
    }

    /// Opens the file described by `stat` for reading. Fails with
    /// [`BackingError::Changed`] when the file is no longer that version (or no longer a
    /// regular file): what it returns reads the very object `stat` described.
    fn open(&self, stat: &Stat) -> Result<Box<dyn BackingFile>, BackingError>;

    /// Lists a directory (relative to the root; `""` is the root itself).
    fn list(&self, dir: &str) -> Result<Vec<DirEntry>, BackingError>;

    /// The owner and mode of every directory from the root to `dir` (relative to the
    /// root, `""` is the root itself), the root first and `dir` last, resolved as
    /// [`Backing::list`] resolves it (no symlink followed): what deciding whether a user
    /// may list `dir` takes ([`crate::access::may_walk`]).
    fn dir_owners(&self, dir: &str) -> Result<Vec<Owner>, BackingError>;
}

/// An open backing file.
pub trait BackingFile: Send + Sync + fmt::Debug {
    /// Reads up to `buf.len()` bytes at `offset`; returns 0 at end of file.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;

    /// The file's current version (re-read from the store, not remembered).
    fn version(&self) -> io::Result<Version>;
}

/// Conveniences over [`BackingFile`].
pub trait BackingFileExt: BackingFile {
    /// Reads until `buf` is full or the file ends; returns the bytes read.
    fn read_full_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
}

impl<T: BackingFile + ?Sized> BackingFileExt for T {}

/// Splits a root-relative path into components, applying `.` and `..` lexically.
///
/// Used where no symlinks exist (the in-memory store) and to validate canonical paths;
/// the POSIX store resolves `..` physically instead, while it walks.
pub fn normalize(path: &str) -> Result<Vec<&str>, BackingError> {
    let invalid = |why| BackingError::Invalid {
        path: path.to_owned(),
        why,
    };
    if path.starts_with('/') {
        return Err(invalid("must be relative to the backing root"));
    }
    if path.contains('\0') {
        return Err(invalid("contains a NUL byte"));
    }
    let mut out: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                if out.pop().is_none() {
                    return Err(BackingError::Escapes(path.to_owned()));
                }
            }
            c => out.push(c),
        }
    }
    if out.is_empty() {
        return Err(BackingError::NotAFile(path.to_owned()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_applies_dots_and_refuses_escapes() {
        assert_eq!(normalize("a/./b//c").unwrap(), ["a", "b", "c"]);
        assert_eq!(normalize("a/../b").unwrap(), ["b"]);
        assert!(matches!(normalize("../x"), Err(BackingError::Escapes(_))));
        assert!(matches!(
            normalize("a/../../x"),
            Err(BackingError::Escapes(_))
        ));
        assert!(matches!(
            normalize("/etc/passwd"),
            Err(BackingError::Invalid { .. })
        ));
        assert!(matches!(
            normalize("a\0b"),
            Err(BackingError::Invalid { .. })
        ));
        assert!(matches!(normalize("."), Err(BackingError::NotAFile(_))));
    }
}
