//! Recovery: what a start does before the store serves anything — make its directories
//! (replacing whatever else is there), take the directory's lock, note how the last run
//! ended, replay the journal (setting a damaged one aside and keeping the intact
//! records before the damage), drop entries whose data file is missing or the wrong
//! size, remove data files no record names, and mark every block unverified.
//!
//! Only [`super::Store::open_with_policy`] calls this, once; nothing here runs while the
//! store serves. Links are never followed and nothing outside the store's directory is
//! touched.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use parking_lot::Mutex;

use rustc_hash::FxHashMap as HashMap;

use super::evict::EvictionPolicy;
use super::index::{Entry, Index};
use super::io::BlockIo;
use super::journal::{self, Journal};
use super::key::{Key, data_path, path_key};
use super::records::{apply, records_of};
use super::space::Space;
use super::{Store, StoreConfig};
use crate::stats::{Stats, inc};

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
}

impl Store {
    /// Opens (or creates) the store in `cfg.dir`, recovering what a previous run left.
    pub(super) fn recover(
        cfg: &StoreConfig,
        stats: Arc<Stats>,
        policy: Box<dyn EvictionPolicy>,
        engine: &dyn Fn(&Path) -> io::Result<Arc<dyn BlockIo>>,
    ) -> io::Result<Self> {
        let dir = cfg.dir.join("shardcache-v1");
        ensure_dir(&dir)?;
        // Private to the daemon: the journal names every cached file.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let data_dir = dir.join("data");
        ensure_dir(&data_dir)?;
        for i in 0..=255u8 {
            ensure_dir(&data_dir.join(format!("{i:02x}")))?;
        }
        journal::sync_dir(&data_dir)?;
        journal::sync_dir(&dir)?;

        let lock_path = dir.join("LOCK");
        journal::clear_unless_file(&lock_path)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&lock_path)?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
            |_| {
                io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!(
                        "{}: another shardcached is using this cache directory",
                        dir.display()
                    ),
                )
            },
        )?;

        // CLEAN says only how the last run ended (for the log): it vouches for no block.
        let clean_marker = dir.join("CLEAN");
        let clean = std::fs::symlink_metadata(&clean_marker).is_ok_and(|m| m.is_file());
        if let Err(e) = journal::remove_any(&clean_marker) {
            tracing::warn!(path = %clean_marker.display(), error = %e, "could not remove the CLEAN marker");
        }
        journal::sync_dir(&dir)?;

        let (space, fs_free) = Space::new(&dir, cfg.capacity, cfg.min_free)?;
        let io = engine(&data_dir)?;

        let journal_path = dir.join("journal");
        let replayed = journal::replay(&journal_path);
        if let Some(damage) = &replayed.damage {
            inc(&stats.journal_recoveries);
            let kept = replayed.records.len();
            match journal::set_aside(&journal_path) {
                Ok(aside) => tracing::warn!(
                    kept,
                    "index journal damaged ({damage}): set aside as {}; kept the {kept} intact records before the damage (their blocks are checked before use), the rest is fetched again",
                    aside.display()
                ),
                Err(e) => tracing::warn!(
                    kept,
                    "index journal damaged ({damage}), and it could not be set aside ({e}): it is replaced; kept the {kept} intact records before the damage (their blocks are checked before use), the rest is fetched again"
                ),
            }
        }
        let mut files: HashMap<Key, Entry> = HashMap::default();
        for r in replayed.records {
            apply(&mut files, r);
        }
        let mut max_generation = 0;
        let mut dropped = 0;
        files.retain(|key, e| {
            max_generation = max_generation.max(e.generation);
            let ok = std::fs::symlink_metadata(data_path(&data_dir, key, e.generation))
                .is_ok_and(|m| m.is_file() && m.len() == e.version.size);
            if !ok {
                dropped += 1;
            }
            ok
        });
        remove_orphans(&data_dir, &files);

        let mut policy = policy;
        let mut index = Index::new();
        // No block is trusted for what a previous run did, however it ended: each is
        // checked against its checksum before it is first handed out (`view`, `begin_fill`,
        // `read_block_into`) or by the background scrub.
        for (key, mut e) in files {
            for b in e.blocks.iter_mut().flatten() {
                b.verified = false;
                index.unverified += 1;
                index.used += b.len as u64;
                e.bytes += b.len as u64;
            }
            let present = e.present();
            index.blocks += present;
            index.files_present += u64::from(present > 0);
            policy.insert(key, &e.root, &e.path);
            index.by_path.insert(path_key(&e.root, &e.path), key);
            index.files.insert(key, e);
        }
        index.fs.update(Some(fs_free), index.used);
        let journal = Journal::create(&journal_path, records_of(&index.files))?;
        tracing::info!(
            dir = %dir.display(),
            files = index.files.len(),
            used = index.used,
            capacity = space.capacity,
            unverified = index.unverified,
            previous_stop = if clean { "orderly" } else { "crash" },
            dropped,
            "store opened"
        );
        Ok(Self {
            dir,
            data_fd: rustix::fs::open(
                &data_dir,
                rustix::fs::OFlags::PATH
                    | rustix::fs::OFlags::DIRECTORY
                    | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )?,
            io,
            index: Mutex::new(index),
            policy: Mutex::new(policy),
            journal,
            space,
            block_size: cfg.block_size,
            next_generation: AtomicU64::new((max_generation + 1).max(now_nanos())),
            create: super::create_stripes(),
            stats,
            _lock: lock,
        })
    }
}

/// Removes everything under `data_dir` that is not the data file of an entry of `files`:
/// data files no durable record names (a crash between creating one and recording it,
/// or a journal that was lost) and anything that is not ours (directories, links,
/// special files). Only the 256 subdirectories are looked into, and links are never
/// followed: nothing outside the store is touched.
fn remove_orphans(data_dir: &Path, files: &HashMap<Key, Entry>) {
    let keep: std::collections::HashSet<String> = files
        .iter()
        .map(|(k, e)| format!("{}.{}", k.hex(), e.generation))
        .collect();
    let mut removed = 0u64;
    for i in 0..=255u8 {
        let sub = data_dir.join(format!("{i:02x}"));
        let Ok(ents) = std::fs::read_dir(&sub) else {
            continue;
        };
        for ent in ents.flatten() {
            let regular = ent.file_type().is_ok_and(|t| t.is_file());
            if regular && keep.contains(ent.file_name().to_string_lossy().as_ref()) {
                continue;
            }
            tracing::debug!(file = %ent.path().display(), regular, "removing an orphaned data file");
            match journal::remove_any(&ent.path()) {
                Ok(()) => removed += 1,
                Err(e) => {
                    tracing::warn!(path = %ent.path().display(), error = %e, "could not remove an orphaned data file")
                }
            }
        }
    }
    if removed > 0 {
        tracing::info!(removed, "orphaned data files removed");
    }
}

/// Makes `path` a real directory (not a link to one): whatever else is there is removed
/// first. For the store's own directories.
fn ensure_dir(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => {
            tracing::warn!(path = %path.display(), "not a directory in the cache: replaced by one");
            journal::remove_any(path)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::create_dir_all(path)
}
