//! `libshardcache_preload.so`: an `LD_PRELOAD` shim that lets unmodified programs
//! (`cat`, `dd`, Python's `open`, data loaders) read cached dataset files from the
//! node-local copy.
//!
//! **What is redirected.** A read-only open (`open`, `open64`, `openat`, `openat64`,
//! their fortified `__open*_2` forms, `fopen` and `fopen64` in mode `r`, `rb`, `re` or
//! `rbe`) of a path that lies under one of the daemon's backing roots. The shim asks the
//! daemon for the file ([`shardcache_client::Client::open_cached`], which never touches
//! the backing store itself), waits until every block of
//! it is in the local copy ([`shardcache_client::Reader::local_copy`]), and returns a
//! descriptor of that copy: the program then reads local NVMe with plain `read`, `pread`
//! or `mmap`, and the shim is out of the way. The descriptor gets exactly the
//! `O_CLOEXEC` and `O_NONBLOCK` the caller asked for.
//!
//! **What is not.** Every other open goes to the real C library function untouched:
//! writes, creation, truncation, appends, `O_DIRECTORY`, `O_PATH`, `O_TMPFILE`, any
//! flag a local descriptor would not honour exactly (`O_NOFOLLOW`, `O_NOATIME`,
//! `O_DIRECT`, `O_SYNC`, ...), paths outside the roots, paths naming a directory, and
//! everything when `SHARDCACHE_PRELOAD=0`. Opens the client library makes itself pass
//! through (a thread-local guard), so the shim never recurses.
//!
//! **Why this is safe.** The daemon decides, not the shim: it checks the caller's
//! credentials (taken by the kernel from the socket) against the backing file's modes,
//! resolves `..` and symlinks inside the root, and hands out a descriptor only for a
//! complete, checksummed copy of the current version (docs/SEMANTICS.md). When anything
//! stands in the way (no daemon, a refusal, a timeout, an empty file, a panic) the real
//! call runs with the original arguments, so the program sees exactly what it would have
//! seen without the shim, errno included.
//!
//! **Limits.** Opens that do not go through these symbols are not seen (`openat2`, raw
//! syscalls, statically linked programs, C library internals other than `fopen`). The
//! descriptor is the local copy's: `fstat` reports its inode, owner and times (the size
//! is the file's), and `/proc/self/fd` names the cache file. A cold file's open returns
//! once the daemon has fetched all of it. Paths are matched as written, after making
//! them absolute: a path that reaches a root through a symlink outside it passes
//! through.

#[cfg(not(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
)))]
compile_error!(
    "the preload shim defines C-variadic `open` as a fixed-arity function, which is sound \
     only where a variadic argument travels like a fixed one (x86_64 and aarch64 Linux)"
);

mod path;
mod redirect;

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, IntoRawFd};
use std::sync::atomic::{AtomicPtr, Ordering};

use libc::FILE;

// The real functions are C-variadic where the C prototype is (`open(path, flags, ...)`):
// Rust may call such a function on stable, only not define one.
type OpenFn = unsafe extern "C" fn(*const c_char, c_int, ...) -> c_int;
type OpenatFn = unsafe extern "C" fn(c_int, *const c_char, c_int, ...) -> c_int;
type Open2Fn = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
type Openat2Fn = unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int;
type FopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE;

