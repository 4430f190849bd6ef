//! Operator requests: what the cache holds (`shardcache ls`) and dropping cached copies
//! (`shardcache evict`).
//!
//! A listing reads the store's index and the registered jobs. It goes to the backing
//! store only for what its argument names: one file's metadata, or one directory's
//! entries (never recursively) and the metadata of the page of them it returns, through
//! the metadata cache. Anyone may list, but a caller other than root and the daemon's
//! own user sees only the files it may read, judged as an open judges them
//! ([`crate::access::check`]), and no subdirectory or link names.
//!
//! Eviction is for operators only (root and the daemon's user). It drops entries from
//! the store the way eviction for room does ([`Store::evict_matching`]): a reader that
//! holds a descriptor keeps reading the same bytes, and nothing on the backing store is
//! touched. Files of a registered job are prefetched again if its plan still needs
//! them; unregister the job first to keep them out.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use shardcache_proto::local::v1 as pb;
use shardcache_proto::local::v1::response;

use super::{Ctx, MAX_PATH};
use crate::access::{self, Creds, Decision, is_operator};
use crate::backing::{BackingError, EntryKind, Stat};
use crate::planner::FileRef;
use crate::store::Store;

/// File entries in a listing when the request names no limit.
pub const DEFAULT_LIMIT: usize = 100;
/// Most file entries in one listing reply.
pub const MAX_LIMIT: usize = 10_000;
/// Most bytes of file entries in one listing reply: half the client's 16 MiB frame
/// limit (10 000 entries of 4 KiB paths would be 40 MB). A page ends early when the next
/// entry would pass it; the caller pages on with `offset` += files + hidden.
pub const PAGE_BYTES: usize = shardcache_proto::wire::MAX_FRAME / 2;

/// The file entries of one listing reply, kept under [`PAGE_BYTES`].
#[derive(Default)]
struct Page {
    files: Vec<pb::FileEntry>,
    hidden: u64,
    bytes: usize,
}

impl Page {
    /// Adds `e`; false (and `e` left out) when it would pass [`PAGE_BYTES`]: the page is
    /// full. The first entry always fits.
    fn push(&mut self, e: pb::FileEntry) -> bool {
        let n = prost::Message::encoded_len(&e) + 8;
        if self.bytes + n > PAGE_BYTES && !self.files.is_empty() {
            return false;
        }
        self.bytes += n;
        self.files.push(e);
        true
    }

    fn reply(self, total: usize) -> pb::ListReply {
        pb::ListReply {
            files: self.files,
            total: total as u64,
            hidden: self.hidden,
            ..Default::default()
        }
    }
}

/// A refusal. Handlers return it as their error (it is small; a whole reply is not) and
/// it becomes the reply at the top.
fn error(code: pb::ErrorCode, message: String) -> pb::ErrorReply {
    pb::ErrorReply {
        message,
        code: code as i32,
    }
}

fn invalid(message: String) -> pb::ErrorReply {
    error(pb::ErrorCode::Invalid, message)
}

fn unknown_job(ctx: &Ctx, job: &str) -> pb::ErrorReply {
    let ids = ctx.jobs.ids();
    let known = if ids.is_empty() {
        "no job is registered".to_owned()
    } else {
        format!("registered: {}", ids.join(", "))
    };
    error(
        pb::ErrorCode::NotFound,
        format!("no job `{job}` is registered on this node ({known})"),
    )
}

/// The root containing `abs` (the root itself included, unlike [`crate::meta::Roots::resolve`])
/// and the path inside it.
fn locate<'a>(ctx: &Ctx, abs: &'a str) -> Result<(usize, &'a str), pb::ErrorReply> {
    if abs.len() > MAX_PATH {
        return Err(invalid(format!("path longer than {MAX_PATH} bytes")));
    }
    let roots = ctx.meta.roots();
    let trimmed = abs.trim_end_matches('/');
    if let Some(i) = roots
        .all()
        .iter()
        .position(|r| r.name.trim_end_matches('/') == trimmed)
    {
        return Ok((i, ""));
    }
    roots.resolve(trimmed).map_err(|_| {
        let names: Vec<&str> = roots.all().iter().map(|r| r.name.as_str()).collect();
        invalid(format!(
            "{abs}: not under a backing root of this daemon (roots: {}); give an absolute path",
            names.join(", ")
        ))
    })
}

/// `root` and `rel` joined into an absolute path.
fn absolute(root: &str, rel: &str) -> String {
    let root = root.trim_end_matches('/');
    if rel.is_empty() {
        root.to_owned()
    } else {
        format!("{root}/{rel}")
    }
}

