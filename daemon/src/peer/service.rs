//! The peer service: serves blocks this node holds (or, as a block's owner, fetches
//! them from the backing store first) through a [`BlockProvider`] handed over at
//! construction (the fill engine), checked against their checksums before sending (on
//! the block stream), and tells other nodes which ranks this node runs (gRPC `Ranks`,
//! its reply MACed for the caller's nonce: see [`auth`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::{Request, Response, Status};

use super::auth;
use super::proto::{self, FetchRequest};
use crate::backing::Version;
use crate::blocks::{BlockProvider, Target};
use crate::meta::Meta;
use crate::policy::Plans;
use crate::stats::{Stats, add, inc};
use crate::store::Key;

pub(super) struct Service {
    pub(super) provider: Arc<dyn BlockProvider>,
    pub(super) meta: Arc<Meta>,
    pub(super) stats: Arc<Stats>,
    pub(super) timeout: Duration,
    pub(super) plans: Arc<Plans>,
    /// Which blocks of each file were served to peers that keep them, until all were.
    pub(super) handoffs: Mutex<HashMap<Key, Vec<bool>>>,
    /// The shared secret (the key of reply MACs is derived from it).
    pub(super) secret: Vec<u8>,
}

/// Files being handed to a keeping peer, tracked at most (a peer that gave up half way
/// leaves an entry; past this many the oldest state is dropped — a missed handoff only
/// keeps a copy longer).
const HANDOFFS: usize = 4096;

#[tonic::async_trait]
impl proto::peer_server::Peer for Service {
    async fn ranks(
        &self,
        req: Request<proto::RanksRequest>,
    ) -> Result<Response<proto::RanksReply>, Status> {
        // Put there by the port's check of the request's proof.
        let Some(&auth::Verified(nonce)) = req.extensions().get::<auth::Verified>() else {
            return Err(Status::unauthenticated(
                "shardcache peer: bad or missing proof of the shared secret",
            ));
        };
        let jobs = self
            .plans
            .shuffles()
            .into_iter()
            .map(|j| proto::JobRanks {
                job: j.job,
                world_size: j.world,
                ranks: j.ranks,
                slots: j.slots,
                slots_in_bytes: j.bytes,
                placement_forward: j.forward,
            })
            .collect();
        // The content travels encoded, MACed as it travels (see `auth`).
        let sealed = prost::Message::encode_to_vec(&proto::RanksReply {
            jobs,
            ..Default::default()
        });
        let mac = auth::reply_mac(&self.secret, "Ranks", &nonce, &sealed).to_vec();
        Ok(Response::new(proto::RanksReply {
            jobs: Vec::new(),
            sealed,
            mac,
        }))
    }
}

impl Service {
    /// Accounts for a block served to a peer (on the block stream): the
    /// counters, and the handoff of the file to a peer that keeps it.
    pub(super) fn served(&self, r: &FetchRequest, key: Key, len: usize) {
        if r.keep {
            let nblocks = r.size.div_ceil(r.block_size.max(1) as u64).max(1);
            self.count_handoff(key, &r.root, &r.path, r.index, nblocks);
        }
        inc(&self.stats.peer_blocks_out);
        add(&self.stats.peer_bytes_out, len as u64);
    }

    /// A peer that holds the whole file keeps it as the cluster's copy: this node's copy
    /// is handed over (see [`Plans::released`]).
    pub(super) fn released(&self, r: &FetchRequest) {
        self.plans.released(&r.root, &r.path);
    }

    /// Counts a block served to a peer that keeps it; when it has had every block of
    /// the file, this node's copy is handed over (see [`Plans::handed`]).
    fn count_handoff(&self, key: Key, root: &str, path: &str, index: u64, nblocks: u64) {
        let done = {
            let mut h = self.handoffs.lock();
            if h.len() >= HANDOFFS {
                h.clear();
            }
            let served = h
                .entry(key)
                .or_insert_with(|| vec![false; nblocks as usize]);
            if let Some(b) = served.get_mut(index as usize) {
                *b = true;
            }
            let done = served.iter().all(|&b| b);
            if done {
                h.remove(&key);
            }
            done
        };
        if done {
            self.plans.handed(root, path);
        }
    }
}

/// The block a peer asks for, from this node's cache, filled first when asked to, into
/// `buf`; its xxh3-64 (checked against the one recorded) and its file version's key.
pub(super) fn serve_block(
    provider: &dyn BlockProvider,
    meta: &Meta,
    r: &FetchRequest,
    timeout: Duration,
    buf: &mut Vec<u8>,
) -> Result<(u64, Key), Status> {
    if r.block_size != provider.block_size() {
        return Err(Status::failed_precondition(format!(
            "block size {} here, {} there: peers must use the same block_size",
            provider.block_size(),
            r.block_size
        )));
    }
    let Some(root) = meta.roots().all().iter().position(|x| x.name == r.root) else {
        return Err(Status::not_found(format!(
            "no backing root {} here",
            r.root
        )));
    };
    let version = Version {
        size: r.size,
        mtime_ns: r.mtime_ns,
        ctime_ns: r.ctime_ns,
        ino: r.ino,
        dev: r.dev,
    };
    let index = usize::try_from(r.index).map_err(|_| Status::invalid_argument("index"))?;
    let nblocks = r.size.div_ceil(r.block_size.max(1) as u64);
    if r.index >= nblocks.max(1) {
        return Err(Status::invalid_argument("no such block"));
    }
    let key = Key::of(&r.root, &r.path, &version);
    if let Some(sum) = provider.read(&key, index, buf) {
        return Ok((sum, key));
    }
    if !r.fill {
        return Err(Status::not_found("not cached here"));
    }
    // Fill only the version the peer named, found by this node's own lookup.
    let stat = meta
        .stat(root, &r.path)
        .map_err(|e| Status::not_found(e.to_string()))?;
    if stat.version != version || stat.path != r.path {
        return Err(Status::failed_precondition(
            "the file changed on the backing store (or the path is not canonical)",
        ));
    }
    let target = Arc::new(Target {
        root,
        rel: r.path.clone(),
        stat,
        key,
        peer_ok: false,
    });
    provider.fill(&target, index, Instant::now() + timeout);
    provider
        .read(&key, index, buf)
        .map(|sum| (sum, key))
        .ok_or_else(|| Status::not_found("could not cache it here"))
}