/// Defines `fn getter() -> Option<Type>`: the next definition of the C symbol after this
/// library's (the C library's), looked up once and cached, without allocating.
macro_rules! real {
    ($($getter:ident: $ty:ty = $symbol:literal;)*) => {$(
        fn $getter() -> Option<$ty> {
            static ADDR: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
            let mut p = ADDR.load(Ordering::Relaxed);
            if p.is_null() {
                // SAFETY: a NUL-terminated symbol name; RTLD_NEXT is valid from a
                // shared object.
                p = unsafe { libc::dlsym(libc::RTLD_NEXT, $symbol.as_ptr()) };
                ADDR.store(p, Ordering::Relaxed);
            }
            // SAFETY: the C library's function of that name has this prototype.
            (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
        }
    )*};
}

real! {
    real_open: OpenFn = c"open";
    real_open64: OpenFn = c"open64";
    real_openat: OpenatFn = c"openat";
    real_openat64: OpenatFn = c"openat64";
    real_open_2: Open2Fn = c"__open_2";
    real_open64_2: Open2Fn = c"__open64_2";
    real_openat_2: Openat2Fn = c"__openat_2";
    real_openat64_2: Openat2Fn = c"__openat64_2";
    real_fopen: FopenFn = c"fopen";
    real_fopen64: FopenFn = c"fopen64";
}

/// The answer when the C library lacks the function the program called (cannot happen
/// with a C library that exported it to the program in the first place).
fn missing() -> c_int {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
    -1
}

/// A descriptor of the local copy, or the real open's result.
///
/// # Safety
/// The C contract of `openat`.
unsafe fn open_at(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    real: impl FnOnce() -> Option<c_int>,
) -> c_int {
    // SAFETY: forwarded from the caller.
    let fd = unsafe { redirect::local_copy(dirfd, path, flags, |fd| Some(fd.into_raw_fd())) };
    fd.or_else(real).unwrap_or_else(missing)
}

/// A stream over the local copy, or the real `fopen`'s result.
///
/// # Safety
/// The C contract of `fopen`.
unsafe fn fopen_any(path: *const c_char, mode: *const c_char, real: Option<FopenFn>) -> *mut FILE {
    let flags = if mode.is_null() {
        None
    } else {
        // SAFETY: a non-null mode is NUL-terminated (the caller's contract).
        redirect::fopen_flags(unsafe { CStr::from_ptr(mode) })
    };
    if let Some(flags) = flags {
        // SAFETY: forwarded from the caller.
        let stream = unsafe {
            redirect::local_copy(libc::AT_FDCWD, path, flags, |fd| {
                // SAFETY: a descriptor we own, opened read-only as `mode` asks; the
                // stream owns it once fdopen succeeds.
                let stream = libc::fdopen(fd.as_raw_fd(), mode);
                (!stream.is_null()).then(|| {
                    let _ = fd.into_raw_fd();
                    stream
                })
            })
        };
        if let Some(stream) = stream {
            return stream;
        }
    }
    match real {
        // SAFETY: the caller's arguments, unchanged.
        Some(f) => unsafe { f(path, mode) },
        None => {
            missing();
            std::ptr::null_mut()
        }
    }
}

// The hooks. `open` and `openat` are C-variadic; they are defined here with `mode` as a
// fixed argument. On x86_64 (System V) and aarch64 Linux a variadic integer argument is
// passed in the same register as the fixed argument in its position, so `mode` is what
// the caller passed, or an unspecified value when it passed none; it is only ever handed
// on to the real function, which reads it only when `flags` say it was passed.

/// `open(2)`.
///
/// # Safety
/// The C contract: `path` is null or NUL-terminated; `mode` is passed when `flags`
/// contain `O_CREAT` or `O_TMPFILE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: the caller's contract, and its arguments unchanged for the real call.
    unsafe {
        open_at(libc::AT_FDCWD, path, flags, || {
            Some(real_open()?(path, flags, mode))
        })
    }
}

/// `open64`: `open`, where all offsets are 64 bits anyway.
///
/// # Safety
/// As for [`open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: as in `open`.
    unsafe {
        open_at(libc::AT_FDCWD, path, flags, || {
            Some(real_open64()?(path, flags, mode))
        })
    }
}

/// `openat(2)`.
///
/// # Safety
/// As for [`open`]; `dirfd` is any integer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn openat(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    // SAFETY: as in `open`.
    unsafe {
        open_at(dirfd, path, flags, || {
            Some(real_openat()?(dirfd, path, flags, mode))
        })
    }
}

/// `openat64`.
///
/// # Safety
/// As for [`openat`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn openat64(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    // SAFETY: as in `open`.
    unsafe {
        open_at(dirfd, path, flags, || {
            Some(real_openat64()?(dirfd, path, flags, mode))
        })
    }
}

/// `__open_2`: `open` without a mode, as `_FORTIFY_SOURCE` compiles it.
///
/// # Safety
/// `path` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as in `open`.
    unsafe {
        open_at(libc::AT_FDCWD, path, flags, || {
            Some(real_open_2()?(path, flags))
        })
    }
}

/// `__open64_2`.
///
/// # Safety
/// As for [`__open_2`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as in `open`.
    unsafe {
        open_at(libc::AT_FDCWD, path, flags, || {
            Some(real_open64_2()?(path, flags))
        })
    }
}

/// `__openat_2`.
///
/// # Safety
/// As for [`__open_2`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as in `open`.
    unsafe {
        open_at(dirfd, path, flags, || {
            Some(real_openat_2()?(dirfd, path, flags))
        })
    }
}

/// `__openat64_2`.
///
/// # Safety
/// As for [`__open_2`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as in `open`.
    unsafe {
        open_at(dirfd, path, flags, || {
            Some(real_openat64_2()?(dirfd, path, flags))
        })
    }
}

/// `fopen(3)`.
///
/// # Safety
/// `path` and `mode` are null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    // SAFETY: forwarded from the caller.
    unsafe { fopen_any(path, mode, real_fopen()) }
}

/// `fopen64`.
///
/// # Safety
/// As for [`fopen`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    // SAFETY: forwarded from the caller.
    unsafe { fopen_any(path, mode, real_fopen64()) }
}
