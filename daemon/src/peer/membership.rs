//! The peer list and each peer's health.
//!
//! Peers come from a static list or from a DNS name re-resolved periodically (every
//! address it gives is a peer: a Kubernetes headless Service lists one per pod). A peer
//! is healthy until it fails `failures` times in a row (a fetch that errs), or at once
//! when it does not answer in time (a silent peer: packets dropped, a hung host); then
//! it is **down**: out of the read path and of ownership until a background probe
//! ([`super::Peers`] dials it every [`HealthPolicy::probe_every`]) gets an answer. So a
//! silent peer costs each reader at most one bounded wait, once, however long it stays
//! silent, and never flips back to healthy without having answered. Each change of
//! state is logged once. Health moves ownership (the ring is computed over healthy
//! peers) and the read path, never a job's cluster layout (its ranks and slots stay as
//! the peer last told them).

use std::collections::BTreeMap;
use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

/// Where the peer list comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A fixed list of `host:port` addresses.
    Static(Vec<String>),
    /// Every address `name` resolves to, at `port`.
    Dns {
        /// The name (e.g. a headless Service: `shardcache.ns.svc.cluster.local`).
        name: String,
        /// The peers' port.
        port: u16,
    },
}

/// When a peer counts as down, and how soon a down one is probed.
#[derive(Debug, Clone, Copy)]
pub struct HealthPolicy {
    /// Consecutive failures that mark a peer down (one that did not answer in time is
    /// down at once).
    pub failures: u32,
    /// How often a down peer is probed (a probe that gets an answer brings it back).
    pub probe_every: Duration,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            failures: 3,
            probe_every: Duration::from_millis(500),
        }
    }
}

/// How an exchange with a peer went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It answered (also "not here": a peer that says so is healthy).
    Answered,
    /// It failed fast (refused, reset, a bad reply).
    Failed,
    /// It did not answer in time: down at once.
    Silent,
}

/// One peer's health, as status shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Health {
    /// Failures in a row.
    pub failures: u32,
    /// Down (out of the read path and ownership) since then, until a probe answers.
    pub down_since: Option<Instant>,
    /// Last success.
    pub last_ok: Option<Instant>,
}

impl Health {
    fn healthy(&self) -> bool {
        self.down_since.is_none()
    }
}

/// The peers of this node (itself included) and their health.
#[derive(Debug)]
pub struct Membership {
    source: Source,
    me: String,
    policy: HealthPolicy,
    peers: RwLock<BTreeMap<String, Health>>,
}

impl Membership {
    /// Membership from `source`; `me` is this node's own advertised `host:port` (always
    /// a member, always healthy in its own eyes). Call [`Membership::refresh`] to fill it.
    pub fn new(source: Source, me: impl Into<String>, policy: HealthPolicy) -> Self {
        let me = me.into();
        let mut peers = BTreeMap::new();
        peers.insert(me.clone(), Health::default());
        Self {
            source,
            me,
            policy,
            peers: RwLock::new(peers),
        }
    }

    /// This node's id.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// Reads the source again: new peers join (healthy), vanished ones leave, the rest
    /// keep their health. A DNS failure keeps the last list and is returned.
    pub fn refresh(&self) -> std::io::Result<()> {
        let mut ids: Vec<String> = match &self.source {
            Source::Static(list) => list.clone(),
            Source::Dns { name, port } => (name.as_str(), *port)
                .to_socket_addrs()?
                .map(|a| a.to_string())
                .collect(),
        };
        ids.push(self.me.clone());
        let mut peers = self.peers.write();
        peers.retain(|id, _| ids.contains(id));
        for id in ids {
            peers.entry(id).or_default();
        }
        Ok(())
    }