/// The metadata of `rel` when `creds` may read it (as an open would decide; an ACL, which
/// the daemon does not evaluate, hides the file too).
fn readable(ctx: &Ctx, creds: &Creds, root: usize, rel: &str) -> Option<Arc<Stat>> {
    let stat = ctx.meta.stat_for(root, rel, creds.uid).ok()?;
    (access::check(&stat, creds) == Decision::Allow).then_some(stat)
}

/// Serves a List request.
pub fn list(ctx: &Ctx, creds: &Creds, req: &pb::ListRequest) -> response::Kind {
    let limit = match req.limit as usize {
        0 => DEFAULT_LIMIT,
        n => n.min(MAX_LIMIT),
    };
    let offset = usize::try_from(req.offset).unwrap_or(usize::MAX);
    let reply = match (req.job.is_empty(), req.path.is_empty()) {
        (true, true) => Ok(datasets(ctx)),
        (false, true) => list_job(ctx, creds, &req.job, offset, limit),
        (true, false) => list_path(ctx, creds, &req.path, offset, limit),
        (false, false) => Err(invalid("list: name a job or a path, not both".into())),
    };
    match reply {
        Ok(r) => response::Kind::List(r),
        Err(e) => response::Kind::Error(e),
    }
}

/// Sums of sizes and residency over some files.
#[derive(Default)]
struct Tally {
    files: u64,
    bytes: u64,
    sizeless: u64,
    resident_bytes: u64,
    resident_files: u64,
}

impl Tally {
    fn add(&mut self, size: Option<u64>, resident: Option<crate::store::Residency>) {
        self.files += 1;
        // The cached version's size is the one the resident bytes belong to.
        match resident.map(|r| r.size).or(size) {
            Some(s) => self.bytes += s,
            None => self.sizeless += 1,
        }
        if let Some(r) = resident {
            self.resident_bytes += r.resident_bytes;
            if r.resident_bytes == r.size {
                self.resident_files += 1;
            }
        }
    }

    fn entry(self, job: String, root: String) -> pb::DatasetEntry {
        pb::DatasetEntry {
            job,
            root,
            files: self.files,
            bytes: self.bytes,
            unsized_files: self.sizeless,
            resident_bytes: self.resident_bytes,
            resident_files: self.resident_files,
        }
    }
}

/// Every registered job, then per backing root the cached files no job plans. Sizes come
/// from the manifests, the store and earlier stats: this never goes to the backing store.
fn datasets(ctx: &Ctx) -> pb::ListReply {
    let roots = ctx.meta.roots();
    let mut out = Vec::new();
    for id in ctx.jobs.ids() {
        let Some(files) = ctx.jobs.files_of(&id) else {
            continue; // unregistered meanwhile
        };
        let pairs: Vec<(&str, &str)> = files
            .iter()
            .map(|f| (roots.get(f.root).name.as_str(), &*f.path))
            .collect();
        let resident = ctx.store.residency_many(&pairs);
        let mut t = Tally::default();
        for (f, r) in files.iter().zip(resident) {
            t.add(ctx.jobs.known_size(f), r);
        }
        let root = files
            .first()
            .map(|f| roots.get(f.root).name.clone())
            .unwrap_or_default();
        out.push(t.entry(id, root));
    }
    let entries = ctx.store.entries();
    let refs: Vec<Option<FileRef>> = entries
        .iter()
        .map(|e| {
            let root = roots.all().iter().position(|r| r.name == e.root)?;
            Some(FileRef {
                root,
                path: e.path.as_str().into(),
            })
        })
        .collect();
    let known: Vec<FileRef> = refs.iter().flatten().cloned().collect();
    let mut planned = ctx.jobs.planned(&known).into_iter();
    let mut per_root: Vec<Tally> = roots.all().iter().map(|_| Tally::default()).collect();
    for (e, f) in entries.iter().zip(&refs) {
        // Entries of roots no longer configured are nobody's dataset; skip them.
        let Some(f) = f else { continue };
        if planned.next().unwrap_or(false) {
            continue;
        }
        per_root[f.root].add(Some(e.residency.size), Some(e.residency));
    }
    for (r, t) in roots.all().iter().zip(per_root) {
        out.push(t.entry(String::new(), r.name.clone()));
    }
    pb::ListReply {
        total: out.len() as u64,
        datasets: out,
        ..Default::default()
    }
}

fn file_entry(store: &Store, root: &str, stat: &Stat) -> pb::FileEntry {
    pb::FileEntry {
        path: absolute(root, &stat.path),
        size: stat.version.size,
        size_known: true,
        resident_bytes: store
            .residency(root, &stat.path)
            .filter(|r| r.size == stat.version.size)
            .map_or(0, |r| r.resident_bytes),
        is_dir: false,
    }
}

