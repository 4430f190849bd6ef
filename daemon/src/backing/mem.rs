//! An in-memory backing store for tests and benchmarks: files are byte vectors, every
//! change bumps a version counter, directories carry owners and modes, and so do the
//! directories above the root (by default only `/`, root-owned 0755). No symlinks.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use parking_lot::RwLock;

use super::{
    Backing, BackingError, BackingFile, DirEntry, EntryKind, Owner, Stat, Version, normalize,
};

#[derive(Debug, Clone)]
enum Node {
    Dir(Owner),
    File {
        owner: Owner,
        data: Arc<Vec<u8>>,
        version: Version,
    },
}

/// An in-memory tree. Cheap to clone handles to via `Arc`.
#[derive(Debug)]
pub struct MemBacking {
    nodes: RwLock<BTreeMap<String, Node>>,
    /// Owners of the directories from `/` down to the root's parent.
    above: RwLock<Vec<Owner>>,
    clock: AtomicI64,
    next_ino: AtomicU64,
}

impl Default for MemBacking {
    fn default() -> Self {
        Self::new()
    }
}

const DEFAULT_DIR: Owner = Owner {
    uid: 0,
    gid: 0,
    mode: 0o755,
    acl: false,
};

impl MemBacking {
    /// An empty tree whose root is owned by root with mode 0755.
    pub fn new() -> Self {
        let mut nodes = BTreeMap::new();
        nodes.insert(String::new(), Node::Dir(DEFAULT_DIR));
        Self {
            nodes: RwLock::new(nodes),
            above: RwLock::new(vec![DEFAULT_DIR]),
            clock: AtomicI64::new(1),
            next_ino: AtomicU64::new(1),
        }
    }

    fn tick(&self) -> i64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// Creates or replaces a file (a new inode, like write-to-temp-and-rename), creating
    /// missing parent directories with mode 0755.
    pub fn put(&self, path: &str, data: Vec<u8>, owner: Owner) {
        let comps = normalize(path).expect("valid path");
        let mut nodes = self.nodes.write();
        for i in 1..comps.len() {
            nodes
                .entry(comps[..i].join("/"))
                .or_insert(Node::Dir(DEFAULT_DIR));
        }
        let t = self.tick();
        let version = Version {
            size: data.len() as u64,
            mtime_ns: t,
            ctime_ns: t,
            ino: self.next_ino.fetch_add(1, Ordering::Relaxed),
            dev: 1,
        };
        nodes.insert(
            comps.join("/"),
            Node::File {
                owner,
                data: Arc::new(data),
                version,
            },
        );
    }

    /// Overwrites a file's bytes keeping its inode (an in-place rewrite).
    pub fn rewrite_in_place(&self, path: &str, data: Vec<u8>) {
        let t = self.tick();
        let mut nodes = self.nodes.write();
        if let Some(Node::File {
            data: d, version, ..
        }) = nodes.get_mut(path)
        {
            *d = Arc::new(data);
            version.size = d.len() as u64;
            version.mtime_ns = t;
            version.ctime_ns = t;
        }
    }

    /// Sets the owner and mode of a directory, creating it if needed.
    pub fn set_dir(&self, path: &str, owner: Owner) {
        let mut nodes = self.nodes.write();
        nodes.insert(path.to_owned(), Node::Dir(owner));
    }

    /// Sets the owners of the directories above the root, `/` first (the root's parent
    /// last).
    pub fn set_above(&self, owners: Vec<Owner>) {
        *self.above.write() = owners;
    }

    /// Removes a file.
    pub fn remove(&self, path: &str) {
        self.nodes.write().remove(path);
    }
}

impl Backing for MemBacking {
    fn stat(&self, path: &str) -> Result<Stat, BackingError> {
        // The shape (relative, no NUL, not above the root); then the walk, component by
        // component as the POSIX store does it.
        normalize(path)?;
        let nodes = self.nodes.read();
        let root = match nodes.get("") {
            Some(Node::Dir(o)) => *o,
            _ => DEFAULT_DIR,
        };
        // (path, owner) of the directories being walked, the root first.
        let mut stack: Vec<(String, Owner)> = vec![(String::new(), root)];
        // Directories walked and left again by `..` (their search was needed too).
        let mut left = Vec::new();
        let mut comps = path.split('/').peekable();
        while let Some(c) = comps.next() {
            match c {
                "" | "." => continue,
                ".." => {
                    if stack.len() == 1 {
                        return Err(BackingError::Escapes(path.to_owned()));
                    }
                    left.extend(stack.pop().map(|(_, o)| o));
                    continue;
                }
                _ => {}
            }
            let parent = &stack.last().expect("the stack holds the root").0;
            let p = if parent.is_empty() {
                c.to_owned()
            } else {
                format!("{parent}/{c}")
            };
            let more = comps.clone().any(|c| !c.is_empty() && c != ".");
            match nodes.get(&p) {
                Some(Node::Dir(o)) if more => stack.push((p, *o)),
                Some(Node::Dir(_)) => return Err(BackingError::NotAFile(path.to_owned())),
                // Anything after a file, even a bare `/` or `/.`, is ENOTDIR.
                Some(Node::File { owner, version, .. }) if comps.peek().is_none() => {
                    let mut dirs = self.above.read().clone();
                    dirs.extend(left);
                    dirs.extend(stack.iter().map(|(_, o)| *o));
                    return Ok(Stat {
                        path: p,
                        dirs,
                        owner: *owner,
                        version: *version,
                    });
                }
                Some(Node::File { .. }) | None => {
                    return Err(BackingError::NotFound(path.to_owned()));
                }
            }
        }
        Err(BackingError::NotAFile(path.to_owned()))
    }