    /// The peers that may own blocks and be read from now (this node included), sorted.
    pub fn healthy(&self) -> Vec<String> {
        self.peers
            .read()
            .iter()
            .filter(|(id, h)| *id == &self.me || h.healthy())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The peers that are down (to be probed), sorted.
    pub fn down(&self) -> Vec<String> {
        self.peers
            .read()
            .iter()
            .filter(|(id, h)| *id != &self.me && !h.healthy())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// How often a down peer is probed.
    pub fn probe_every(&self) -> Duration {
        self.policy.probe_every
    }

    /// Records the outcome of an exchange with `peer` (a probe's too: an answer is the
    /// only way back from down). `why` says what went wrong, for the one log line a
    /// change of state gets. Returns true when the peer's state changed.
    pub fn report(&self, peer: &str, outcome: Outcome, why: &str) -> bool {
        let mut peers = self.peers.write();
        let Some(h) = peers.get_mut(peer) else {
            return false;
        };
        if peer == self.me {
            return false;
        }
        let now = Instant::now();
        match outcome {
            Outcome::Answered => {
                let was = h.down_since;
                *h = Health {
                    failures: 0,
                    down_since: None,
                    last_ok: Some(now),
                };
                if let Some(since) = was {
                    tracing::info!(peer, down_for = ?now.duration_since(since), "peer answers again: back in the read path");
                    return true;
                }
                false
            }
            Outcome::Failed | Outcome::Silent => {
                h.failures = h.failures.saturating_add(1);
                let down = outcome == Outcome::Silent || h.failures >= self.policy.failures;
                if down && h.down_since.is_none() {
                    h.down_since = Some(now);
                    tracing::warn!(
                        peer,
                        failures = h.failures,
                        why,
                        "peer down: out of the read path until a probe gets an answer"
                    );
                    return true;
                }
                false
            }
        }
    }

    /// Every member with its health.
    pub fn all(&self) -> Vec<(String, Health)> {
        self.peers
            .read()
            .iter()
            .map(|(id, h)| (id.clone(), *h))
            .collect()
    }
}

impl crate::policy::Members for Membership {
    /// The healthy members, sorted (the list every node computes owners over), and this
    /// node's id.
    fn view(&self) -> (Vec<String>, String) {
        let mut healthy = self.healthy();
        healthy.sort_unstable();
        (healthy, self.me().to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_static_list_joins_leaves_and_keeps_health() {
        let m = Membership::new(
            Source::Static(vec!["b:1".into(), "c:1".into()]),
            "a:1",
            HealthPolicy::default(),
        );
        assert_eq!(
            m.healthy(),
            ["a:1"],
            "before the first refresh: only itself"
        );
        m.refresh().unwrap();
        assert_eq!(m.healthy(), ["a:1", "b:1", "c:1"]);
        assert!(!m.report("c:1", Outcome::Failed, "reset"));
        assert!(!m.report("c:1", Outcome::Failed, "reset"));
        assert!(
            m.report("c:1", Outcome::Failed, "reset"),
            "a change of state"
        );
        assert_eq!(m.healthy(), ["a:1", "b:1"], "down after 3 failures");
        assert_eq!(m.down(), ["c:1"]);
        m.refresh().unwrap();
        assert_eq!(m.healthy(), ["a:1", "b:1"], "a refresh keeps health");
        assert!(m.report("c:1", Outcome::Answered, ""));
        assert_eq!(
            m.healthy(),
            ["a:1", "b:1", "c:1"],
            "one answer brings it back"
        );
        for _ in 0..3 {
            m.report("a:1", Outcome::Silent, "");
        }
        assert!(
            m.healthy().contains(&"a:1".to_owned()),
            "a node never rules itself out"
        );
        assert!(m.down().is_empty());
    }

    /// Issue 15: a peer that did not answer in time is down at once, stays down however
    /// long (no timed return: only an answer brings it back), and each change of state
    /// is reported once.
    #[test]
    fn a_silent_peer_is_down_at_once_until_it_answers() {
        let m = Membership::new(
            Source::Static(vec!["b:1".into()]),
            "a:1",
            HealthPolicy {
                failures: 3,
                probe_every: Duration::from_millis(1),
            },
        );
        m.refresh().unwrap();
        assert!(m.report("b:1", Outcome::Silent, "no ack in 100 ms"));
        assert_eq!(m.healthy(), ["a:1"]);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(m.healthy(), ["a:1"], "no way back by the clock");
        assert!(!m.report("b:1", Outcome::Silent, "again"), "logged once");
        assert!(!m.report("b:1", Outcome::Failed, "probe refused"));
        assert_eq!(m.down(), ["b:1"]);
        assert!(m.report("b:1", Outcome::Answered, ""));
        assert!(!m.report("b:1", Outcome::Answered, ""));
        assert_eq!(m.healthy(), ["a:1", "b:1"]);
        m.report("unknown:1", Outcome::Silent, ""); // ignored
    }

    #[test]
    fn a_dns_name_gives_one_peer_per_address() {
        // `localhost` resolves from /etc/hosts: no query leaves the machine.
        let m = Membership::new(
            Source::Dns {
                name: "localhost".into(),
                port: 7070,
            },
            "127.0.0.9:7070",
            HealthPolicy::default(),
        );
        m.refresh().unwrap();
        let ids = m.healthy();
        assert!(ids.contains(&"127.0.0.1:7070".to_owned()), "{ids:?}");
        assert!(ids.contains(&"127.0.0.9:7070".to_owned()));
    }
}
