//! A backing store on a mounted POSIX file system (Lustre, GPFS, NFS, CephFS, a local
//! directory).
//!
//! Resolution walks the path one component at a time from a descriptor of the root,
//! with `O_NOFOLLOW` everywhere: symlinks are read and expanded by this code, `..` pops
//! the physical directory stack, and anything that would leave the root is refused. That
//! is what the kernel's own resolution does, but bounded to the root and recording the
//! owner and mode of each directory on the way for the access check.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::{
    Backing, BackingError, BackingFile, DirEntry, EntryKind, Owner, Stat, Version, normalize,
};

/// Most symlinks one resolution may expand (Linux's own limit).
const MAX_SYMLINKS: usize = 40;

/// A POSIX directory tree used as the backing store.
#[derive(Debug)]
pub struct PosixBacking {
    root: PathBuf,
    root_fd: OwnedFd,
    /// Directories already resolved (by their plain relative path), trusted for the
    /// metadata TTL: a file's stat then costs one `statat` and one `getxattr` instead of
    /// three calls per path component.
    dirs: Option<moka::sync::Cache<String, Arc<DirStack>>>,
}

/// The physical directory stack of a walk: (descriptor, owner, name), the root first.
type DirStack = Vec<(Arc<OwnedFd>, Owner, String)>;

impl PosixBacking {
    /// Opens the tree at `root` (which must be an existing directory; it is canonicalized).
    pub fn new(root: &Path) -> io::Result<Self> {
        Self::with_dir_ttl(root, Duration::ZERO)
    }

