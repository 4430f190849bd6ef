//! Whether an open goes to the cache, and the descriptor of the local copy when it does.
//!
//! The checks run cheapest first, and nothing allocates until the path is known to lie
//! under a backing root: the open flags, the `SHARDCACHE_PRELOAD` switch and the
//! recursion guard, then the path (built on the stack) against the roots. Global state
//! is a few atomics holding leaked boxes, never locks: a `fork` may happen while another
//! thread is anywhere in this code, and the child must not inherit a held lock.

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int};
use std::os::fd::{AsRawFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, Ordering};

use shardcache_client::Client;

use crate::path::AbsPath;

thread_local! {
    /// Set while this thread is inside the client library: the opens it makes itself
    /// (a direct read of the backing file) must reach the real C library.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Flags of an open that may be served from the local copy: read-only, with nothing
/// asked that the copy's descriptor would not give exactly. Everything else (writing,
/// creating, `O_DIRECTORY`, `O_PATH`, `O_TMPFILE`, but also `O_NOFOLLOW`, `O_NOATIME`,
/// `O_DIRECT`, `O_SYNC`, ...) goes to the real call.
const SERVABLE: c_int = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY;

/// How long after failing to reach the daemon the shim leaves every open alone.
const RETRY_SECS: u64 = 5;

/// The descriptor of the node-local copy of what `openat(dirfd, path, flags)` names,
/// set up as that call would have returned it, and passed through `finish`. `None`
/// when the real call must run instead: the open is not read-only, the file is not
/// under a backing root, the daemon is absent or refuses, or anything fails. errno is
/// left as it was found.
///
/// # Safety
/// `path` is null or a NUL-terminated string (the C contract of `open`).
pub(crate) unsafe fn local_copy<R>(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    finish: impl FnOnce(OwnedFd) -> Option<R>,
) -> Option<R> {
    if flags & !SERVABLE != 0 || path.is_null() || !enabled() {
        return None;
    }
    let _inside = Inside::enter()?;
    // SAFETY: non-null, and NUL-terminated by the caller's contract.
    let path = unsafe { CStr::from_ptr(path) }.to_bytes();
    // A panic must not cross into C (it would abort the program): it is a miss.
    std::panic::catch_unwind(AssertUnwindSafe(|| {
        let roots = roots()?;
        let abs = AbsPath::new(dirfd, path)?;
        if !roots.iter().any(|r| abs.is_under(r)) {
            return None;
        }
        let abs = std::str::from_utf8(abs.as_bytes()).ok()?;
        let copy = client()?.open_cached(abs)?.local_copy()?;
        finish(with_flags(OwnedFd::from(copy), flags)?)
    }))
    .ok()
    .flatten()
}

/// The open flags `fopen` would use for `mode`, if it is a plain read-only mode (`r`,
/// with `b` and `e` in any order).
pub(crate) fn fopen_flags(mode: &CStr) -> Option<c_int> {
    let (&first, rest) = mode.to_bytes().split_first()?;
    if first != b'r' {
        return None;
    }
    rest.iter().try_fold(libc::O_RDONLY, |flags, c| match c {
        b'b' => Some(flags),
        b'e' => Some(flags | libc::O_CLOEXEC),
        _ => None,
    })
}

/// Gives the local copy's descriptor the descriptor flags the caller asked for (it
/// arrives close-on-exec).
fn with_flags(fd: OwnedFd, flags: c_int) -> Option<OwnedFd> {
    let raw = fd.as_raw_fd();
    let cloexec = if flags & libc::O_CLOEXEC != 0 {
        libc::FD_CLOEXEC
    } else {
        0
    };
    // SAFETY: fcntl on a descriptor we own.
    if unsafe { libc::fcntl(raw, libc::F_SETFD, cloexec) } != 0 {
        return None;
    }
    if flags & libc::O_NONBLOCK != 0 {
        // SAFETY: as above.
        let status = unsafe { libc::fcntl(raw, libc::F_GETFL) };
        // SAFETY: as above.
        if status < 0 || unsafe { libc::fcntl(raw, libc::F_SETFL, status | libc::O_NONBLOCK) } != 0
        {
            return None;
        }
    }
    Some(fd)
}

/// False when `SHARDCACHE_PRELOAD=0` (read once).
fn enabled() -> bool {
    static STATE: AtomicU8 = AtomicU8::new(0); // 0 not read yet, 1 on, 2 off
    match STATE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            // SAFETY: a NUL-terminated name; the value is read before returning.
            let off = unsafe {
                let v = libc::getenv(c"SHARDCACHE_PRELOAD".as_ptr());
                !v.is_null() && CStr::from_ptr(v) == c"0"
            };
            STATE.store(if off { 2 } else { 1 }, Ordering::Relaxed);
            !off
        }
    }
}

