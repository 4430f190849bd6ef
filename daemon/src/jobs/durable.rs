//! Registrations that survive a restart of the daemon (issue 15): each registered job
//! is kept in `<cache_dir>/jobs/` as two files named by a hash of its id — `H.json`
//! (the manifest as the node's plan holds it, ranks merged; its registrant; its lease
//! and holders), written at every registration, and `H.pos` (its position), written
//! every [`SAVE_EVERY`] by the prefetcher and at a clean stop — each written whole to a
//! temporary name, synced and renamed, so a crash leaves the old or the new one. An
//! unregister (also a lease running out) removes both.
//!
//! At start ([`Jobs::restore`]) each job is registered again as its registrant, with
//! its lease (renewed from the start: its holders have one lease to show up or be found
//! alive; a holder process that outlived the daemon still holds it) and its position.
//! A file that cannot be read or registered is logged and set aside (`.bad`), never
//! fatal: the daemon serves without that plan.
//!
//! Owns: the on-disk format ([`Saved`]). Goes through [`Jobs::register_leased`] like any
//! registration.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::*;

/// How often the prefetcher saves the positions of the jobs that moved.
pub(super) const SAVE_EVERY: Duration = Duration::from_secs(10);

const FORMAT: u32 = 1;

/// One registration, as kept on disk.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Saved {
    pub(super) format: u32,
    pub(super) job: String,
    /// The manifest (ranks of one node plan merged), as JSON.
    pub(super) manifest: serde_json::Value,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) groups: Vec<u32>,
    pub(super) operator: bool,
    pub(super) lease: Option<lease::SavedLease>,
}

/// Where registrations are kept.
#[derive(Debug)]
pub(super) struct Durable {
    dir: PathBuf,
}

fn name(job: &str) -> String {
    format!("{:016x}", crate::checksum::block_xxh3(job.as_bytes()))
}

/// Writes `bytes` to `path` whole: a temporary file, synced, renamed, the directory
/// synced.
fn write_atomic(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_data()?;
    }
    fs::rename(&tmp, path)?;
    fs::File::open(dir)?.sync_all()
}

impl Durable {
    /// Registrations under `dir` (created, private to the daemon's user).
    pub(super) fn open(dir: PathBuf) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        Ok(Self { dir })
    }

    pub(super) fn save(&self, s: &Saved) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(s).map_err(std::io::Error::other)?;
        let path = self.dir.join(format!("{}.json", name(&s.job)));
        write_atomic(&self.dir, &path, &bytes)
    }

    pub(super) fn save_position(&self, job: &str, epoch: u64, step: u64) -> std::io::Result<()> {
        let path = self.dir.join(format!("{}.pos", name(job)));
        write_atomic(&self.dir, &path, format!("{epoch} {step}\n").as_bytes())
    }

    pub(super) fn remove(&self, job: &str) {
        for ext in ["json", "pos"] {
            let p = self.dir.join(format!("{}.{ext}", name(job)));
            match fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "could not remove a kept registration")
                }
            }
        }
    }

    /// Every kept registration, with its position when one was saved; what cannot be
    /// read is set aside with a log line.
    pub(super) fn load(&self) -> Vec<(Saved, Option<(u64, u64)>)> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        paths.sort();
        let mut out = Vec::new();
        for p in paths {
            let saved = fs::read(&p)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Saved>(&b).map_err(|e| e.to_string()))
                .and_then(|s| {
                    if s.format == FORMAT {
                        Ok(s)
                    } else {
                        Err(format!("format {} (this daemon reads {FORMAT})", s.format))
                    }
                });
            match saved {
                Ok(s) => {
                    let pos = fs::read_to_string(p.with_extension("pos"))
                        .ok()
                        .and_then(|t| {
                            let mut it = t.split_ascii_whitespace().map(str::parse::<u64>);
                            Some((it.next()?.ok()?, it.next()?.ok()?))
                        });
                    out.push((s, pos));
                }
                Err(e) => self.set_aside(&p, &e),
            }
        }
        out
    }

    pub(super) fn set_aside(&self, p: &Path, why: &str) {
        tracing::warn!(path = %p.display(), why, "a kept registration could not be restored; set aside");
        let _ = fs::rename(p, p.with_extension("bad"));
    }

    pub(super) fn path_of(&self, job: &str) -> PathBuf {
        self.dir.join(format!("{}.json", name(job)))
    }
}

impl Jobs {
    /// Keeps registrations in `dir` across restarts (see the module documentation);
    /// call [`Jobs::restore`] next.
    pub fn keep_registrations_in(mut self, dir: PathBuf) -> std::io::Result<Self> {
        self.durable = Some(Durable::open(dir)?);
        Ok(self)
    }

    /// Registers again every job kept from before this start, as its registrant, with
    /// its lease and position. Returns how many were restored.
    pub fn restore(&self) -> usize {
        let Some(d) = &self.durable else {
            return 0;
        };
        let mut n = 0;
        for (s, pos) in d.load() {
            let creds = Creds {
                pid: 0,
                uid: s.uid,
                gid: s.gid,
                groups: s.groups.clone(),
            };
            let json = s.manifest.to_string();
            match self.register_leased(&json, &creds, s.operator, None) {
                Ok(_) => {
                    let now = self.clock.now();
                    if let Some(l) = &s.lease
                        && let Some(j) = self.info.lock().get_mut(&s.job)
                    {
                        j.lease = Some(lease::Lease::restored(l, now));
                    }
                    // Saved again with its lease (the registration above saved none).
                    self.save_registration(&s.job);
                    if let Some((epoch, step)) = pos {
                        let _ = self.plans.planner().set_position(&s.job, epoch, step);
                    }
                    tracing::info!(job = %s.job, position = ?pos, leased = s.lease.is_some(), "registration restored");
                    n += 1;
                }
                Err(e) => d.set_aside(&d.path_of(&s.job), &e.to_string()),
            }
        }
        n
    }

