//! A backing store on a mounted POSIX file system (Lustre, GPFS, NFS, CephFS, a local
//! directory).
//!
//! Resolution walks the path one component at a time from a held descriptor of the root,
//! as the kernel's own resolution does, but bounded to the root: every component is
//! opened with `O_PATH | O_NOFOLLOW` relative to the directory before it, and what the
//! access check learns (owner, mode, ACL, version) comes from `fstat` of that descriptor
//! and an ACL probe through `/proc/self/fd/N` — never from a second lookup of the same
//! name, which another process could have swapped for a different directory or file in
//! between. Symlinks are read from their own descriptor (`readlinkat(fd, "")`) and
//! expanded by this code, `..` pops the physical directory stack, and anything that would
//! leave the root is refused.
//!
//! The directories above the root (from `/` down to its parent) are walked the same way
//! by name, and their owners come first in [`Stat::dirs`]: the kernel checks search
//! permission on them too. The walk must end at the very directory held open since start
//! (same device and inode); when the root's path leads elsewhere (it was moved, replaced
//! or mounted over) every stat fails with [`BackingError::RootReplaced`], so that clients
//! read such paths themselves.
//!
//! Resolved directories (ancestors included) are trusted for the directory TTL, counted
//! from when the oldest of them was checked; a cached stack's owners are always those of
//! its own descriptors.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::{
    Backing, BackingError, BackingFile, DirEntry, EntryKind, Owner, Stat, Version, normalize,
};

/// Most symlinks one resolution may expand (Linux's own limit).
const MAX_SYMLINKS: usize = 40;

/// The POSIX ACL attribute probed on every object the access check relies on.
const ACL_XATTR: &str = "system.posix_acl_access";

/// A POSIX directory tree used as the backing store.
#[derive(Debug)]
pub struct PosixBacking {
    root: PathBuf,
    root_fd: Arc<OwnedFd>,
    /// Device and inode of `root_fd`: where the walk down the root's path must end.
    root_id: (u64, u64),
    /// How long resolved directories are trusted (zero: not at all).
    ttl: Duration,
    /// Directories already resolved (by their plain relative path; `""` is the root with
    /// its ancestors): a file's stat then walks only its last component.
    dirs: Option<moka::sync::Cache<String, Arc<DirStack>>>,
    /// The root's path led elsewhere at the last walk (logged once per change).
    replaced: AtomicBool,
}

/// One directory of a walk: its descriptor (`O_PATH`), its owner (from `fstat` of that
/// very descriptor) and its name in its parent.
#[derive(Debug, Clone)]
struct Dir {
    fd: Arc<OwnedFd>,
    owner: Owner,
    name: String,
}

/// The physical directory stack of a walk.
#[derive(Debug, Clone)]
struct DirStack {
    /// Owners of the directories from `/` down to the root's parent, in order.
    above: Arc<[Owner]>,
    /// The root first, then each directory below it.
    dirs: Vec<Dir>,
    /// When the oldest of these directories was checked: the stack may be reused until
    /// this plus the TTL.
    checked: Instant,
}

impl PosixBacking {
    /// Opens the tree at `root` (which must be an existing directory; it is canonicalized).
    pub fn new(root: &Path) -> io::Result<Self> {
        Self::with_dir_ttl(root, Duration::ZERO)
    }