fn list_job(
    ctx: &Ctx,
    creds: &Creds,
    job: &str,
    offset: usize,
    limit: usize,
) -> Result<pb::ListReply, pb::ErrorReply> {
    let files = ctx
        .jobs
        .files_of(job)
        .ok_or_else(|| unknown_job(ctx, job))?;
    let roots = ctx.meta.roots();
    let operator = is_operator(creds);
    let mut page = Page::default();
    for f in files.iter().skip(offset).take(limit) {
        let root = &roots.get(f.root).name;
        if !operator {
            match readable(ctx, creds, f.root, &f.path) {
                Some(stat) => {
                    if !page.push(file_entry(&ctx.store, root, &stat)) {
                        break;
                    }
                }
                None => page.hidden += 1,
            }
            continue;
        }
        let resident = ctx.store.residency(root, &f.path);
        // Sizes the daemon knows first; a stat (through the metadata cache, and then
        // remembered for the datasets view) only for the rest of this page.
        let size = resident.map(|r| r.size).or_else(|| ctx.jobs.size_of(f));
        let full = !page.push(pb::FileEntry {
            path: absolute(root, &f.path),
            size: size.unwrap_or(0),
            size_known: size.is_some(),
            resident_bytes: resident.map_or(0, |r| r.resident_bytes),
            is_dir: false,
        });
        if full {
            break;
        }
    }
    Ok(page.reply(files.len()))
}

fn list_path(
    ctx: &Ctx,
    creds: &Creds,
    path: &str,
    offset: usize,
    limit: usize,
) -> Result<pb::ListReply, pb::ErrorReply> {
    let (root, rel) = locate(ctx, path)?;
    let root_name = ctx.meta.roots().get(root).name.clone();
    let operator = is_operator(creds);
    let not_found = || {
        error(
            pb::ErrorCode::NotFound,
            format!("{path}: not found on the backing store"),
        )
    };
    match ctx.meta.stat_for(root, rel, creds.uid) {
        Ok(stat) => {
            if !operator && access::check(&stat, creds) != Decision::Allow {
                return Err(error(
                    pb::ErrorCode::PermissionDenied,
                    format!("{path}: permission denied"),
                ));
            }
            return Ok(pb::ListReply {
                files: vec![file_entry(&ctx.store, &root_name, &stat)],
                total: 1,
                ..Default::default()
            });
        }
        Err(BackingError::NotAFile(_)) => {} // a directory, or something else: below
        Err(BackingError::NotFound(_)) => return Err(not_found()),
        Err(e) => return Err(invalid(e.to_string())),
    }
    let backing = &ctx.meta.roots().get(root).backing;
    let mut entries = backing.list(rel).map_err(|e| match e {
        BackingError::NotFound(_) => not_found(),
        BackingError::Io { source, .. } if source.raw_os_error() == Some(libc::ENOTDIR) => {
            invalid(format!("{path}: neither a regular file nor a directory"))
        }
        e => invalid(e.to_string()),
    })?;
    // Operators see directories and files (symlinks are followed when stat'ed); others
    // see the regular files they may read, in a directory they may list, and a count of
    // the rest.
    entries.retain(|e| e.kind != EntryKind::Other);
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let dir_rel = rel.trim_matches('/');
    let child = |name: &str| {
        if dir_rel.is_empty() {
            name.to_owned()
        } else {
            format!("{dir_rel}/{name}")
        }
    };
    let mut page = Page::default();
    for e in entries.iter().skip(offset).take(limit) {
        let rel = child(&e.name);
        if !operator && e.kind != EntryKind::File {
            page.hidden += 1;
            continue;
        }
        if e.kind == EntryKind::Dir {
            let entry = pb::FileEntry {
                path: absolute(&root_name, &rel),
                is_dir: true,
                ..Default::default()
            };
            if !page.push(entry) {
                break;
            }
            continue;
        }
        if !operator {
            // The file's own check covers search on every directory above it; listing
            // needs read on the directory itself too.
            match readable(ctx, creds, root, &rel) {
                Some(stat)
                    if stat
                        .dirs
                        .last()
                        .is_some_and(|d| access::may_list(d, creds) == Decision::Allow) =>
                {
                    if !page.push(file_entry(&ctx.store, &root_name, &stat)) {
                        break;
                    }
                }
                _ => page.hidden += 1,
            }
            continue;
        }
        let entry = match ctx.meta.stat(root, &rel) {
            Ok(stat) => file_entry(&ctx.store, &root_name, &stat),
            // A symlink to a directory.
            Err(BackingError::NotAFile(_)) => pb::FileEntry {
                path: absolute(&root_name, &rel),
                is_dir: true,
                ..Default::default()
            },
            // Gone meanwhile, a dangling link, or a link out of the root: nothing to show.
            Err(_) => {
                page.hidden += 1;
                continue;
            }
        };
        if !page.push(entry) {
            break;
        }
    }
    Ok(page.reply(entries.len()))
}

