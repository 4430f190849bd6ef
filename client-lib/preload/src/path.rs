//! The absolute path an open names, built on the stack: deciding that an open is not
//! for the cache must not allocate.
//!
//! The path is made absolute the way the kernel starts resolving it (against the working
//! directory, or against the directory `dirfd` names), and cleaned lexically only where
//! that cannot change its meaning: `.` components and repeated slashes go, `..` stays for
//! the daemon, which applies it to the physical directory as the kernel does.

use std::ffi::{CStr, c_int};

const CAP: usize = libc::PATH_MAX as usize;

/// An absolute path: `/` followed by components, none empty or `.`, at most
/// `PATH_MAX - 1` bytes.
pub(crate) struct AbsPath {
    buf: [u8; CAP],
    len: usize,
}

impl AbsPath {
    /// What `openat(dirfd, path)` names, as an absolute path. `None` when that cannot
    /// be known cheaply and surely: the path names a directory (a trailing `/`, a final
    /// `.` or `..`), it is too long (as given: the kernel refuses `PATH_MAX` bytes or
    /// more even when cleaning would shorten it), or the base directory has no path
    /// (deleted, unreachable from this root, not a directory in `/proc`).
    pub(crate) fn new(dirfd: c_int, path: &[u8]) -> Option<Self> {
        let last = path.rsplit(|&b| b == b'/').next()?;
        if path.is_empty() || path.len() >= CAP || last.is_empty() || last == b"." || last == b".."
        {
            return None;
        }
        let mut abs = Self {
            buf: [0; CAP],
            len: 0,
        };
        if path[0] != b'/' {
            let mut base = [0u8; CAP];
            let base = if dirfd == libc::AT_FDCWD {
                cwd(&mut base)?
            } else {
                dir_of(dirfd, &mut base)?
            };
            abs.push(base)?;
        }
        abs.push(path)?;
        Some(abs)
    }

    /// Appends the components of `path`, leaving out empty ones and `.`.
    fn push(&mut self, path: &[u8]) -> Option<()> {
        for c in path.split(|&b| b == b'/') {
            if c.is_empty() || c == b"." {
                continue;
            }
            let end = self.len + 1 + c.len();
            if end >= CAP {
                return None;
            }
            self.buf[self.len] = b'/';
            self.buf[self.len + 1..end].copy_from_slice(c);
            self.len = end;
        }
        Some(())
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// True when the path lies below `root` (an absolute path; a trailing `/` is
    /// ignored), on a component boundary: the daemon's rule for choosing a root.
    pub(crate) fn is_under(&self, root: &str) -> bool {
        let root = root.trim_end_matches('/');
        self.as_bytes()
            .strip_prefix(root.as_bytes())
            .is_some_and(|rest| rest.len() > 1 && rest[0] == b'/')
    }
}

/// The working directory, written into `buf`.
fn cwd(buf: &mut [u8; CAP]) -> Option<&[u8]> {
    // SAFETY: getcwd writes at most `CAP` bytes, NUL included, into `buf`.
    let p = unsafe { libc::getcwd(buf.as_mut_ptr().cast(), CAP) };
    if p.is_null() {
        return None;
    }
    // Not absolute: "(unreachable)/..." from older C libraries, when the working
    // directory lies outside this process's root.
    let dir = CStr::from_bytes_until_nul(buf).ok()?.to_bytes();
    dir.starts_with(b"/").then_some(dir)
}

/// The path of the directory open as `dirfd`, from `/proc/self/fd`, written into `buf`.
fn dir_of(dirfd: c_int, buf: &mut [u8; CAP]) -> Option<&[u8]> {
    let mut link = *b"/proc/self/fd/\0\0\0\0\0\0\0\0\0\0\0";
    let prefix = b"/proc/self/fd/".len();
    let mut digits = [0u8; 10];
    let mut n = u32::try_from(dirfd).ok()?;
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    link[prefix..prefix + digits.len() - i].copy_from_slice(&digits[i..]);
    // SAFETY: `link` is NUL-terminated (its last byte is never written); readlink
    // writes at most `CAP` bytes into `buf`.
    let n = unsafe { libc::readlink(link.as_ptr().cast(), buf.as_mut_ptr().cast(), CAP) };
    let n = usize::try_from(n).ok().filter(|&n| n > 0 && n < CAP)?;
    let dir = &buf[..n];
    // Anything but a live directory's path ("pipe:[..]", "/a/b (deleted)") is not a
    // base we can name.
    (dir.starts_with(b"/") && !dir.ends_with(b" (deleted)")).then_some(dir)
}
