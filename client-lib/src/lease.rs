//! Leased registrations: a job the training process registers itself lives while the
//! process does (or keeps renewing it), so that a job that died leaves nothing
//! prefetching behind (docs/MANIFEST.md, "Leases").
//!
//! [`JobLease`] is the handle: it registers with a lease, renews it through the
//! progress reports the loader makes anyway (the daemon also renews it on every read of
//! the job's files), registers again when the daemon no longer knows the job (its lease
//! ran out during a long pause, or the daemon restarted), and lets go of the job when
//! dropped. The holder name this module makes is what lets one rank's release leave the
//! other ranks' registrations of the same job alone, also where the daemon cannot see
//! the client's pid (another pid namespace).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::sync::Mutex;
use std::time::Duration;

use crate::{Client, Registered};

/// The lease the Python sampler and [`JobLease::register`] ask for: a job outlives its
/// last process by at most this long when that process cannot be seen by the daemon,
/// and a pause of this long without reads or progress reports does not lose it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

/// This process's name as a lease holder: its pid and a random number drawn once per
/// process (a child after `fork` draws its own).
pub(crate) fn holder() -> String {
    static HOLDER: Mutex<Option<(u32, String)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut h = HOLDER.lock().unwrap_or_else(|e| e.into_inner());
    match &*h {
        Some((p, name)) if *p == pid => name.clone(),
        _ => {
            let mut r = RandomState::new().build_hasher();
            r.write_u32(pid);
            let name = format!("pid{pid}-{:016x}", r.finish());
            *h = Some((pid, name.clone()));
            name
        }
    }
}

/// A job this process registered with a lease, and holds until it is dropped (or
/// [`JobLease::release`]d): then the daemon forgets this process's hold, and the job
/// when no other process holds it.
///
/// ```no_run
/// use shardcache_client::{Client, JobLease};
/// # let manifest_json = String::new();
/// let job = JobLease::register(Client::connect(), manifest_json)?;
/// for epoch in 0..3 {
///     job.progress(epoch, 0)?; // renews the lease; registers again if the daemon lost it
///     // ... read the epoch through the client ...
/// }
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct JobLease {
    client: Client,
    manifest_json: String,
    lease: Duration,
    registered: Registered,
    released: bool,
}

impl JobLease {
    /// Registers `manifest_json` with the [`DEFAULT_LEASE`].
    pub fn register(client: Client, manifest_json: String) -> io::Result<Self> {
        Self::with_lease(client, manifest_json, DEFAULT_LEASE)
    }

    /// Registers `manifest_json` with a lease of `lease` (whole seconds, at least one).
    pub fn with_lease(client: Client, manifest_json: String, lease: Duration) -> io::Result<Self> {
        let registered = client.register_leased(&manifest_json, lease)?;
        Ok(Self {
            client,
            manifest_json,
            lease,
            registered,
            released: false,
        })
    }

    /// The job id.
    pub fn job(&self) -> &str {
        &self.registered.job
    }

    /// What the registration did.
    pub fn registered(&self) -> &Registered {
        &self.registered
    }

    /// Tells the daemon that the job is about to read step `step` of epoch `epoch`,
    /// which renews the lease. When the daemon no longer knows the job, the manifest is
    /// registered again and the position then reported. True when the daemon knows the
    /// job at the end.
    pub fn progress(&self, epoch: u64, step: u64) -> io::Result<bool> {
        if self.client.progress(self.job(), epoch, step)? {
            return Ok(true);
        }
        self.client
            .register_leased(&self.manifest_json, self.lease)?;
        self.client.progress(self.job(), epoch, step)
    }

    /// Lets go of the job now: the daemon removes this process's hold, and the job when
    /// no other process holds it. True if the job was registered.
    pub fn release(mut self) -> io::Result<bool> {
        self.released = true;
        self.client.release(&self.registered.job)
    }
}

impl Drop for JobLease {
    fn drop(&mut self) {
        if !self.released {
            // Best effort: a daemon that does not answer forgets the job when the lease
            // runs out.
            let _ = self.client.release(&self.registered.job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_name_is_stable_within_a_process() {
        let a = holder();
        assert_eq!(a, holder());
        assert!(a.starts_with(&format!("pid{}-", std::process::id())));
    }
}