/// Serves an Evict request.
pub fn evict(ctx: &Ctx, creds: &Creds, req: &pb::EvictRequest) -> response::Kind {
    if !is_operator(creds) {
        let me = rustix::process::geteuid().as_raw();
        return response::Kind::Error(error(
            pb::ErrorCode::PermissionDenied,
            format!(
                "evict: only root or the daemon's user (uid {me}) may drop cached copies, not uid {}; run it as one of them (e.g. sudo)",
                creds.uid
            ),
        ));
    }
    let selectors = usize::from(!req.paths.is_empty())
        + usize::from(!req.job.is_empty())
        + usize::from(req.all);
    if selectors != 1 {
        return response::Kind::Error(invalid(
            "evict: name paths, a job, or all (exactly one of them)".into(),
        ));
    }
    let (outcome, unmatched) = if req.all {
        (ctx.store.evict_matching(&|_, _| true), Vec::new())
    } else if !req.job.is_empty() {
        let Some(files) = ctx.jobs.files_of(&req.job) else {
            return response::Kind::Error(unknown_job(ctx, &req.job));
        };
        let roots = ctx.meta.roots();
        let mut by_root: HashMap<&str, std::collections::HashSet<&str>> = HashMap::new();
        for f in files.iter() {
            by_root
                .entry(roots.get(f.root).name.as_str())
                .or_default()
                .insert(&*f.path);
        }
        let outcome = ctx
            .store
            .evict_matching(&|root, path| by_root.get(root).is_some_and(|s| s.contains(path)));
        (outcome, Vec::new())
    } else {
        match evict_paths(ctx, &req.paths) {
            Ok(x) => x,
            Err(e) => return response::Kind::Error(e),
        }
    };
    tracing::info!(
        uid = creds.uid,
        files = outcome.files,
        bytes = outcome.bytes,
        busy = outcome.busy,
        "cached copies evicted on request"
    );
    response::Kind::Evict(pb::EvictReply {
        files: outcome.files,
        bytes: outcome.bytes,
        busy: outcome.busy,
        unmatched,
    })
}

/// Evicts every cached file at or under `paths` in one pass over the index: an entry
/// matches when its path, or a directory above it, is one of the targets.
fn evict_paths(
    ctx: &Ctx,
    paths: &[String],
) -> Result<(crate::store::EvictOutcome, Vec<String>), pb::ErrorReply> {
    // root name → canonical relative path → the targets naming it.
    let mut targets: HashMap<String, HashMap<String, Vec<usize>>> = HashMap::new();
    for (i, p) in paths.iter().enumerate() {
        let (root, rel) = locate(ctx, p)?;
        let mut names = Vec::new();
        if !rel.is_empty() {
            let comps = crate::backing::normalize(rel).map_err(|e| invalid(e.to_string()))?;
            names.push(comps.join("/"));
            // Through symlinks, the cache knows the file by its canonical path.
            if let Ok(stat) = ctx.meta.stat(root, rel) {
                names.push(stat.path.clone());
            }
        } else {
            names.push(String::new());
        }
        let by_path = targets
            .entry(ctx.meta.roots().get(root).name.clone())
            .or_default();
        for n in names {
            let v = by_path.entry(n).or_default();
            if !v.contains(&i) {
                v.push(i);
            }
        }
    }
    let matched = RefCell::new(vec![false; paths.len()]);
    let outcome = ctx.store.evict_matching(&|root, path| {
        let Some(by_path) = targets.get(root) else {
            return false;
        };
        // The path itself, each directory above it, and the root ("").
        let prefixes = std::iter::once("")
            .chain(path.match_indices('/').map(|(i, _)| &path[..i]))
            .chain(std::iter::once(path));
        let mut hit = false;
        for pre in prefixes {
            if let Some(ts) = by_path.get(pre) {
                let mut m = matched.borrow_mut();
                for &t in ts {
                    m[t] = true;
                }
                hit = true;
            }
        }
        hit
    });
    let unmatched = paths
        .iter()
        .zip(matched.into_inner())
        .filter(|(_, m)| !m)
        .map(|(p, _)| p.clone())
        .collect();
    Ok((outcome, unmatched))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absolute_joins_without_doubling_slashes() {
        assert_eq!(absolute("/data/", "a/b"), "/data/a/b");
        assert_eq!(absolute("/data", ""), "/data");
    }
}
