//! Registration: a manifest turned into a plan (files listed or globbed with the
//! registrant's rights, the order as the planner's source), who may replace, move or
//! unregister a job, the immutable holds a registration takes and gives back, and
//! which planned files a prefetch may fetch for whom.

use super::*;

/// Why a job could not be registered, changed or moved. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    /// Another user's job: only its registrant and operators may change it.
    #[error(
        "job {job:?} was registered by uid {owner}; only that user, root or the daemon's user may change it (run as them, or pick another job id)"
    )]
    NotYours {
        /// The job.
        job: String,
        /// Its registrant.
        owner: u32,
    },
    /// The manifest does not parse or breaks a rule (the message names the field).
    #[error("{0}")]
    Manifest(String),
    /// The manifest's root is under no backing root of this daemon.
    #[error("root: {0} is not under a backing root of this daemon")]
    RootNotServed(String),
    /// The glob could not be expanded (the message says why).
    #[error("{0}")]
    Glob(String),
    /// The glob matched no file the registrant may list.
    #[error("files.glob: {glob:?} matches no regular file under {root}{}", skipped_text(*.skipped_dirs, *.uid))]
    NothingMatched {
        /// The pattern.
        glob: String,
        /// The manifest's root.
        root: String,
        /// Directories skipped because the registrant may not list them.
        skipped_dirs: usize,
        /// The registrant.
        uid: u32,
    },
    /// An epoch of a sequence plan names a file the manifest does not list.
    #[error("plan.epochs[{epoch}][{item}]: {path:?} is not one of the manifest's files")]
    UnknownFile {
        /// Epoch index in the manifest.
        epoch: usize,
        /// Item index in that epoch.
        item: usize,
        /// The path named.
        path: String,
    },
    /// The planner refused the plan.
    #[error("plan: {0}")]
    Plan(crate::planner::PlanError),
    /// A position outside the job's plan.
    #[error("{0}")]
    Position(String),
}

fn skipped_text(dirs: usize, uid: u32) -> String {
    match dirs {
        0 => String::new(),
        n => format!(" (uid {uid} may not list {n} of its directories, which were skipped)"),
    }
}

/// What a registration did (the reply to it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registered {
    /// The job id.
    pub job: String,
    /// Files in the job.
    pub files: usize,
    /// Directories its glob did not list: the registrant may not.
    pub dirs_denied: usize,
    /// Files held as immutable (an immutable manifest): for everyone when an operator
    /// registered it, else for the registrant's own lookups of its own files (decided
    /// at each file's first stat).
    pub immutable_held: usize,
    /// Files not held: the daemon holds [`crate::meta::MAX_IMMUTABLE`] already.
    pub immutable_over_limit: usize,
    /// The registrant vouches only for its own files (it is not an operator).
    pub immutable_owner_only: bool,
}

/// A hash of a shuffle manifest with its ranks and its span of epochs left out (`None`
/// for other plans): two ranks' registrations of one job on one node have the same, also
/// when one registers again later, from the epoch it is at (after a daemon restart, or a
/// lease that ran out in a long pause). The fields are taken out for the hash and put
/// back (no copy of a manifest of a million files).
fn shape_of(m: &mut Manifest) -> Option<u64> {
    let Plan::Shuffle {
        ranks,
        first_epoch,
        epochs,
        ..
    } = &mut m.plan
    else {
        return None;
    };
    let kept = (std::mem::take(ranks), *first_epoch, *epochs);
    (*first_epoch, *epochs) = (0, 0);
    let bytes = serde_json::to_vec(&*m).ok();
    if let Plan::Shuffle {
        ranks,
        first_epoch,
        epochs,
        ..
    } = &mut m.plan
    {
        (*ranks, *first_epoch, *epochs) = kept;
    }
    Some(crate::checksum::block_xxh3(&bytes?))
}

impl Jobs {
    /// Rebuilds the tag index from the registered jobs (the first registered job that
    /// plans a file names it).
    fn rebuild_tags(&self) {
        let mut jobs: Vec<(String, u64)> = self
            .info
            .lock()
            .iter()
            .map(|(id, j)| (id.clone(), j.tag))
            .collect();
        jobs.sort_by_key(|(_, tag)| *tag);
        let mut tags = HashMap::default();
        for (id, tag) in jobs {
            if let Some(files) = self.files_of(&id) {
                for f in files.iter() {
                    tags.entry(f.clone()).or_insert(tag);
                }
            }
        }
        *self.tags.write() = tags;
    }
    /// Registers a manifest for the user `creds` (`operator`: root or the daemon's
    /// user), replacing a job with the same id — except that a shuffle the same user
    /// registered under that id, identical but for its ranks, gains the new ranks (the
    /// ranks of one job on one node share one node plan; a registration that adds no
    /// rank changes nothing). The error names the field and nothing changes. No lease:
    /// the job lives until unregistered ([`Jobs::register_leased`]).
    pub fn register(
        &self,
        json: &str,
        creds: &Creds,
        operator: bool,
    ) -> Result<Registered, JobError> {
        self.register_leased(json, creds, operator, None)
    }