    /// Like [`PosixBacking::new`], trusting resolved directories (their owners and modes,
    /// those above the root included) for `ttl`; `0` resolves every component, from `/`,
    /// on every stat.
    pub fn with_dir_ttl(root: &Path, ttl: Duration) -> io::Result<Self> {
        let root = std::fs::canonicalize(root)?;
        let root_fd = rustix::fs::open(
            &root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let st = rustix::fs::fstat(&root_fd)?;
        let dirs = (!ttl.is_zero()).then(|| {
            moka::sync::Cache::builder()
                .max_capacity(65536)
                .time_to_live(ttl)
                .build()
        });
        Ok(Self {
            root,
            root_fd: Arc::new(root_fd),
            root_id: (st.st_dev, st.st_ino),
            ttl,
            dirs,
            replaced: AtomicBool::new(false),
        })
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A stack still within the TTL, counted from its oldest check.
    fn cached(&self, key: &str) -> Option<Arc<DirStack>> {
        let s = self.dirs.as_ref()?.get(key)?;
        (s.checked.elapsed() < self.ttl).then_some(s)
    }

    fn remember(&self, key: &str, stack: &DirStack) {
        if let Some(d) = &self.dirs {
            d.insert(key.to_owned(), Arc::new(stack.clone()));
        }
    }

    /// The stack of the root: the owners of `/` and of every directory down to the root,
    /// walked by name, and the held root descriptor, once the walk is known to end there.
    fn root_stack(&self, path: &str) -> Result<DirStack, BackingError> {
        if let Some(s) = self.cached("") {
            return Ok((*s).clone());
        }
        let checked = Instant::now();
        let replaced = || {
            if !self.replaced.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    root = %self.root.display(),
                    "the backing root's path no longer leads to the directory opened at                      start (moved, replaced or mounted over): nothing under it is served                      through the cache (clients read it themselves) until it does again                      or the daemon restarts"
                );
            }
            BackingError::RootReplaced(self.root.display().to_string())
        };
        let walk_err = |e: Errno| match e {
            Errno::NOENT | Errno::NOTDIR | Errno::LOOP => replaced(),
            e => Self::io_err(path, e),
        };
        let mut fd = rustix::fs::open(
            "/",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Self::io_err(path, e))?;
        let mut above = Vec::new();
        for c in self.root.components() {
            let Component::Normal(name) = c else { continue };
            above.push(self.owner_of(path, &fd)?.0);
            fd = rustix::fs::openat(
                &fd,
                name,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(walk_err)?;
        }
        let (owner, st) = self.owner_of(path, &fd)?;
        if (st.st_dev, st.st_ino) != self.root_id {
            return Err(replaced());
        }
        if self.replaced.swap(false, Ordering::Relaxed) {
            tracing::info!(root = %self.root.display(), "the backing root is reached again");
        }
        let stack = DirStack {
            above: above.into(),
            dirs: vec![Dir {
                fd: self.root_fd.clone(),
                owner,
                name: String::new(),
            }],
            checked,
        };
        self.remember("", &stack);
        Ok(stack)
    }

    fn io_err(path: &str, e: impl Into<io::Error>) -> BackingError {
        let e: io::Error = e.into();
        match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => BackingError::NotFound(path.to_owned()),
            Some(libc::ELOOP) => BackingError::Invalid {
                path: path.to_owned(),
                why: "symlink loop",
            },
            _ => BackingError::Io {
                path: path.to_owned(),
                source: e,
            },
        }
    }

