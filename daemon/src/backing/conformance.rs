//! One conformance suite for every [`Backing`] implementation, so that the in-memory
//! store used by unit tests and benchmarks cannot drift from the POSIX one.

use super::{Backing, BackingError, BackingFileExt, EntryKind};

/// What the suite needs to set up a store's contents.
pub trait Fixture {
    fn backing(&self) -> &dyn Backing;
    /// Creates (or replaces) a file, creating parent directories (mode 0755).
    fn put(&self, path: &str, data: &[u8], mode: u32);
    /// Changes a directory's permission bits.
    fn set_dir_mode(&self, path: &str, mode: u32);
    /// Overwrites the start of an existing file without replacing it (same inode).
    fn rewrite_in_place(&self, path: &str, data: &[u8]);
    /// How many directories lie above the root (`/` included; 0 when the root is `/`).
    fn above(&self) -> usize;
    /// Changes the permission bits of the root's parent directory.
    fn set_parent_mode(&self, mode: u32);
}

/// Runs every check, each on a fresh fixture.
pub fn run_all<F: Fixture>(new: &dyn Fn() -> F) {
    stat_reports_canonical_path_version_and_owners(&new());
    read_at_returns_the_bytes(&new());
    open_refuses_a_changed_version(&new());
    missing_and_non_files_are_distinguished(&new());
    dot_dot_cannot_leave_the_root(&new());
    list_names_files_and_directories(&new());
    rewrite_in_place_changes_the_version(&new());
    dir_owners_names_every_directory_from_the_root(&new());
    directories_above_the_root_come_first(&new());
    a_file_followed_by_anything_is_not_found(&new());
    dot_dot_needs_search_on_the_directory_it_leaves(&new());
    stat_many_answers_each_path_as_stat_does(&new());
}

/// A batch of stats answers each path, in order, as [`Backing::stat`] does, errors
/// included.
fn stat_many_answers_each_path_as_stat_does(fx: &dyn Fixture) {
    let names: Vec<String> = (0..40).map(|i| format!("d{}/f{i}.bin", i % 3)).collect();
    for (i, n) in names.iter().enumerate() {
        fx.put(n, &vec![7u8; i], 0o644);
    }
    let mut paths: Vec<&str> = names.iter().map(String::as_str).collect();
    paths.insert(5, "d0/missing.bin");
    paths.insert(20, "d1");
    let got = fx.backing().stat_many(&paths);
    assert_eq!(got.len(), paths.len());
    for (p, g) in paths.iter().zip(&got) {
        match (fx.backing().stat(p), g) {
            (Ok(want), Ok(g)) => assert_eq!(g, &want, "{p}"),
            (Err(want), Err(g)) => assert_eq!(
                std::mem::discriminant(g),
                std::mem::discriminant(&want),
                "{p}: {g} against {want}"
            ),
            (want, g) => panic!("{p}: {g:?} against {want:?}"),
        }
    }
    assert!(fx.backing().stat_many(&[]).is_empty());
}

fn stat_reports_canonical_path_version_and_owners(fx: &dyn Fixture) {
    fx.put("d1/d2/f.bin", b"hello", 0o640);
    fx.set_dir_mode("d1", 0o750);
    let st = fx.backing().stat("d1/./d2//f.bin").unwrap();
    assert_eq!(st.path, "d1/d2/f.bin");
    assert_eq!(st.version.size, 5);
    assert_eq!(st.owner.mode, 0o640);
    let n = fx.above();
    assert_eq!(st.dirs.len(), n + 3, "above the root, root, d1, d2");
    assert_eq!(st.dirs[n + 1].mode, 0o750);
    assert_eq!(
        fx.backing().stat("d1/d2/f.bin").unwrap(),
        st,
        "stat is stable"
    );
}

fn read_at_returns_the_bytes(fx: &dyn Fixture) {
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    fx.put("f", &data, 0o644);
    let st = fx.backing().stat("f").unwrap();
    let f = fx.backing().open(&st).unwrap();
    let mut buf = vec![0u8; 1000];
    assert_eq!(f.read_full_at(&mut buf, 5000).unwrap(), 1000);
    assert_eq!(&buf[..], &data[5000..6000]);
    assert_eq!(
        f.read_full_at(&mut buf, 99_500).unwrap(),
        500,
        "short read at the end"
    );
    assert_eq!(&buf[..500], &data[99_500..]);
    assert_eq!(f.read_at(&mut buf, 100_000).unwrap(), 0, "EOF");
    assert_eq!(f.version().unwrap(), st.version);
}

fn open_refuses_a_changed_version(fx: &dyn Fixture) {
    fx.put("f", b"one", 0o644);
    let st = fx.backing().stat("f").unwrap();
    fx.put("f", b"two!", 0o644);
    assert!(matches!(
        fx.backing().open(&st),
        Err(BackingError::Changed(_))
    ));
}

fn missing_and_non_files_are_distinguished(fx: &dyn Fixture) {
    fx.put("dir/f", b"x", 0o644);
    assert!(matches!(
        fx.backing().stat("nope"),
        Err(BackingError::NotFound(_))
    ));
    assert!(matches!(
        fx.backing().stat("dir/nope"),
        Err(BackingError::NotFound(_))
    ));
    assert!(matches!(
        fx.backing().stat("dir/f/below"),
        Err(BackingError::NotFound(_))
    ));
    assert!(matches!(
        fx.backing().stat("dir"),
        Err(BackingError::NotAFile(_))
    ));
    assert!(matches!(
        fx.backing().stat("/dir/f"),
        Err(BackingError::Invalid { .. })
    ));
}