    /// [`Jobs::register`] with a lease (`lease`, when its period is not zero): the job
    /// lives while the registering process (`creds.pid`) or another holder is alive, or
    /// while it is renewed within the period (`lease.rs`). A registration again under
    /// the same id, also one that adds no rank, renews it and adds its holder. A job
    /// that a registration without a lease made or joined keeps no lease until it is
    /// unregistered (a scheduler's registration outlives the readers').
    pub fn register_leased(
        &self,
        json: &str,
        creds: &Creds,
        operator: bool,
        lease: Option<LeaseRequest<'_>>,
    ) -> Result<Registered, JobError> {
        let mut m = Manifest::from_json(json).map_err(|e| JobError::Manifest(e.to_string()))?;
        // Parsed outside it (a large manifest takes a while); from here to the end, one
        // registration at a time, or two ranks registering at once would each find no
        // job under the id and the later would replace the other. Taken before every
        // other lock of the jobs and the planner.
        let _one_at_a_time = self.registering.lock();
        self.may_change(&m.job, creds.uid, operator)?;
        let lease = lease.filter(|l| !l.period.is_zero()).map(|l| {
            (
                l.period,
                lease::Holder::of(&*self.procs, creds.pid, l.holder),
            )
        });
        // The lease the job has after this registration, given the one it had (`None`
        // when it was not registered).
        let now = self.clock.now();
        let lease_after = |before: Option<&Option<lease::Lease>>| match (before, &lease) {
            (None, Some((period, holder))) => Some(lease::Lease::new(*period, now, holder.clone())),
            (Some(Some(l)), Some((period, holder))) => {
                let mut l = l.clone();
                l.join(*period, now, holder.clone());
                Some(l)
            }
            _ => None,
        };
        // Ranks of one job on one node (each rank's sampler registers its own rank
        // under the job's id): a shuffle identical to the registered one but for its
        // ranks adds them to the node's plan instead of replacing the other ranks'.
        let shape = shape_of(&mut m);
        let mut merged: Option<(u64, Usage)> = None;
        if let (
            Some(shape),
            Plan::Shuffle {
                ranks,
                first_epoch,
                epochs,
                ..
            },
        ) = (shape, &mut m.plan)
        {
            // Taken before the job table's lock (never the planner's under it).
            let at = self.plans.planner().position(&m.job);
            let mut info = self.info.lock();
            let same = info.get_mut(&m.job).filter(|j| {
                j.creds.uid == creds.uid && j.shape.as_ref().is_some_and(|(s, _)| *s == shape)
            });
            if let Some(j) = same {
                let old = &j.shape.as_ref().map_or(&[][..], |(_, r)| r);
                if ranks.iter().all(|r| old.contains(r)) {
                    // Nothing new: the plan stands, its position and usage too; the
                    // lease is renewed and gains the holder.
                    j.lease = lease_after(Some(&j.lease));
                    let r = j.registered.clone();
                    drop(info);
                    // Its holders changed: kept as they are now.
                    self.save_registration(&m.job);
                    return Ok(r);
                }
                let mut all: Vec<u64> = old.iter().chain(ranks.iter()).copied().collect();
                all.sort_unstable();
                all.dedup();
                // The merged plan starts at the epoch the job is at (or the new rank's
                // first, if earlier: neither rank's current epoch is skipped) and ends
                // at the later of the two ends.
                let (first, end) = j.span;
                let at = at.map_or(first, |(e, _)| e);
                let start = at.min(*first_epoch);
                let end = end.max(first_epoch.saturating_add(*epochs));
                (*first_epoch, *epochs) = (start, end - start);
                tracing::info!(job = %m.job, ranks = ?all, first_epoch = start, "ranks added to the node's plan");
                *ranks = all;
                merged = Some((j.tag, j.usage));
            }
        }
        let (ranks, span) = match &m.plan {
            Plan::Shuffle {
                ranks,
                first_epoch,
                epochs,
                ..
            } => (
                ranks.clone(),
                (*first_epoch, first_epoch.saturating_add(*epochs)),
            ),
            Plan::Sequence {
                first_epoch,
                epochs,
            } => (
                Vec::new(),
                (*first_epoch, first_epoch + epochs.len() as u64),
            ),
        };
        let (root, prefix) = self
            .locate(&m.root)
            .ok_or_else(|| JobError::RootNotServed(m.root.clone()))?;
        let rel = |p: &str| {
            if prefix.is_empty() {
                p.to_owned()
            } else {
                format!("{prefix}/{p}")
            }
        };
        let mut dirs_denied = 0;
        let names: Vec<String> = match &m.files {
            Files::List(list) => list.iter().map(|f| f.path().to_owned()).collect(),
            Files::Glob { glob } => {
                let backing = &*self.roots.get(root).backing;
                // The registrant's rights, not the daemon's: a directory it may not list
                // (or reach) is not listed.
                let mut may_list = |dir: &str| {
                    Ok(operator
                        || access::may_walk(&backing.dir_owners(dir)?, creds) == Decision::Allow)
                };
                let found = crate::glob::expand(
                    backing,
                    &prefix,
                    glob,
                    shardcache_plan::manifest::MAX_FILES,
                    &mut may_list,
                )
                .map_err(JobError::Glob)?;
                dirs_denied = found.skipped_dirs;
                if found.files.is_empty() {
                    return Err(JobError::NothingMatched {
                        glob: glob.clone(),
                        root: m.root.clone(),
                        skipped_dirs: found.skipped_dirs,
                        uid: creds.uid,
                    });
                }
                found.files
            }
        };
        let files: Vec<FileRef> = names
            .iter()
            .map(|p| FileRef {
                root,
                path: rel(p).into(),
            })
            .collect();
        let index: HashMap<&str, u32> = names
            .iter()
            .enumerate()
            .map(|(i, p)| (p.as_str(), i as u32))
            .collect();
        let lookup = |p: &str, e: usize, i: usize| {
            index.get(p).copied().ok_or_else(|| JobError::UnknownFile {
                epoch: e,
                item: i,
                path: p.to_owned(),
            })
        };
        let source = match &m.plan {
            Plan::Shuffle {
                seed,
                epochs,
                world_size,
                ranks,
                drop_last,
                first_epoch,
                ..
            } => Source::Shuffle {
                seed: *seed,
                first: *first_epoch,
                count: *epochs,
                world: *world_size,
                ranks: ranks.clone(),
                drop_last: *drop_last,
            },
            Plan::Sequence {
                epochs,
                first_epoch,
            } => {
                let mut orders = Vec::with_capacity(epochs.len());
                for (e, items) in epochs.iter().enumerate() {
                    let mut order = Vec::with_capacity(items.len());
                    for (i, it) in items.iter().enumerate() {
                        use shardcache_plan::manifest::FileRef as F;
                        order.push(match it {
                            Item::Index(x)
                            | Item::Range {
                                file: F::Index(x), ..
                            } => *x as u32,
                            Item::Path(p)
                            | Item::Range {
                                file: F::Path(p), ..
                            } => lookup(p, e, i)?,
                        });
                    }
                    orders.push(Arc::new(order));
                }
                Source::Sequence {
                    first: *first_epoch,
                    epochs: orders,
                }
            }
        };
        // Every file's size, when the manifest gives them all (the cluster placement
        // then counts bytes).
        let mut declared: Option<Vec<u64>> = None;
        if let Files::List(list) = &m.files {
            let mut sizes = self.sizes.lock();
            let mut all = Vec::with_capacity(list.len());
            for (f, spec) in files.iter().zip(list) {
                if let Some(size) = spec.size() {
                    sizes.insert(f.clone(), size);
                    all.push(size);
                }
            }
            declared = (all.len() == files.len()).then_some(all);
        }
        let n = files.len();
        let immutable = m.immutable.then(|| Arc::new(files.clone()));
        {
            let mut p = self.plans.planner();
            p.register(&m.job, files, source).map_err(JobError::Plan)?;
            p.set_sizes(&m.job, declared.map(Arc::from));
        }
        let immutable = immutable.map(|f| {
            let hold = Hold::new(if operator {
                Voucher::Operator
            } else {
                Voucher::User(creds.uid)
            });
            let held = self.meta.hold(f.iter().map(|x| (x.root, &*x.path)), &hold);
            (f, held, hold)
        });
        let registered = Registered {
            job: m.job.clone(),
            files: n,
            dirs_denied,
            immutable_held: immutable.as_ref().map_or(0, |i| i.1),
            immutable_over_limit: immutable.as_ref().map_or(0, |i| n - i.1),
            immutable_owner_only: immutable.is_some() && !operator,
        };
        // The same job with more ranks keeps its tag (clients' reports of it stay
        // counted) and its usage.
        let (tag, usage) = merged.unwrap_or_else(|| {
            (
                self.next_tag.fetch_add(1, Ordering::Relaxed),
                Usage::default(),
            )
        });
        let manifest = serde_json::to_value(&m).unwrap_or_default();
        let done = self.plans.planner().steps_done(&m.job).unwrap_or(0);
        let mut info = self.info.lock();
        let lease = lease_after(info.get(&m.job).map(|j| &j.lease));
        let old = info.insert(
            m.job.clone(),
            JobInfo {
                creds: creds.clone(),
                operator,
                files: n,
                immutable,
                dirs_denied: dirs_denied as u64,
                denied: HashSet::default(),
                tag,
                usage,
                shape: shape.map(|s| (s, ranks)),
                span,
                registered: registered.clone(),
                manifest,
                rate_mark: (done, Instant::now()),
                rate: Rate::default(),
                lease,
            },
        );
        drop(info);
        if let Some(old) = old {
            self.release(&old);
        }
        self.rebuild_tags();
        self.save_registration(&m.job);
        tracing::info!(
            job = %m.job,
            files = n,
            uid = creds.uid,
            dirs_denied,
            "prefetch manifest registered"
        );
        self.poke();
        Ok(registered)
    }

