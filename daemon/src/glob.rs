//! Expanding a manifest's `files.glob` over a backing store.
//!
//! `*` and `?` match within one path component, `**` across any number of them, `[...]`
//! a character class (globset's syntax with `literal_separator`). The walk starts at the
//! pattern's literal leading directories, descends only as deep as the pattern can match
//! (unless it has `**`), lists only directories (never follows symbolic links), and
//! stops at a bound on matches and on entries looked at, so a pattern cannot make the
//! daemon walk a whole shared file system.

use globset::GlobBuilder;

use crate::backing::{Backing, EntryKind};

/// Most directory entries looked at for one pattern.
pub const MAX_SCANNED: usize = 20_000_000;

/// Regular files under `base` (a directory relative to the backing root, `""` for the
/// root) whose path relative to `base` matches `pattern`, sorted by path; at most `max`.
/// The error says what went wrong in words a manifest author can act on.
pub fn expand(
    backing: &dyn Backing,
    base: &str,
    pattern: &str,
    max: usize,
) -> Result<Vec<String>, String> {
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
    let mut scanned = 0usize;
    // (directory relative to `base`, depth in components)
    let mut stack = vec![(start, lead)];
    while let Some((dir, depth)) = stack.pop() {
        let entries = match backing.list(&join(base, &dir)) {
            Ok(e) => e,
            // The literal part names nothing: no match (an empty result is reported by
            // the caller); a subdirectory that vanished mid-walk likewise.
            Err(crate::backing::BackingError::NotFound(_)) => continue,
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
    Ok(out)
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
        let x = |base: &str, p: &str| expand(&m, base, p, 100).unwrap();
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
        let e = expand(&m, "", "d/*", 2).unwrap_err();
        assert!(e.contains("more than 2 files"), "{e}");
        let e = expand(&m, "", "d/[", 10).unwrap_err();
        assert!(e.starts_with("files.glob:"), "{e}");
    }
}