/// This thread is inside the shim: opens pass through, and errno is restored on the way
/// out (a successful redirect must not leave errno from the work it did).
struct Inside {
    errno: c_int,
}

impl Inside {
    fn enter() -> Option<Self> {
        if INSIDE.get() {
            return None;
        }
        INSIDE.set(true);
        // SAFETY: errno is this thread's.
        Some(Self {
            errno: unsafe { *libc::__errno_location() },
        })
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        // SAFETY: errno is this thread's.
        unsafe { *libc::__errno_location() = self.errno };
        INSIDE.set(false);
    }
}

/// The daemon's backing roots, asked for once. While the daemon cannot be reached, one
/// thread asks again at most every [`RETRY_SECS`]; every other open passes through
/// meanwhile, so that a missing daemon never blocks a program.
fn roots() -> Option<&'static [String]> {
    static ROOTS: AtomicPtr<Vec<String>> = AtomicPtr::new(ptr::null_mut());
    static NEXT_TRY: AtomicU64 = AtomicU64::new(0);
    // SAFETY: ROOTS holds null or a leaked box, never freed.
    if let Some(r) = unsafe { ROOTS.load(Ordering::Acquire).as_ref() } {
        return Some(r);
    }
    let now = monotonic_secs();
    let next = NEXT_TRY.load(Ordering::Relaxed);
    if now < next
        || NEXT_TRY
            .compare_exchange(next, now + RETRY_SECS, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
    {
        return None;
    }
    let roots = client()?.status().ok()?.backing_roots;
    let new = Box::into_raw(Box::new(roots));
    match ROOTS.compare_exchange(ptr::null_mut(), new, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: just leaked.
        Ok(_) => Some(unsafe { &*new }),
        Err(_) => {
            // Unreachable (one asker at a time), but harmless: keep the first.
            // SAFETY: `new` was never shared.
            drop(unsafe { Box::from_raw(new) });
            // SAFETY: as for the first load.
            unsafe { ROOTS.load(Ordering::Acquire).as_ref() }.map(|r| r.as_slice())
        }
    }
}

fn monotonic_secs() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64
}

/// The process's client, made at its first use, with the credentials it connects with.
struct Shared {
    pid: libc::pid_t,
    creds: Creds,
    client: Client,
}

/// The client to ask now. One per process, shared by its threads; a forked child makes
/// its own and leaks the parent's (whose locks other threads of the parent may have
/// held at the fork). The daemon judges access by the credentials a connection was
/// made with, so a thread whose credentials changed since gets a client of its own.
fn client() -> Option<Client> {
    static SHARED: AtomicPtr<Shared> = AtomicPtr::new(ptr::null_mut());
    // SAFETY: getpid cannot fail.
    let pid = unsafe { libc::getpid() };
    let creds = Creds::now()?;
    loop {
        let current = SHARED.load(Ordering::Acquire);
        // SAFETY: SHARED holds null or a leaked box, never freed.
        if let Some(s) = unsafe { current.as_ref() }
            && s.pid == pid
        {
            return Some(if s.creds == creds {
                s.client.clone()
            } else {
                Client::connect()
            });
        }
        let new = Box::into_raw(Box::new(Shared {
            pid,
            creds: creds.clone(),
            client: Client::connect(),
        }));
        match SHARED.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: just leaked; the one it replaced (another process's) is leaked too.
            Ok(_) => return Some(unsafe { &*new }.client.clone()),
            // Another thread was first: use its client.
            // SAFETY: `new` was never shared.
            Err(_) => drop(unsafe { Box::from_raw(new) }),
        }
    }
}

/// What the daemon learns of a connection: effective uid, gid and supplementary groups.
#[derive(Clone, PartialEq, Eq)]
struct Creds {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
}

impl Creds {
    fn now() -> Option<Self> {
        // SAFETY: getgroups with size 0 only counts.
        let n = unsafe { libc::getgroups(0, ptr::null_mut()) };
        let mut groups = vec![0; usize::try_from(n).ok()?];
        // SAFETY: `groups` has room for `n` entries.
        let got = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
        groups.truncate(usize::try_from(got).ok()?);
        Some(Self {
            // SAFETY: cannot fail.
            uid: unsafe { libc::geteuid() },
            // SAFETY: cannot fail.
            gid: unsafe { libc::getegid() },
            groups,
        })
    }
}