    /// The root containing directory `abs` and the path of `abs` inside it.
    fn locate(&self, abs: &str) -> Option<(usize, String)> {
        let abs = abs.trim_end_matches('/');
        self.roots.all().iter().enumerate().find_map(|(i, r)| {
            let root = r.name.trim_end_matches('/');
            if abs == root {
                Some((i, String::new()))
            } else {
                abs.strip_prefix(root)?
                    .strip_prefix('/')
                    .map(|p| (i, p.to_owned()))
            }
        })
    }

    /// Whether user `uid` (`operator`: root or the daemon's user) may replace, unregister
    /// or move job `job`: its registrant and operators may; a job not registered may be
    /// registered by anyone. The error says who may.
    pub fn may_change(&self, job: &str, uid: u32, operator: bool) -> Result<(), JobError> {
        match self.info.lock().get(job) {
            Some(j) if !access::may_change_job(j.creds.uid, uid, operator) => {
                Err(JobError::NotYours {
                    job: job.to_owned(),
                    owner: j.creds.uid,
                })
            }
            _ => Ok(()),
        }
    }

    /// Forgets a job; true if it was registered.
    pub fn unregister(&self, job: &str) -> bool {
        self.plans.slots().remove(job);
        if let Some(old) = self.info.lock().remove(job) {
            self.release(&old);
        }
        let found = self.plans.planner().unregister(job);
        self.forget_registration(job);
        self.rebuild_tags();
        if found {
            tracing::info!(job, "prefetch manifest unregistered");
        }
        found
    }