    /// Opens a directory component of an already canonical path.
    fn open_dir_at(&self, dir: &OwnedFd, name: &str) -> Result<OwnedFd, Errno> {
        rustix::fs::openat(
            dir,
            name,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
    }

    /// The owner, mode and ACL flag of the object open as `fd`, and its `fstat`.
    fn owner_of(
        &self,
        path: &str,
        fd: &OwnedFd,
    ) -> Result<(Owner, rustix::fs::Stat), BackingError> {
        let st = rustix::fs::fstat(fd).map_err(|e| Self::io_err(path, e))?;
        let acl = has_acl(fd).map_err(|source| BackingError::Io {
            path: path.to_owned(),
            source,
        })?;
        Ok((owner(&st, acl), st))
    }
}

/// Whether the object open as `fd` carries an access ACL. Probed through the
/// `/proc/self/fd` magic link, which names that very object (an `O_PATH` descriptor
/// cannot be asked directly), never by the name it was found under.
fn has_acl(fd: &OwnedFd) -> io::Result<bool> {
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    match rustix::fs::getxattr_query(link.as_str(), ACL_XATTR) {
        Ok(_) => Ok(true),
        Err(Errno::NODATA) | Err(Errno::NOTSUP) => Ok(false),
        Err(Errno::NOENT) => Err(io::Error::other(
            "cannot probe ACLs: /proc is not mounted (the daemon needs /proc/self/fd)",
        )),
        Err(e) => Err(e.into()),
    }
}

fn owner(st: &rustix::fs::Stat, acl: bool) -> Owner {
    Owner {
        uid: st.st_uid,
        gid: st.st_gid,
        mode: st.st_mode & 0o7777,
        acl,
    }
}

fn version_of(st: &rustix::fs::Stat) -> Version {
    Version {
        size: st.st_size as u64,
        mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec as i64,
        ctime_ns: st.st_ctime * 1_000_000_000 + st.st_ctime_nsec as i64,
        ino: st.st_ino,
        dev: st.st_dev,
    }
}

impl Backing for PosixBacking {
    fn stat(&self, path: &str) -> Result<Stat, BackingError> {
        // Validate the shape (relative, no NUL) up front; `..` is applied physically below.
        normalize(path)?;
        // A plain path (no empty, `.` or `..` component) whose directory was resolved
        // recently starts from there.
        let plain = path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
        let cached = match (plain, path.rfind('/')) {
            (true, Some(i)) => self.cached(&path[..i]).map(|s| (s, &path[i + 1..])),
            _ => None,
        };
        let (mut stack, mut pending): (DirStack, Vec<String>) = match cached {
            Some((s, name)) => ((*s).clone(), vec![name.to_owned()]),
            None => (
                self.root_stack(path)?,
                path.split('/').rev().map(str::to_owned).collect(),
            ),
        };
        // Directories the walk went through and then left (by `..` or an absolute
        // symlink): the kernel needs search permission on them too.
        let mut left: Vec<Owner> = Vec::new();
        // Directories reached without symlinks or `..` are remembered under their path.
        let mut clean = true;
        let mut links = 0;
        while let Some(comp) = pending.pop() {
            match comp.as_str() {
                "" | "." => continue,
                ".." => {
                    if stack.dirs.len() == 1 {
                        return Err(BackingError::Escapes(path.to_owned()));
                    }
                    left.extend(stack.dirs.pop().map(|d| d.owner));
                    clean = false;
                    continue;
                }
                _ => {}
            }
            let dir = &stack.dirs.last().expect("the stack holds the root").fd;
            let more = pending.iter().any(|c| !c.is_empty() && c != ".");
            // The object itself, whatever it is: a FIFO or device opened O_PATH neither
            // blocks nor acts. A component with more to come is first opened as a
            // directory, which mounts an automount point as the kernel's own walk would;
            // only a symlink (or a file, then refused) takes a second call.
            let open = |dir_flag: OFlags| {
                rustix::fs::openat(
                    dir,
                    comp.as_str(),
                    OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC | dir_flag,
                    Mode::empty(),
                )
            };
            let fd = match open(if more {
                OFlags::DIRECTORY
            } else {
                OFlags::empty()
            }) {
                Err(Errno::NOTDIR) if more => open(OFlags::empty()),
                r => r,
            }
            .map_err(|e| Self::io_err(path, e))?;
            let st = rustix::fs::fstat(&fd).map_err(|e| Self::io_err(path, e))?;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Symlink => {
                    clean = false;
                    links += 1;
                    if links > MAX_SYMLINKS {
                        return Err(BackingError::Invalid {
                            path: path.to_owned(),
                            why: "too many symlinks",
                        });
                    }
                    let target = rustix::fs::readlinkat(&fd, "", Vec::new())
                        .map_err(|e| Self::io_err(path, e))?;
                    let target = OsStr::from_bytes(target.as_bytes());
                    let target = target.to_str().ok_or_else(|| BackingError::Invalid {
                        path: path.to_owned(),
                        why: "symlink target is not UTF-8",
                    })?;
                    let rest = if target.starts_with('/') {
                        // An absolute target is followed only when it stays under the root.
                        let t = Path::new(target);
                        let Ok(inside) = t.strip_prefix(&self.root) else {
                            return Err(BackingError::Escapes(path.to_owned()));
                        };
                        left.extend(stack.dirs.drain(1..).map(|d| d.owner));
                        // `strip_prefix` drops a trailing `/`, which the kernel keeps.
                        let slash = if target.ends_with('/') { "/" } else { "" };
                        format!("{}{slash}", inside.to_str().unwrap_or_default())
                    } else {
                        target.to_owned()
                    };
                    pending.extend(rest.split('/').rev().map(str::to_owned));
                }
                FileType::Directory => {
                    if !more {
                        return Err(BackingError::NotAFile(path.to_owned()));
                    }
                    let acl = has_acl(&fd).map_err(|source| BackingError::Io {
                        path: path.to_owned(),
                        source,
                    })?;
                    stack.dirs.push(Dir {
                        fd: Arc::new(fd),
                        owner: owner(&st, acl),
                        name: comp,
                    });
                    if clean {
                        let key: Vec<&str> =
                            stack.dirs[1..].iter().map(|d| d.name.as_str()).collect();
                        self.remember(&key.join("/"), &stack);
                    }
                }
                FileType::RegularFile => {
                    // Anything after a file, even a bare `/` or `/.`, is ENOTDIR.
                    if !pending.is_empty() {
                        return Err(BackingError::NotFound(path.to_owned()));
                    }
                    let acl = has_acl(&fd).map_err(|source| BackingError::Io {
                        path: path.to_owned(),
                        source,
                    })?;
                    let mut canon: Vec<&str> =
                        stack.dirs[1..].iter().map(|d| d.name.as_str()).collect();
                    canon.push(&comp);
                    let mut dirs = stack.above.to_vec();
                    dirs.extend(left);
                    dirs.extend(stack.dirs.iter().map(|d| d.owner));
                    return Ok(Stat {
                        path: canon.join("/"),
                        dirs,
                        owner: owner(&st, acl),
                        version: version_of(&st),
                    });
                }
                _ => return Err(BackingError::NotAFile(path.to_owned())),
            }
        }
        Err(BackingError::NotAFile(path.to_owned()))
    }