fn dot_dot_cannot_leave_the_root(fx: &dyn Fixture) {
    fx.put("a/f", b"x", 0o644);
    assert_eq!(fx.backing().stat("a/../a/f").unwrap().path, "a/f");
    assert!(matches!(
        fx.backing().stat("../a/f"),
        Err(BackingError::Escapes(_))
    ));
    assert!(matches!(
        fx.backing().stat("a/../../etc/passwd"),
        Err(BackingError::Escapes(_))
    ));
}

fn list_names_files_and_directories(fx: &dyn Fixture) {
    fx.put("top/b.bin", b"1", 0o644);
    fx.put("top/a.bin", b"2", 0o644);
    fx.put("top/sub/c.bin", b"3", 0o644);
    let names: Vec<(String, EntryKind)> = fx
        .backing()
        .list("top")
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.kind))
        .collect();
    assert_eq!(
        names,
        [
            ("a.bin".to_owned(), EntryKind::File),
            ("b.bin".to_owned(), EntryKind::File),
            ("sub".to_owned(), EntryKind::Dir)
        ]
    );
    assert!(
        fx.backing()
            .list("")
            .unwrap()
            .iter()
            .any(|e| e.name == "top")
    );
    assert!(matches!(
        fx.backing().list("missing"),
        Err(BackingError::NotFound(_))
    ));
}

fn rewrite_in_place_changes_the_version(fx: &dyn Fixture) {
    fx.put("f", b"aaaa", 0o644);
    let before = fx.backing().stat("f").unwrap();
    fx.rewrite_in_place("f", b"bbbb");
    let after = fx.backing().stat("f").unwrap();
    assert_eq!(after.version.size, before.version.size);
    assert_eq!(after.version.ino, before.version.ino);
    assert_ne!(
        after.version, before.version,
        "same size, same inode, new content: new version"
    );
}

fn dir_owners_names_every_directory_from_the_root(fx: &dyn Fixture) {
    fx.put("d1/d2/f.bin", b"x", 0o644);
    fx.set_dir_mode("d1", 0o750);
    let n = fx.above();
    let owners = fx.backing().dir_owners("d1/d2").unwrap();
    assert_eq!(owners.len(), n + 3, "above the root, root, d1, d2");
    assert_eq!(owners[n + 1].mode, 0o750);
    assert_eq!(
        owners,
        fx.backing().stat("d1/d2/f.bin").unwrap().dirs,
        "the same owners a stat of a file inside reports"
    );
    assert_eq!(
        fx.backing().dir_owners("").unwrap().len(),
        n + 1,
        "above the root, and the root"
    );
    for missing in ["nope", "d1/d2/f.bin", "d1/nope/d2"] {
        assert!(
            matches!(
                fx.backing().dir_owners(missing),
                Err(BackingError::NotFound(_))
            ),
            "{missing}"
        );
    }
}

fn directories_above_the_root_come_first(fx: &dyn Fixture) {
    fx.put("d/f", b"x", 0o644);
    fx.set_parent_mode(0o711);
    let n = fx.above();
    assert!(n >= 1, "`/` at least");
    let st = fx.backing().stat("d/f").unwrap();
    assert_eq!(st.dirs.len(), n + 2, "above the root, root, d");
    assert_eq!(
        st.dirs[n - 1].mode,
        0o711,
        "the root's parent, just before the root"
    );
}

fn a_file_followed_by_anything_is_not_found(fx: &dyn Fixture) {
    fx.put("dir/f", b"x", 0o644);
    for p in ["dir/f/", "dir/f/.", "dir/f/..", "dir/f/../f", "dir/f//"] {
        assert!(
            matches!(fx.backing().stat(p), Err(BackingError::NotFound(_))),
            "{p}: ENOTDIR, as the kernel says"
        );
    }
    for p in ["dir/", "dir/.", "dir/f/../.."] {
        assert!(
            matches!(
                fx.backing().stat(p),
                Err(BackingError::NotAFile(_) | BackingError::NotFound(_))
            ),
            "{p}"
        );
    }
    assert_eq!(fx.backing().stat("dir/./f").unwrap().path, "dir/f");
}

fn dot_dot_needs_search_on_the_directory_it_leaves(fx: &dyn Fixture) {
    fx.put("open/f", b"x", 0o644);
    fx.put("closed/g", b"y", 0o644);
    fx.set_dir_mode("closed", 0o730);
    let st = fx.backing().stat("closed/../open/f").unwrap();
    assert_eq!(st.path, "open/f");
    assert!(
        st.dirs.iter().any(|d| d.mode == 0o730),
        "closed/ was searched: {:?}",
        st.dirs
    );
    let plain = fx.backing().stat("open/f").unwrap();
    assert!(!plain.dirs.iter().any(|d| d.mode == 0o730));
    assert_eq!(st.dirs.last(), plain.dirs.last(), "the parent comes last");
}