    fn release(&self, job: &JobInfo) {
        if let Some((files, held, hold)) = &job.immutable {
            self.meta
                .release(files.iter().map(|x| (x.root, &*x.path)), *held, hold);
        }
    }
    /// The metadata of planned file `f` as a registrant of a job reading it sees it, if
    /// one of them may read it (an operator's job always may): what a prefetch of `f`
    /// may fetch. Each job whose registrant may not read it counts it (and stops
    /// counting it once it may). `None`: no fetch.
    pub(super) fn stat_for_plan(&self, meta: &Meta, f: &FileRef) -> Option<Arc<Stat>> {
        let readers = self.plans.planner().readers_of(f);
        let who: Vec<(String, u32, Creds, bool)> = {
            let info = self.info.lock();
            readers
                .into_iter()
                .filter_map(|(job, i)| {
                    let j = info.get(&job)?;
                    Some((job, i, j.creds.clone(), j.operator))
                })
                .collect()
        };
        // Stat'ed without a lock held (it may go to the backing store).
        let mut allowed = None;
        let mut verdicts = Vec::with_capacity(who.len());
        for (job, i, creds, operator) in who {
            let ok = if operator {
                allowed = allowed.or_else(|| meta.stat(f.root, &f.path).ok());
                true
            } else {
                match meta.stat_for(f.root, &f.path, creds.uid) {
                    Ok(st) if access::check(&st, &creds) == Decision::Allow => {
                        allowed = allowed.or(Some(st));
                        true
                    }
                    Ok(_) => false,
                    // Gone or unreadable for the daemon itself: not the registrant's
                    // denial.
                    Err(_) => true,
                }
            };
            verdicts.push((job, i, ok));
        }
        let mut info = self.info.lock();
        for (job, i, ok) in verdicts {
            if let Some(j) = info.get_mut(&job) {
                if ok {
                    j.denied.remove(&i);
                } else if j.denied.insert(i) {
                    tracing::debug!(job, path = %f.path, uid = j.creds.uid, "not prefetched: its registrant may not read it");
                }
            }
        }
        allowed
    }
}