    fn open(&self, stat: &Stat) -> Result<Box<dyn BackingFile>, BackingError> {
        let p = stat.path.as_str();
        let comps = normalize(p)?;
        let (name, dirs) = comps
            .split_last()
            .expect("normalize returns at least one component");
        // The parent: the very directory a recent stat decided on when the directory
        // cache still holds it, else walked again from the root.
        let parent = match dirs {
            [] => self.root_fd.clone(),
            _ => match self.cached(&dirs.join("/")) {
                Some(s) => s.dirs.last().expect("the stack holds the root").fd.clone(),
                None => {
                    let mut fd = self.open_dir_at(&self.root_fd, dirs[0]);
                    for d in &dirs[1..] {
                        fd = fd.and_then(|fd| self.open_dir_at(&fd, d));
                    }
                    Arc::new(fd.map_err(|e| Self::io_err(p, e))?)
                }
            },
        };
        // Check the object itself, then open that same inode for reading (through its
        // /proc/self/fd link): never a FIFO or device, never a file swapped in between.
        let fd = rustix::fs::openat(
            &*parent,
            *name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Self::io_err(p, e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| Self::io_err(p, e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile
            || version_of(&st) != stat.version
        {
            return Err(BackingError::Changed(p.to_owned()));
        }
        let file = rustix::fs::open(
            format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str(),
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY,
            Mode::empty(),
        )
        .map_err(|e| BackingError::Io {
            path: p.to_owned(),
            source: e.into(),
        })?;
        Ok(Box::new(PosixFile {
            file: File::from(file),
        }))
    }

    fn list(&self, dir: &str) -> Result<Vec<DirEntry>, BackingError> {
        let comps = if dir.is_empty() {
            Vec::new()
        } else {
            normalize(dir)?
        };
        let mut fd = self.root_fd.try_clone().map_err(|e| Self::io_err(dir, e))?;
        for d in &comps {
            fd = self.open_dir_at(&fd, d).map_err(|e| Self::io_err(dir, e))?;
        }
        let rd = rustix::fs::openat(
            &fd,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Self::io_err(dir, e))?;
        let mut out = Vec::new();
        let it = rustix::fs::Dir::read_from(rd.as_fd()).map_err(|e| Self::io_err(dir, e))?;
        for ent in it {
            let ent = ent.map_err(|e| Self::io_err(dir, e))?;
            let name = ent.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let Ok(name) = std::str::from_utf8(name) else {
                continue;
            };
            let kind = match ent.file_type() {
                FileType::RegularFile => EntryKind::File,
                FileType::Directory => EntryKind::Dir,
                FileType::Symlink => EntryKind::Symlink,
                FileType::Unknown => match rustix::fs::statat(&fd, name, AtFlags::SYMLINK_NOFOLLOW)
                {
                    Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                        FileType::RegularFile => EntryKind::File,
                        FileType::Directory => EntryKind::Dir,
                        FileType::Symlink => EntryKind::Symlink,
                        _ => EntryKind::Other,
                    },
                    Err(_) => EntryKind::Other,
                },
                _ => EntryKind::Other,
            };
            out.push(DirEntry {
                name: name.to_owned(),
                kind,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn dir_owners(&self, dir: &str) -> Result<Vec<Owner>, BackingError> {
        let comps = if dir.is_empty() {
            Vec::new()
        } else {
            normalize(dir)?
        };
        let stack = match self.cached(&comps.join("/")) {
            Some(s) => (*s).clone(),
            None => {
                let mut stack = self.root_stack(dir)?;
                for (i, c) in comps.iter().enumerate() {
                    let parent = &stack.dirs.last().expect("the stack holds the root").fd;
                    // The owner of the directory actually opened (its descriptor's), not
                    // of whatever the name points to a moment later.
                    let fd = self
                        .open_dir_at(parent, c)
                        .map_err(|e| Self::io_err(dir, e))?;
                    let (owner, _) = self.owner_of(dir, &fd)?;
                    stack.dirs.push(Dir {
                        fd: Arc::new(fd),
                        owner,
                        name: (*c).to_owned(),
                    });
                    self.remember(&comps[..=i].join("/"), &stack);
                }
                stack
            }
        };
        let mut owners = stack.above.to_vec();
        owners.extend(stack.dirs.iter().map(|d| d.owner));
        Ok(owners)
    }
}

/// An open POSIX backing file.
#[derive(Debug)]
struct PosixFile {
    file: File,
}

impl BackingFile for PosixFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.file.read_at(buf, offset)
    }

    fn version(&self) -> io::Result<Version> {
        Ok(version_of(&rustix::fs::fstat(&self.file)?))
    }
}

/// `FUSE_SUPER_MAGIC`, the `f_type` of every FUSE mount (sshfs, s3fs, gcsfuse, ...).
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Whether the kernel keeps the pages of a file under `path` from one open of it to the
/// next, so that a read by one process leaves the bytes for another's (true for local
/// file systems, NFS, Lustre, GPFS, CephFS; false for FUSE, which drops them at each open
/// unless the FUSE server asks to keep them). `None` when the file system cannot be
/// asked.
pub fn keeps_page_cache(path: &Path) -> Option<bool> {
    let fs = rustix::fs::statfs(path).ok()?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    Some(fs.f_type as i64 != FUSE_SUPER_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::conformance::{self, Fixture};
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_local_directory_keeps_its_page_cache_and_a_missing_one_cannot_be_asked() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(keeps_page_cache(dir.path()), Some(true));
        assert_eq!(keeps_page_cache(&dir.path().join("missing")), None);
    }

    /// A backing root one level below a temporary directory (its parent, whose mode the
    /// tests change).
    struct Posix {
        parent: tempfile::TempDir,
        root: PathBuf,
        backing: PosixBacking,
    }

    impl Posix {
        fn new() -> Self {
            Self::with_ttl(Duration::ZERO)
        }

        fn with_ttl(ttl: Duration) -> Self {
            let parent = tempfile::tempdir().unwrap();
            let root = parent.path().canonicalize().unwrap().join("root");
            std::fs::create_dir(&root).unwrap();
            let backing = PosixBacking::with_dir_ttl(&root, ttl).unwrap();
            Self {
                parent,
                root,
                backing,
            }
        }

        fn cached() -> Self {
            Self::with_ttl(Duration::from_secs(3600))
        }
    }

    impl Fixture for Posix {
        fn backing(&self) -> &dyn Backing {
            &self.backing
        }
        fn put(&self, path: &str, data: &[u8], mode: u32) {
            let p = self.root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, data).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        fn set_dir_mode(&self, path: &str, mode: u32) {
            let p = self.root.join(path);
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        fn rewrite_in_place(&self, path: &str, data: &[u8]) {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(self.root.join(path))
                .unwrap();
            f.write_all(data).unwrap();
        }
        fn above(&self) -> usize {
            self.root
                .components()
                .filter(|c| matches!(c, Component::Normal(_)))
                .count()
        }
        fn set_parent_mode(&self, mode: u32) {
            std::fs::set_permissions(self.parent.path(), std::fs::Permissions::from_mode(mode))
                .unwrap();
        }
    }

    #[test]
    fn conformance() {
        conformance::run_all(&Posix::new);
    }

    #[test]
    fn conformance_with_a_directory_cache() {
        conformance::run_all(&Posix::cached);
    }

    #[test]
    fn symlinks_inside_the_root_resolve_and_outside_are_refused() {
        for fx in [Posix::new(), Posix::cached()] {
            symlinks(fx);
        }
    }

    #[test]
    fn cached_directories_keep_their_owners_and_stay_correct() {
        let fx = Posix::cached();
        fx.put("a/b/f1", b"1", 0o644);
        fx.put("a/b/f2", b"22", 0o644);
        fx.set_dir_mode("a", 0o711);
        let s1 = fx.backing.stat("a/b/f1").unwrap();
        let s2 = fx.backing.stat("a/b/f2").unwrap();
        assert_eq!(s2.path, "a/b/f2");
        assert_eq!(
            s1.dirs, s2.dirs,
            "the second stat reuses the resolved directory"
        );
        assert_eq!(s2.dirs[fx.above() + 1].mode, 0o711);
        assert_eq!(s2.version.size, 2);
        assert!(matches!(
            fx.backing.stat("a/b/none"),
            Err(BackingError::NotFound(_))
        ));
        // A symlinked directory is resolved, never cached under the link's name.
        std::os::unix::fs::symlink("a/b", fx.root.join("link")).unwrap();
        assert_eq!(fx.backing.stat("link/f1").unwrap().path, "a/b/f1");
        assert_eq!(fx.backing.stat("link/f2").unwrap().path, "a/b/f2");
    }

    fn symlinks(fx: Posix) {
        fx.put("real/a.bin", b"abc", 0o644);
        let root = fx.root.as_path();
        std::os::unix::fs::symlink("real", root.join("alias")).unwrap();
        std::os::unix::fs::symlink(root.join("real/a.bin"), root.join("abs-inside")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("abs-outside")).unwrap();
        std::os::unix::fs::symlink("../../../../etc/passwd", root.join("real/rel-outside"))
            .unwrap();
        std::os::unix::fs::symlink("loop", root.join("loop")).unwrap();

        let b = &fx.backing;
        assert_eq!(b.stat("alias/a.bin").unwrap().path, "real/a.bin");
        assert_eq!(b.stat("abs-inside").unwrap().path, "real/a.bin");
        assert!(matches!(
            b.stat("abs-outside"),
            Err(BackingError::Escapes(_))
        ));
        assert!(matches!(
            b.stat("real/rel-outside"),
            Err(BackingError::Escapes(_))
        ));
        assert!(matches!(b.stat("loop"), Err(BackingError::Invalid { .. })));
        assert!(matches!(
            b.stat("real/../../etc/passwd"),
            Err(BackingError::Escapes(_))
        ));
        // `..` is physical: alias/.. is the root, not "real".
        assert_eq!(b.stat("alias/../real/a.bin").unwrap().path, "real/a.bin");
    }

    /// The owners of `path`'s directories from `/` to its parent, from the kernel.
    fn kernel_owners(path: &Path) -> Vec<u32> {
        use std::os::unix::fs::MetadataExt;
        path.ancestors()
            .skip(1)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .map(|d| std::fs::metadata(d).unwrap().mode() & 0o7777)
            .collect()
    }

    #[test]
    fn directories_above_the_root_are_reported_from_slash_down() {
        let fx = Posix::new();
        fx.put("d/f", b"x", 0o644);
        fx.set_parent_mode(0o710);
        let st = fx.backing.stat("d/f").unwrap();
        let modes: Vec<u32> = st.dirs.iter().map(|d| d.mode).collect();
        assert_eq!(modes, kernel_owners(&fx.root.join("d/f")));
        assert_eq!(modes[fx.above() - 1], 0o710);
    }

    #[test]
    fn a_change_above_the_root_is_seen_within_the_ttl() {
        // Without a TTL at once; with one, not before it ends (an hour here) ...
        let (now, later) = (Posix::new(), Posix::cached());
        for fx in [&now, &later] {
            fx.put("f", b"x", 0o644);
            fx.set_parent_mode(0o755);
            assert_eq!(
                fx.backing.stat("f").unwrap().dirs[fx.above() - 1].mode,
                0o755
            );
            fx.set_parent_mode(0o700);
        }
        assert_eq!(
            now.backing.stat("f").unwrap().dirs[now.above() - 1].mode,
            0o700
        );
        assert_eq!(
            later.backing.stat("f").unwrap().dirs[later.above() - 1].mode,
            0o755,
            "trusted within the TTL"
        );
        // ... and once it has: the ancestors are walked again (bounded wait).
        let ttl = Duration::from_millis(200);
        let fx = Posix::with_ttl(ttl);
        fx.put("d/f", b"x", 0o644);
        fx.set_parent_mode(0o755);
        let n = fx.above();
        assert_eq!(fx.backing.stat("d/f").unwrap().dirs[n - 1].mode, 0o755);
        fx.set_parent_mode(0o700);
        let t0 = Instant::now();
        while fx.backing.stat("d/f").unwrap().dirs[n - 1].mode != 0o700 {
            assert!(t0.elapsed() < Duration::from_secs(30), "never seen");
            std::thread::sleep(Duration::from_millis(10));
        }
        // A directory resolved later from the cached root expires with the root.
        fx.set_parent_mode(0o755);
        fx.put("e/g", b"y", 0o644);
        let t0 = Instant::now();
        while fx.backing.stat("e/g").unwrap().dirs[n - 1].mode != 0o755 {
            assert!(t0.elapsed() < Duration::from_secs(30), "never seen");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_root_whose_path_leads_elsewhere_is_refused_until_it_leads_back() {
        let fx = Posix::new();
        fx.put("f", b"x", 0o644);
        fx.backing.stat("f").unwrap();
        let away = fx.parent.path().join("away");
        std::fs::rename(&fx.root, &away).unwrap();
        assert!(matches!(
            fx.backing.stat("f"),
            Err(BackingError::RootReplaced(_))
        ));
        // Another directory at the root's path, with a file of the same name.
        std::fs::create_dir(&fx.root).unwrap();
        std::fs::write(fx.root.join("f"), b"other").unwrap();
        assert!(matches!(
            fx.backing.stat("f"),
            Err(BackingError::RootReplaced(_))
        ));
        std::fs::remove_dir_all(&fx.root).unwrap();
        // A symlink to the real root is not followed either: the kernel would take the
        // client elsewhere than the held directory only by chance.
        std::os::unix::fs::symlink(&away, &fx.root).unwrap();
        assert!(matches!(
            fx.backing.stat("f"),
            Err(BackingError::RootReplaced(_))
        ));
        std::fs::remove_file(&fx.root).unwrap();
        std::fs::rename(&away, &fx.root).unwrap();
        assert_eq!(fx.backing.stat("f").unwrap().version.size, 1);
    }

    /// Runs `f` on a thread and gives up (failing) after 10 s instead of hanging.
    fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("blocked for 10 s")
    }

    #[test]
    fn fifos_and_devices_are_never_opened_for_reading() {
        let fx = Arc::new(Posix::new());
        fx.put("f", b"abc", 0o644);
        let mkfifo = |p: &Path| {
            rustix::fs::mknodat(
                rustix::fs::CWD,
                p,
                FileType::Fifo,
                Mode::from_raw_mode(0o666),
                0,
            )
            .unwrap()
        };
        mkfifo(&fx.root.join("fifo"));
        let b = fx.clone();
        assert!(matches!(
            bounded(move || b.backing.stat("fifo")),
            Err(BackingError::NotAFile(_))
        ));
        // The file is replaced by a FIFO between the stat and the fill's open: the open
        // must neither block (no writer will come) nor read it.
        let st = fx.backing.stat("f").unwrap();
        std::fs::remove_file(fx.root.join("f")).unwrap();
        mkfifo(&fx.root.join("f"));
        let b = fx.clone();
        assert!(matches!(
            bounded(move || b.backing.open(&st).map(|_| ())),
            Err(BackingError::Changed(_))
        ));
    }

    /// Swaps `dir/a` and `dir/v` in one step (`renameat2(RENAME_EXCHANGE)`).
    fn exchange(dir: &Path) {
        let d = File::open(dir).unwrap();
        rustix::fs::renameat_with(&d, "a", &d, "v", rustix::fs::RenameFlags::EXCHANGE).unwrap();
    }

    #[test]
    fn open_reads_the_object_the_stat_described() {
        // Within the directory TTL the fill opens the file in the directory the stat
        // resolved, even when the name now leads to another directory.
        let fx = Posix::cached();
        fx.put("p/a/f", b"mine", 0o644);
        fx.put("p/v/f", b"victim", 0o644);
        let st = fx.backing.stat("p/a/f").unwrap();
        exchange(&fx.root.join("p"));
        let f = fx.backing.open(&st).unwrap();
        let mut buf = [0u8; 16];
        let n = f.read_at(&mut buf, 0).unwrap();
        assert_eq!(&buf[..n], b"mine");
        // Without the cache, the name leads to the victim's file: a different version.
        let fx = Posix::new();
        fx.put("p/a/f", b"mine", 0o644);
        fx.put("p/v/f", b"victim", 0o644);
        let st = fx.backing.stat("p/a/f").unwrap();
        exchange(&fx.root.join("p"));
        assert!(matches!(
            fx.backing.open(&st),
            Err(BackingError::Changed(_))
        ));
    }
}