    fn open(&self, stat: &Stat) -> Result<Box<dyn BackingFile>, BackingError> {
        let nodes = self.nodes.read();
        match nodes.get(&stat.path) {
            Some(Node::File { data, version, .. }) if *version == stat.version => {
                Ok(Box::new(MemFile {
                    data: data.clone(),
                    version: *version,
                }))
            }
            Some(Node::File { .. }) => Err(BackingError::Changed(stat.path.clone())),
            _ => Err(BackingError::NotFound(stat.path.clone())),
        }
    }

    fn list(&self, dir: &str) -> Result<Vec<DirEntry>, BackingError> {
        let prefix = if dir.is_empty() {
            String::new()
        } else {
            normalize(dir)?.join("/")
        };
        let nodes = self.nodes.read();
        if !matches!(nodes.get(&prefix), Some(Node::Dir(_))) {
            return Err(BackingError::NotFound(dir.to_owned()));
        }
        let start = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        Ok(nodes
            .range(start.clone()..)
            .take_while(|(k, _)| k.starts_with(&start))
            .filter(|(k, _)| !k.is_empty() && !k[start.len()..].contains('/'))
            .map(|(k, n)| DirEntry {
                name: k[start.len()..].to_owned(),
                kind: match n {
                    Node::Dir(_) => EntryKind::Dir,
                    Node::File { .. } => EntryKind::File,
                },
            })
            .collect())
    }

    fn dir_owners(&self, dir: &str) -> Result<Vec<Owner>, BackingError> {
        let comps = if dir.is_empty() {
            Vec::new()
        } else {
            normalize(dir)?
        };
        let nodes = self.nodes.read();
        let mut owners = self.above.read().clone();
        for i in 0..=comps.len() {
            match (i, nodes.get(&comps[..i].join("/"))) {
                (_, Some(Node::Dir(o))) => owners.push(*o),
                (0, None) => owners.push(DEFAULT_DIR),
                _ => return Err(BackingError::NotFound(dir.to_owned())),
            }
        }
        Ok(owners)
    }
}

/// A snapshot of one file version: later changes to the tree do not alter its bytes, so
/// what it reads always matches the version it reports.
#[derive(Debug)]
struct MemFile {
    data: Arc<Vec<u8>>,
    version: Version,
}

impl BackingFile for MemFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let len = self.data.len() as u64;
        if offset >= len {
            return Ok(0);
        }
        let n = buf.len().min((len - offset) as usize);
        buf[..n].copy_from_slice(&self.data[offset as usize..offset as usize + n]);
        Ok(n)
    }

    fn version(&self) -> io::Result<Version> {
        Ok(self.version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::conformance::{self, Fixture};

    impl Fixture for MemBacking {
        fn backing(&self) -> &dyn Backing {
            self
        }
        fn put(&self, path: &str, data: &[u8], mode: u32) {
            MemBacking::put(
                self,
                path,
                data.to_vec(),
                Owner {
                    mode,
                    ..DEFAULT_DIR
                },
            );
        }
        fn set_dir_mode(&self, path: &str, mode: u32) {
            self.set_dir(
                path,
                Owner {
                    mode,
                    ..DEFAULT_DIR
                },
            );
        }
        fn rewrite_in_place(&self, path: &str, data: &[u8]) {
            MemBacking::rewrite_in_place(self, path, data.to_vec());
        }
        fn above(&self) -> usize {
            self.above.read().len()
        }
        fn set_parent_mode(&self, mode: u32) {
            let mut above = self.above.write();
            if let Some(parent) = above.last_mut() {
                parent.mode = mode;
            }
        }
    }

    #[test]
    fn conformance() {
        conformance::run_all(&MemBacking::new);
    }
}
