//! The peer list and each peer's health.
//!
//! Peers come from a static list or from a DNS name re-resolved periodically (every
//! address it gives is a peer: a Kubernetes headless Service lists one per pod). A peer
//! is healthy until it fails `failures` times in a row (a fetch or health check that
//! errs or times out); then it is left out of ownership for `backoff`, after which it
//! is tried again. Health only moves ownership (the ring is computed over healthy
//! peers): a node that comes back gets its blocks back, nothing else changes.

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

/// When a peer counts as down.
#[derive(Debug, Clone, Copy)]
pub struct HealthPolicy {
    /// Consecutive failures that mark a peer down.
    pub failures: u32,
    /// How long a down peer is left out before it is tried again.
    pub backoff: Duration,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            failures: 3,
            backoff: Duration::from_secs(5),
        }
    }
}

/// One peer's health, as status shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Health {
    /// Failures in a row.
    pub failures: u32,
    /// Left out of ownership until then.
    pub down_until: Option<Instant>,
    /// Last success.
    pub last_ok: Option<Instant>,
}

impl Health {
    fn healthy(&self, now: Instant) -> bool {
        self.down_until.is_none_or(|t| now >= t)
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

    /// The peers that may own blocks now (this node included), sorted.
    pub fn healthy(&self) -> Vec<String> {
        let now = Instant::now();
        self.peers
            .read()
            .iter()
            .filter(|(id, h)| *id == &self.me || h.healthy(now))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Records the outcome of an exchange with `peer`.
    pub fn report(&self, peer: &str, ok: bool) {
        let mut peers = self.peers.write();
        let Some(h) = peers.get_mut(peer) else {
            return;
        };
        let now = Instant::now();
        if ok {
            *h = Health {
                failures: 0,
                down_until: None,
                last_ok: Some(now),
            };
        } else {
            h.failures = h.failures.saturating_add(1);
            if h.failures >= self.policy.failures {
                h.down_until = Some(now + self.policy.backoff);
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
        for _ in 0..3 {
            m.report("c:1", false);
        }
        assert_eq!(m.healthy(), ["a:1", "b:1"], "down after 3 failures");
        m.refresh().unwrap();
        assert_eq!(m.healthy(), ["a:1", "b:1"], "a refresh keeps health");
        m.report("c:1", true);
        assert_eq!(
            m.healthy(),
            ["a:1", "b:1", "c:1"],
            "one success brings it back"
        );
        m.report("a:1", false);
        m.report("a:1", false);
        m.report("a:1", false);
        assert!(
            m.healthy().contains(&"a:1".to_owned()),
            "a node never rules itself out"
        );
    }

    #[test]
    fn a_down_peer_is_tried_again_after_the_backoff() {
        let m = Membership::new(
            Source::Static(vec!["b:1".into()]),
            "a:1",
            HealthPolicy {
                failures: 1,
                backoff: Duration::from_millis(50),
            },
        );
        m.refresh().unwrap();
        m.report("b:1", false);
        assert_eq!(m.healthy(), ["a:1"]);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(m.healthy(), ["a:1", "b:1"], "back in after the backoff");
        m.report("unknown:1", false); // ignored
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