    /// Like [`PosixBacking::new`], trusting resolved directories (their owners and modes)
    /// for `ttl`; `0` resolves every component on every stat.
    pub fn with_dir_ttl(root: &Path, ttl: Duration) -> io::Result<Self> {
        let root = std::fs::canonicalize(root)?;
        let root_fd = rustix::fs::open(
            &root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let dirs = (!ttl.is_zero()).then(|| {
            moka::sync::Cache::builder()
                .max_capacity(65536)
                .time_to_live(ttl)
                .build()
        });
        Ok(Self {
            root,
            root_fd,
            dirs,
        })
    }

    fn remember(&self, key: &str, stack: &DirStack) {
        if let Some(d) = &self.dirs {
            d.insert(key.to_owned(), Arc::new(stack.clone()));
        }
    }

    fn root_stack(&self, path: &str) -> Result<DirStack, BackingError> {
        if let Some(s) = self.dirs.as_ref().and_then(|d| d.get("")) {
            return Ok((*s).clone());
        }
        let root_st = rustix::fs::fstat(&self.root_fd).map_err(|e| Self::io_err(path, e))?;
        let root_acl = Self::has_acl(&self.root_fd, None).map_err(|e| Self::io_err(path, e))?;
        let root_fd = self
            .root_fd
            .try_clone()
            .map_err(|e| Self::io_err(path, e))?;
        let stack = vec![(
            Arc::new(root_fd),
            Self::owner(&root_st, root_acl),
            String::new(),
        )];
        self.remember("", &stack);
        Ok(stack)
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        &self.root
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

    fn has_acl(dir: &OwnedFd, name: Option<&str>) -> io::Result<bool> {
        use std::os::fd::AsRawFd;
        let mut buf = [0u8; 0];
        let r = match name {
            // The root itself: follow the /proc magic link to the directory.
            None => rustix::fs::getxattr(
                format!("/proc/self/fd/{}", dir.as_raw_fd()).as_str(),
                "system.posix_acl_access",
                &mut buf[..],
            ),
            // A child: do not follow (the walk already knows it is no symlink).
            Some(n) => rustix::fs::lgetxattr(
                format!("/proc/self/fd/{}/{}", dir.as_raw_fd(), n).as_str(),
                "system.posix_acl_access",
                &mut buf[..],
            ),
        };
        match r {
            Ok(_) | Err(Errno::RANGE) => Ok(true),
            Err(Errno::NODATA) | Err(Errno::NOTSUP) => Ok(false),
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
        let cached = match (plain, path.rfind('/'), &self.dirs) {
            (true, Some(i), Some(d)) => d.get(&path[..i]).map(|s| (s, &path[i + 1..])),
            _ => None,
        };
        let (mut stack, mut pending): (DirStack, Vec<String>) = match cached {
            Some((s, name)) => ((*s).clone(), vec![name.to_owned()]),
            None => (
                self.root_stack(path)?,
                path.split('/').rev().map(str::to_owned).collect(),
            ),
        };
        // Directories reached without symlinks or `..` are remembered under their path.
        let mut clean = true;
        let mut links = 0;
        while let Some(comp) = pending.pop() {
            match comp.as_str() {
                "" | "." => continue,
                ".." => {
                    if stack.len() == 1 {
                        return Err(BackingError::Escapes(path.to_owned()));
                    }
                    stack.pop();
                    clean = false;
                    continue;
                }
                _ => {}
            }
            let more = pending.iter().any(|c| !c.is_empty() && c != ".");
            let (dir, _, _) = stack.last().expect("stack holds the root");
            let st = rustix::fs::statat(dir, comp.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| Self::io_err(path, e))?;
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
                    let target = rustix::fs::readlinkat(dir, comp.as_str(), Vec::new())
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
                        stack.truncate(1);
                        inside.to_str().unwrap_or_default().to_owned()
                    } else {
                        target.to_owned()
                    };
                    pending.extend(rest.split('/').rev().map(str::to_owned));
                }
                FileType::Directory => {
                    if !more {
                        return Err(BackingError::NotAFile(path.to_owned()));
                    }
                    let acl = Self::has_acl(dir, Some(&comp)).map_err(|e| Self::io_err(path, e))?;
                    let fd = self
                        .open_dir_at(dir, &comp)
                        .map_err(|e| Self::io_err(path, e))?;
                    stack.push((Arc::new(fd), Self::owner(&st, acl), comp));
                    if clean {
                        let key: Vec<&str> =
                            stack[1..].iter().map(|(_, _, n)| n.as_str()).collect();
                        self.remember(&key.join("/"), &stack);
                    }
                }
                FileType::RegularFile => {
                    if more {
                        return Err(BackingError::NotFound(path.to_owned()));
                    }
                    let acl = Self::has_acl(dir, Some(&comp)).map_err(|e| Self::io_err(path, e))?;
                    let mut canon: Vec<&str> =
                        stack[1..].iter().map(|(_, _, n)| n.as_str()).collect();
                    canon.push(&comp);
                    return Ok(Stat {
                        path: canon.join("/"),
                        dirs: stack.iter().map(|(_, o, _)| *o).collect(),
                        owner: Self::owner(&st, acl),
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
        let mut dir = self.root_fd.try_clone().map_err(|e| Self::io_err(p, e))?;
        for d in dirs {
            dir = self.open_dir_at(&dir, d).map_err(|e| Self::io_err(p, e))?;
        }
        let fd = rustix::fs::openat(
            &dir,
            *name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Self::io_err(p, e))?;
        let file = PosixFile {
            file: File::from(fd),
        };
        let v = file.version().map_err(|e| Self::io_err(p, e))?;
        if v != stat.version {
            return Err(BackingError::Changed(p.to_owned()));
        }
        Ok(Box::new(file))
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
        if let Some(s) = self.dirs.as_ref().and_then(|d| d.get(&comps.join("/"))) {
            return Ok(s.iter().map(|(_, o, _)| *o).collect());
        }
        let mut stack = self.root_stack(dir)?;
        for (i, c) in comps.iter().enumerate() {
            let (parent, _, _) = stack.last().expect("stack holds the root");
            // The owner of the directory actually opened (its descriptor's), not of
            // whatever the name points to a moment later.
            let fd = self
                .open_dir_at(parent, c)
                .map_err(|e| Self::io_err(dir, e))?;
            let st = rustix::fs::fstat(&fd).map_err(|e| Self::io_err(dir, e))?;
            let acl = Self::has_acl(parent, Some(c)).map_err(|e| Self::io_err(dir, e))?;
            stack.push((Arc::new(fd), Self::owner(&st, acl), (*c).to_owned()));
            self.remember(&comps[..=i].join("/"), &stack);
        }
        Ok(stack.iter().map(|(_, o, _)| *o).collect())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::conformance::{self, Fixture};
    use std::os::unix::fs::PermissionsExt;

    struct Posix {
        dir: tempfile::TempDir,
        backing: PosixBacking,
    }

    impl Posix {
        fn new() -> Self {
            Self::with_ttl(Duration::ZERO)
        }

        fn with_ttl(ttl: Duration) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let backing = PosixBacking::with_dir_ttl(dir.path(), ttl).unwrap();
            Self { dir, backing }
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
            let p = self.dir.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, data).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        fn set_dir_mode(&self, path: &str, mode: u32) {
            let p = self.dir.path().join(path);
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        fn rewrite_in_place(&self, path: &str, data: &[u8]) {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(self.dir.path().join(path))
                .unwrap();
            f.write_all(data).unwrap();
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
        assert_eq!(s2.dirs[1].mode, 0o711);
        assert_eq!(s2.version.size, 2);
        assert!(matches!(
            fx.backing.stat("a/b/none"),
            Err(BackingError::NotFound(_))
        ));
        // A symlinked directory is resolved, never cached under the link's name.
        std::os::unix::fs::symlink("a/b", fx.dir.path().join("link")).unwrap();
        assert_eq!(fx.backing.stat("link/f1").unwrap().path, "a/b/f1");
        assert_eq!(fx.backing.stat("link/f2").unwrap().path, "a/b/f2");
    }

    fn symlinks(fx: Posix) {
        fx.put("real/a.bin", b"abc", 0o644);
        let root = fx.dir.path();
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
}
