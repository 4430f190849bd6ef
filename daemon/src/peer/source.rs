//! The peers as a fill's [`BlockSource`]: a block from the node the plans or the ring say
//! holds it (see [`Peers::fetch`]), its MAC and xxh3 checked on the way in; "not here"
//! from every peer asked is a miss (the next source, the backing store, is asked); a
//! prefetch of a file the cluster placement moved to another node is declined.

use std::sync::Arc;

use super::Peers;
use crate::blocks::{BlockRequest, BlockSource, Fetched, SourceError};

/// See the module doc.
#[derive(Debug, Clone)]
pub struct PeerSource(Arc<Peers>);

impl PeerSource {
    /// Fills ask `peers`.
    pub fn new(peers: Arc<Peers>) -> Self {
        Self(peers)
    }
}

impl BlockSource for PeerSource {
    fn name(&self) -> &'static str {
        "peers"
    }

    fn remote(&self) -> bool {
        true
    }

    fn fetch(&self, req: &BlockRequest<'_>, buf: &mut Vec<u8>) -> Result<Fetched, SourceError> {
        let stat = &req.target.stat;
        // The fill keeps the block (the sender's copy may then go).
        if let Some(xxh3) = self.0.fetch(req.root, stat, req.index, req.len, true, buf) {
            return Ok(Fetched::Got { xxh3: Some(xxh3) });
        }
        if req.prefetch && self.0.placed_elsewhere(req.root, &stat.path) {
            return Ok(Fetched::Declined);
        }
        Ok(Fetched::Miss)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::backing::Owner;
    use crate::backing::mem::MemBacking;
    use crate::blocks::conformance::{self, BS, SourceFixture};
    use crate::blocks::mem::MemProvider;
    use crate::blocks::{BlockProvider, Target};
    use crate::meta::Meta;
    use crate::meta::test_support::one_root;
    use crate::peer::membership::Source;
    use crate::peer::{PeerConfig, PeerServer, bind, member_list};
    use crate::planner::ring::file_owner;
    use crate::policy::Plans;
    use crate::store::Key;

    const SECRET: &str = "peer source conformance secret";
    /// The paths the conformance suite uses: node B must own them all.
    const PATHS: [&str; 3] = ["d/f", "f", "never-put"];

    /// Node A's peer client (the source under test) and node B, whose peer server
    /// serves a [`MemProvider`] over an in-memory backing store, over real sockets.
    struct Fx {
        source: PeerSource,
        mem: Arc<MemBacking>,
        meta: Arc<Meta>,
        provider: Arc<MemProvider>,
        a: Arc<Peers>,
        b: Arc<Peers>,
        server: PeerServer,
    }

    impl Drop for Fx {
        fn drop(&mut self) {
            self.server.close();
            self.b.close();
            self.a.close();
        }
    }

    fn config(listen: std::net::SocketAddr, me: &str, others: Vec<String>) -> PeerConfig {
        PeerConfig {
            listen,
            advertise: me.to_owned(),
            source: Source::Static(others),
            secret: SECRET.to_owned(),
            timeout: Duration::from_secs(5),
            refresh: Duration::from_secs(60),
            tls: None,
        }
    }

    fn fx() -> Fx {
        fx_serving(|p| p)
    }

    /// [`fx`] with node B serving through `serve(its provider)`.
    fn fx_serving(serve: impl FnOnce(Arc<MemProvider>) -> Arc<dyn BlockProvider>) -> Fx {
        let mem = Arc::new(MemBacking::new());
        let (meta, stats) = one_root(mem.clone());
        let roots = meta.roots().clone();
        // Node B's port, and a name for node A under which B owns every path the suite
        // uses (A's own port is never dialled). For some of B's names no such name of A
        // exists among those tried (B's rendezvous score for a path may be lower than
        // almost any other name's: about 1 port in 250): then another port for B.
        let (listener, addr, b_name, a_name) = (0..20)
            .find_map(|_| {
                let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
                let addr = listener.local_addr().unwrap();
                let b_name = addr.to_string();
                let a_name = (1..10_000).map(|p| format!("127.0.0.2:{p}")).find(|a| {
                    PATHS.iter().all(|p| {
                        file_owner([a.as_str(), b_name.as_str()], "/r", p) == Some(b_name.as_str())
                    })
                })?;
                Some((listener, addr, b_name, a_name))
            })
            .expect("a port for node B under which it can own every path");
        let provider = Arc::new(MemProvider::new(BS as u32));
        let b_cfg = config(addr, &b_name, Vec::new());
        let b = Peers::start(
            &b_cfg,
            member_list(&b_cfg),
            Arc::new(Plans::new(roots.clone(), true)),
            stats.clone(),
            BS as u32,
        )
        .unwrap();
        let server =
            PeerServer::start(&b_cfg, listener, &b, meta.clone(), serve(provider.clone())).unwrap();
        let a_cfg = config(
            "127.0.0.2:1".parse().unwrap(),
            &a_name,
            vec![b_name.clone()],
        );
        let a = Peers::start(
            &a_cfg,
            member_list(&a_cfg),
            Arc::new(Plans::new(roots, true)),
            stats,
            BS as u32,
        )
        .unwrap();
        Fx {
            source: PeerSource::new(a.clone()),
            mem,
            meta,
            provider,
            a,
            b,
            server,
        }
    }

    impl SourceFixture for Fx {
        fn source(&self) -> &dyn BlockSource {
            &self.source
        }
        fn root(&self) -> &str {
            "/r"
        }
        fn put(&self, path: &str, data: &[u8]) -> Arc<Target> {
            let owner = Owner {
                mode: 0o644,
                ..Owner::default()
            };
            self.mem.put(path, data.to_vec(), owner);
            self.meta.invalidate(0, path);
            let stat = self.meta.stat(0, path).unwrap();
            let key = Key::of("/r", &stat.path, &stat.version);
            self.provider.put_backing(0, path, key, data.to_vec());
            Arc::new(Target {
                root: 0,
                rel: path.to_owned(),
                stat,
                key,
                peer_ok: true,
            })
        }
    }

    /// The peers as a fill's source, end to end over the block stream (handshake, MAC
    /// per request and block, the receiver's xxh3): the suite the in-memory twin passes.
    #[test]
    fn the_peer_client_conforms_as_a_source() {
        conformance::sources(&fx);
    }

    /// A gate the blocks a node serves wait at: how many wait, and whether it is open.
    #[derive(Debug, Default)]
    struct Gate {
        state: parking_lot::Mutex<(usize, bool)>,
        cv: parking_lot::Condvar,
    }

    impl Gate {
        /// Blocks served from now on wait at the gate.
        fn close(&self) {
            self.state.lock().1 = false;
        }

        /// Every block waiting at the gate, and every later one, is served.
        fn open(&self) {
            self.state.lock().1 = true;
            self.cv.notify_all();
        }

        /// Blocks waiting at the gate now.
        fn held(&self) -> usize {
            self.state.lock().0
        }
    }

    /// `n` fetches of `t`'s block at once, each on a thread of `s`.
    fn fetches_at_once<'s>(
        s: &'s std::thread::Scope<'s, '_>,
        fx: &'s Fx,
        t: &'s Arc<Target>,
        n: usize,
    ) -> Vec<std::thread::ScopedJoinHandle<'s, Result<Fetched, SourceError>>> {
        (0..n)
            .map(|_| {
                s.spawn(|| {
                    let req = conformance::request(t, "/r", 0, BS);
                    fx.source.fetch(&req, &mut Vec::new())
                })
            })
            .collect()
    }

    /// Waits for `fetches`; each got its block.
    fn each_got(fetches: Vec<std::thread::ScopedJoinHandle<'_, Result<Fetched, SourceError>>>) {
        for f in fetches {
            let got = f.join().unwrap();
            assert!(matches!(got, Ok(Fetched::Got { .. })), "{got:?}");
        }
    }

    /// A provider whose reads wait at a [`Gate`] (at most 10 s) before they are served.
    #[derive(Debug)]
    struct Gated {
        inner: Arc<MemProvider>,
        gate: Arc<Gate>,
    }

    impl BlockProvider for Gated {
        fn block_size(&self) -> u32 {
            self.inner.block_size()
        }
        fn read(&self, key: &Key, index: usize, buf: &mut Vec<u8>) -> Option<u64> {
            let mut g = self.gate.state.lock();
            g.0 += 1;
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !g.1 && !self.gate.cv.wait_until(&mut g, deadline).timed_out() {}
            g.0 -= 1;
            drop(g);
            self.inner.read(key, index, buf)
        }
        fn fill(&self, target: &Arc<Target>, index: usize, deadline: std::time::Instant) -> bool {
            self.inner.fill(target, index, deadline)
        }
    }

    /// However many fills fetch from one peer at once, a node opens at most
    /// [`MAX_STREAMS`] block streams to it: the other fetches wait for one and then get
    /// their block (before, each fill worker opened its own, past what the peer serves
    /// from one caller: the peer closed the extra ones, and the failed fetches marked
    /// it down).
    #[test]
    fn fetches_past_the_stream_bound_wait_for_a_stream_and_get_their_block() {
        use crate::peer::MAX_STREAMS;
        let gate = Arc::new(Gate::default());
        let g = gate.clone();
        let fx = fx_serving(move |p| Arc::new(Gated { inner: p, gate: g }));
        let t = fx.put("f", &[7u8; BS]);
        let b = fx.b.view().1;
        let n = 4 * MAX_STREAMS;
        std::thread::scope(|s| {
            let fetches = fetches_at_once(s, &fx, &t, n);
            // Every fetch is either at the peer (held at the gate) or waiting for a
            // stream — or more than the bound reached the peer.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let at_peer = loop {
                let at_peer = gate.held();
                let (_, waiting) = fx.a.streams(&b);
                if at_peer + waiting == n || at_peer > MAX_STREAMS {
                    break at_peer;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{at_peer} fetches at the peer, {waiting} waiting, of {n}"
                );
                std::thread::sleep(Duration::from_millis(2));
            };
            assert_eq!(at_peer, MAX_STREAMS, "fetches served at once");
            assert!(fx.server.data.open() <= MAX_STREAMS, "streams open");
            gate.open();
            each_got(fetches);
        });
        assert_eq!(fx.a.streams(&b), (0, 0), "every stream given back");
        assert_eq!(fx.a.view().0.len(), 2, "the peer never marked down");
    }

    /// Connections a burst of fetches opened to a peer (as many as may be in use at
    /// once) are all kept for the next burst: the next one dials none (before, 8 of 16
    /// were closed once idle, and every burst past 8 fetches at once dialled again — a
    /// TCP connection, a TLS and a stream handshake and a new serving thread at the peer
    /// each, which took 8 of 64 fill workers of a node in docs/PYTHON.md's example on the
    /// testbed).
    #[test]
    fn a_burst_of_fetches_at_the_stream_bound_reuses_every_stream_the_last_one_opened() {
        use crate::peer::MAX_STREAMS;
        let gate = Arc::new(Gate::default());
        let g = gate.clone();
        let fx = fx_serving(move |p| Arc::new(Gated { inner: p, gate: g }));
        let t = fx.put("f", &[7u8; BS]);
        let burst = || {
            gate.close();
            std::thread::scope(|s| {
                let fetches = fetches_at_once(s, &fx, &t, MAX_STREAMS);
                // All of them at the peer at once, then served.
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while gate.held() < MAX_STREAMS {
                    assert!(std::time::Instant::now() < deadline, "fetches at the peer");
                    std::thread::sleep(Duration::from_millis(2));
                }
                gate.open();
                each_got(fetches);
            });
        };
        burst();
        assert_eq!(
            fx.a.dials(),
            MAX_STREAMS as u64,
            "the first burst dials each"
        );
        burst();
        assert_eq!(
            fx.a.dials(),
            MAX_STREAMS as u64,
            "the second burst finds every stream kept"
        );
    }

    /// A block-stream connection the client keeps idle for its next block holds a
    /// serving thread (`sc-peer-data`, a lifecycle task): closing the server wakes it
    /// (its socket shut down) and joins it, well before its idle limit.
    #[test]
    fn closing_the_server_ends_its_block_stream_threads() {
        let fx = fx();
        let t = fx.put("f", &[7u8; BS]);
        let req = conformance::request(&t, "/r", 0, BS);
        let mut buf = Vec::new();
        let got = fx.source.fetch(&req, &mut buf);
        assert!(matches!(got, Ok(Fetched::Got { .. })), "{got:?}");
        assert_eq!(fx.server.data.open(), 1, "the kept connection's thread");
        let started = std::time::Instant::now();
        assert_eq!(fx.server.data.close(), 0, "joined, none left behind");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "woken, not waited out"
        );
        assert_eq!(fx.server.data.open(), 0);
    }
}
