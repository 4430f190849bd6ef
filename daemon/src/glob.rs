//! Expanding a manifest's `files.glob` over a backing store.
//!
//! `*` and `?` match within one path component, `**` across any number of them, `[...]`
//! a character class (globset's syntax with `literal_separator`). The walk starts at the
//! pattern's literal leading directories, descends only as deep as the pattern can match
//! (unless it has `**`), lists only directories (never follows symbolic links), and
//! stops at a bound on matches and on entries looked at, so a pattern cannot make the
//! daemon walk a whole shared file system. It lists only the directories its caller
//! lets it (the registrant's rights: the daemon's own are broader), and counts the rest.

use globset::GlobBuilder;

use crate::backing::{Backing, BackingError, EntryKind};

/// Most directory entries looked at for one pattern.
pub const MAX_SCANNED: usize = 20_000_000;

/// What a pattern matched.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Expansion {
    /// The matching files, relative to the base, sorted.
    pub files: Vec<String>,
    /// Directories the walk would have listed but was not let into.
    pub skipped_dirs: usize,
}

/// Regular files under `base` (a directory relative to the backing root, `""` for the
/// root) whose path relative to `base` matches `pattern`, sorted by path; at most `max`.
/// Before listing a directory the walk asks `may_list` (with the directory's path
/// relative to the backing root) and skips, and counts, those it refuses. The error
/// says what went wrong in words a manifest author can act on.
pub fn expand(
    backing: &dyn Backing,
    base: &str,
    pattern: &str,
    max: usize,
    may_list: &mut dyn FnMut(&str) -> Result<bool, BackingError>,
) -> Result<Expansion, String> {
    let glob = GlobBuilder::new(pattern)
        .literal_separator(true)
        .backslash_escape(true)
        .build()
        .map_err(|e| format!("files.glob: {e}"))?
        .compile_matcher();
    let parts: Vec<&str> = pattern.split('/').collect();
    let is_literal = |p: &str| !p.contains(['*', '?', '[', '{', '\\']);
    // Literal leading directories (not the last component: that one names files).
    let lead = parts[..parts.len() - 1]
        .iter()
        .take_while(|p| is_literal(p))
        .count();
    let deep = parts.contains(&"**") || parts.iter().any(|p| p.contains("**"));
    let join = |a: &str, b: &str| {
        if a.is_empty() {
            b.to_owned()
        } else {
            format!("{a}/{b}")
        }
    };
    let start = parts[..lead].join("/");
    let mut out = Vec::new();
    let mut skipped_dirs = 0;
    let mut scanned = 0usize;
    // (directory relative to `base`, depth in components)
    let mut stack = vec![(start, lead)];
    while let Some((dir, depth)) = stack.pop() {
        let full = join(base, &dir);
        let listed = match may_list(&full) {
            Ok(true) => backing.list(&full),
            Ok(false) => {
                skipped_dirs += 1;
                continue;
            }
            Err(e) => Err(e),
        };
        let entries = match listed {
            Ok(e) => e,
            // The literal part names nothing: no match (an empty result is reported by
            // the caller); a subdirectory that vanished mid-walk likewise.
            Err(BackingError::NotFound(_)) => continue,
            Err(e) => return Err(format!("files.glob: listing {dir:?}: {e}")),
        };
        for e in entries {
            scanned += 1;
            if scanned > MAX_SCANNED {
                return Err(format!(
                    "files.glob: looked at more than {MAX_SCANNED} directory entries; narrow the pattern or list the files"
                ));
            }
            let rel = join(&dir, &e.name);
            match e.kind {
                EntryKind::File if glob.is_match(&rel) => {
                    if out.len() >= max {
                        return Err(format!(
                            "files.glob: matches more than {max} files; split the dataset"
                        ));
                    }
                    out.push(rel);
                }
                EntryKind::Dir if deep || depth + 1 < parts.len() => {
                    stack.push((rel, depth + 1));
                }
                _ => {}
            }
        }
    }
    out.sort();
    Ok(Expansion {
        files: out,
        skipped_dirs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::Owner;
    use crate::backing::mem::MemBacking;

    fn store(paths: &[&str]) -> MemBacking {
        let m = MemBacking::new();
        for p in paths {
            m.put(
                p,
                b"x".to_vec(),
                Owner {
                    mode: 0o644,
                    ..Owner::default()
                },
            );
        }
        m
    }

    #[test]
    fn patterns_match_like_a_shell_with_globstar() {
        let m = store(&[
            "ds/train/a.tar",
            "ds/train/b.tar",
            "ds/train/c.idx",
            "ds/train/sub/d.tar",
            "ds/val/e.tar",
            "other/f.tar",
        ]);
        let x = |base: &str, p: &str| expand(&m, base, p, 100, &mut |_| Ok(true)).unwrap().files;
        assert_eq!(x("ds", "train/*.tar"), ["train/a.tar", "train/b.tar"]);
        assert_eq!(
            x("ds", "**/*.tar"),
            ["train/a.tar", "train/b.tar", "train/sub/d.tar", "val/e.tar"]
        );
        assert_eq!(
            x("ds", "*/?.tar"),
            ["train/a.tar", "train/b.tar", "val/e.tar"]
        );
        assert_eq!(
            x("", "ds/train/[ab].tar"),
            ["ds/train/a.tar", "ds/train/b.tar"]
        );
        assert!(x("ds", "nothing/*").is_empty());
    }

    #[test]
    fn bounds_and_bad_patterns_are_reported() {
        let m = store(&["d/a", "d/b", "d/c"]);
        let e = expand(&m, "", "d/*", 2, &mut |_| Ok(true)).unwrap_err();
        assert!(e.contains("more than 2 files"), "{e}");
        let e = expand(&m, "", "d/[", 10, &mut |_| Ok(true)).unwrap_err();
        assert!(e.starts_with("files.glob:"), "{e}");
    }

    #[test]
    fn directories_it_is_not_let_into_are_skipped_and_counted() {
        let m = store(&[
            "ds/a.tar",
            "ds/closed/b.tar",
            "ds/closed/deeper/c.tar",
            "ds/open/d.tar",
        ]);
        let mut asked = Vec::new();
        let got = expand(&m, "ds", "**/*.tar", 100, &mut |d| {
            asked.push(d.to_owned());
            Ok(d != "ds/closed")
        })
        .unwrap();
        assert_eq!(got.files, ["a.tar", "open/d.tar"]);
        assert_eq!(got.skipped_dirs, 1, "closed/ (and so nothing below it)");
        assert!(
            !asked.iter().any(|d| d.starts_with("ds/closed/")),
            "nothing below a refused directory is even asked about: {asked:?}"
        );
        let none = expand(&m, "ds", "*.tar", 100, &mut |_| Ok(false)).unwrap();
        assert_eq!(
            none,
            Expansion {
                files: Vec::new(),
                skipped_dirs: 1
            },
            "the base itself refused"
        );
        let e = expand(&m, "ds", "*.tar", 100, &mut |d| {
            Err(BackingError::Io {
                path: d.to_owned(),
                source: std::io::Error::other("disk on fire"),
            })
        })
        .unwrap_err();
        assert!(e.contains("disk on fire"), "{e}");
    }
}