    /// Keeps job `job`'s registration as it stands now (no-op without a directory).
    pub(super) fn save_registration(&self, job: &str) {
        let Some(d) = &self.durable else {
            return;
        };
        let saved = {
            let info = self.info.lock();
            let Some(j) = info.get(job) else {
                return;
            };
            Saved {
                format: FORMAT,
                job: job.to_owned(),
                manifest: j.manifest.clone(),
                uid: j.creds.uid,
                gid: j.creds.gid,
                groups: j.creds.groups.clone(),
                operator: j.operator,
                lease: j.lease.as_ref().map(lease::Lease::saved),
            }
        };
        if let Err(e) = d.save(&saved) {
            tracing::warn!(job, error = %e, "could not keep the registration on disk: it will not survive a restart");
        }
    }

    /// Forgets the kept registration of `job`.
    pub(super) fn forget_registration(&self, job: &str) {
        if let Some(d) = &self.durable {
            d.remove(job);
        }
    }

    /// Saves the position of every job whose position changed since the last save.
    pub fn save_positions(&self) {
        let Some(d) = &self.durable else {
            return;
        };
        let ids: Vec<String> = self.info.lock().keys().cloned().collect();
        let positions: Vec<(String, (u64, u64))> = {
            let p = self.plans.planner();
            ids.into_iter()
                .filter_map(|id| p.position(&id).map(|pos| (id, pos)))
                .collect()
        };
        let mut saved = self.saved_positions.lock();
        for (id, pos) in positions {
            if saved.get(&id) == Some(&pos) {
                continue;
            }
            match d.save_position(&id, pos.0, pos.1) {
                Ok(()) => {
                    saved.insert(id, pos);
                }
                Err(e) => {
                    tracing::warn!(job = %id, error = %e, "could not save the job's position")
                }
            }
        }
        let info = self.info.lock();
        saved.retain(|id, _| info.contains_key(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::test_support::creds;
    use crate::clock::ManualClock;
    use crate::jobs::lease::test_support::FakeProcesses;
    use crate::jobs::tests::{jobs, shuffle, sized_shuffle};

    fn kept(dir: &Path, procs: &Arc<FakeProcesses>) -> Jobs {
        Arc::into_inner(jobs())
            .unwrap()
            .with_lease_seams(Arc::new(ManualClock::new()), procs.clone())
            .keep_registrations_in(dir.join("jobs"))
            .unwrap()
    }

    /// Issue 15: a restarted daemon (kill -9: no clean stop) knows every job it had —
    /// the node plan with the ranks registered one by one, its registrant, its lease
    /// with a holder that outlived the daemon, its last saved position — and none that
    /// was unregistered. A kept file that cannot be read is set aside, not fatal.
    #[test]
    fn registrations_survive_a_restart_with_their_ranks_lease_and_position() {
        let dir = tempfile::tempdir().unwrap();
        let procs = Arc::new(FakeProcesses::default());
        procs.set(4242, 99);
        let holder = Creds {
            pid: 4242,
            ..creds(1000)
        };
        let lease = Some(LeaseRequest {
            period: Duration::from_secs(60),
            holder: "",
        });
        {
            let before = kept(dir.path(), &procs);
            before
                .register_leased(&shuffle("j", 7, &[2]), &holder, false, lease)
                .unwrap();
            before
                .register_leased(&shuffle("j", 7, &[0]), &holder, false, lease)
                .unwrap();
            before
                .register(&shuffle("gone", 8, &[1]), &creds(1000), false)
                .unwrap();
            assert!(before.unregister("gone"));
            before.progress("j", 1, 3).unwrap();
            before.save_positions();
            // No clean stop: dropped as a kill would leave it.
        }
        std::fs::write(dir.path().join("jobs/0123456789abcdef.json"), b"{not json").unwrap();

        let after = kept(dir.path(), &procs);
        assert_eq!(after.restore(), 1);
        assert_eq!(
            after.plans.planner().shuffles(),
            vec![("j".to_owned(), 4, vec![0, 2])]
        );
        assert_eq!(after.plans.planner().position("j"), Some((1, 3)));
        let st = after.status(&|_, _| false, 1 << 30);
        assert_eq!(st.len(), 1);
        assert_eq!(
            (
                st[0].lease_seconds,
                st[0].lease_holders,
                st[0].lease_holders_alive
            ),
            (60, 1, 1),
            "the holder that outlived the daemon still holds it"
        );
        // Its registrant's rights: another user may not replace it.
        assert!(matches!(
            after.register(&shuffle("j", 9, &[1]), &creds(1001), false),
            Err(JobError::NotYours { .. })
        ));
        assert!(dir.path().join("jobs/0123456789abcdef.bad").exists());
        // Unregistered, it is not restored again.
        assert!(after.unregister("j"));
        let again = kept(dir.path(), &procs);
        assert_eq!(again.restore(), 0);
    }

    /// A plan that gave every file's size keeps them over a restart (its cluster
    /// placement still counts bytes, as the other nodes' do).
    #[test]
    fn a_restored_plan_keeps_its_files_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let procs = Arc::new(FakeProcesses::default());
        {
            let before = kept(dir.path(), &procs);
            before
                .register(&sized_shuffle("s", None), &creds(1000), false)
                .unwrap();
            assert!(before.plans.planner().has_sizes("s"));
        }
        let after = kept(dir.path(), &procs);
        assert_eq!(after.restore(), 1);
        assert!(after.plans.planner().has_sizes("s"));
    }
}
