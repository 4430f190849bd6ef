//! Trust suite: peers_auth (see main.rs). Every byte a node accepts from a peer is
//! authenticated: block replies on the block stream (a MAC per block, keyed per session,
//! bound to the request and to the session's sequence number), and gRPC `Ranks` replies
//! (a MAC keyed from the secret over the caller's fresh nonce).
//!
//! The attacks run through [`Proxy`], a small TCP proxy put between a node and the peer
//! it asks (the node lists the proxy's address as that peer): what the node sends goes
//! through as it is, what the peer answers is tampered with on the way back.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use shardcache_daemon::peer::{proto, wire};
use shardcache_tests::certs::Ca;
use shardcache_tests::{Bed, Daemon, content, free_port, read_all, write_file};

const BLOCK: u64 = 64 << 10;

/// A free TCP port on 127.0.0.1 (bound and released: the daemon binds it next).
/// What the proxy does to what the peer answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attack {
    /// Block stream: replaces the bytes of the first block it sees (of all connections)
    /// and puts the xxh3 of the new bytes in its header, as an attacker who can inject
    /// into the connection would.
    SubstituteBlock,
    /// Block stream: on each connection, answers the second block request of the
    /// length of the first with the first one's whole reply, recorded.
    ReplayBlock,
    /// gRPC: in the reply data, rewrites a job's ranks `[0, 1]` into `[0, 2]` (the same
    /// length: only the meaning changes).
    RewriteRanks,
    /// Changes nothing; keeps the first 16 MiB the peer sent (what a listener sees).
    Watch,
}

/// A proxy on 127.0.0.1 in front of `upstream`, carrying out `attack`. Its threads end
/// with the test process (each connection's with the connection).
struct Proxy {
    addr: String,
    /// How many times the attack was carried out.
    done: Arc<AtomicU64>,
    /// What the peer sent ([`Attack::Watch`]).
    seen: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Proxy {
    fn start(upstream: String, attack: Attack) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = l.local_addr().expect("address").to_string();
        let done = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let once = Arc::new(AtomicBool::new(false));
        let (d, w) = (done.clone(), seen.clone());
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(c) = c else { return };
                let (up, d, w, once) = (upstream.clone(), d.clone(), w.clone(), once.clone());
                std::thread::spawn(move || {
                    let _ = relay(c, &up, attack, &d, &w, &once);
                });
            }
        });
        Self { addr, done, seen }
    }

    fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }
}

/// One proxied connection: the caller's bytes as they are; the peer's through the
/// attack for the connection's protocol (told by the caller's first 8 bytes).
fn relay(
    mut client: TcpStream,
    upstream: &str,
    attack: Attack,
    done: &AtomicU64,
    seen: &std::sync::Mutex<Vec<u8>>,
    once: &AtomicBool,
) -> std::io::Result<()> {
    let mut server = TcpStream::connect(upstream)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let mut head = [0u8; 8];
    client.read_exact(&mut head)?;
    server.write_all(&head)?;
    let (mut from, mut to) = (client.try_clone()?, server.try_clone()?);
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    // The block stream's versions: 1 had no tag after a reply; 2 has a 32-byte MAC.
    let tag = match &head {
        b"SCPEERD1" => Some(0),
        b"SCPEERD2" => Some(32),
        _ => None,
    };
    let r = match (tag, attack) {
        (Some(tag), Attack::SubstituteBlock | Attack::ReplayBlock) => {
            blocks(&mut server, &mut client, tag, attack, done, once)
        }
        (None, Attack::RewriteRanks) => http2(&mut server, &mut client, done),
        (_, Attack::Watch) => {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = server.read(&mut buf)?;
                if n == 0 {
                    break Ok(());
                }
                let mut w = seen.lock().unwrap_or_else(|e| e.into_inner());
                if w.len() < 16 << 20 {
                    w.extend_from_slice(&buf[..n]);
                }
                drop(w);
                client.write_all(&buf[..n])?;
            }
        }
        _ => std::io::copy(&mut server, &mut client).map(|_| ()),
    };
    let _ = client.shutdown(std::net::Shutdown::Write);
    r
}

/// The peer's side of a block stream, reply by reply, through the attack.
fn blocks(
    server: &mut TcpStream,
    client: &mut TcpStream,
    tag: usize,
    attack: Attack,
    done: &AtomicU64,
    once: &AtomicBool,
) -> std::io::Result<()> {
    // The handshake: the server's nonce, then (after the caller's proof) its own.
    for n in [wire::NONCE, wire::PROOF] {
        let mut hs = vec![0u8; n];
        server.read_exact(&mut hs)?;
        client.write_all(&hs)?;
    }
    let mut first: Option<(u64, Vec<u8>)> = None;
    let mut replayed = false;
    while let Some(mut head) = wire::read_frame::<proto::BlockHeader, _>(server)? {
        let body_len = if head.code == 0 { head.length } else { 0 };
        let mut body = vec![0u8; body_len as usize];
        server.read_exact(&mut body)?;
        let mut mac = vec![0u8; tag];
        server.read_exact(&mut mac)?;
        if attack == Attack::SubstituteBlock && body_len > 0 && !once.swap(true, Ordering::AcqRel) {
            for b in &mut body[..64] {
                *b ^= 0x5a;
            }
            head.xxh3 = shardcache_daemon::checksum::block_xxh3(&body);
            done.fetch_add(1, Ordering::Relaxed);
        }
        let mut msg = Vec::new();
        wire::write_frame(&mut msg, &head)?;
        msg.extend_from_slice(&body);
        msg.extend_from_slice(&mac);
        if attack == Attack::ReplayBlock && body_len > 0 {
            match &first {
                None => first = Some((body_len, msg.clone())),
                Some((len, earlier)) if *len == body_len && !replayed => {
                    msg = earlier.clone();
                    replayed = true;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Some(_) => {}
            }
        }
        client.write_all(&msg)?;
    }
    Ok(())
}

/// The server's side of an HTTP/2 connection, frame by frame: DATA frames get the
/// ranks rewritten.
fn http2(server: &mut TcpStream, client: &mut TcpStream, done: &AtomicU64) -> std::io::Result<()> {
    // JobRanks.ranks (field 3, packed): [0, 1] → [0, 2].
    const FROM: [u8; 4] = [0x1a, 0x02, 0x00, 0x01];
    const TO: [u8; 4] = [0x1a, 0x02, 0x00, 0x02];
    loop {
        let mut h = [0u8; 9];
        match server.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let mut payload = vec![0u8; len];
        server.read_exact(&mut payload)?;
        if h[3] == 0 {
            let mut i = 0;
            while i + FROM.len() <= payload.len() {
                if payload[i..i + FROM.len()] == FROM {
                    payload[i..i + TO.len()].copy_from_slice(&TO);
                    done.fetch_add(1, Ordering::Relaxed);
                }
                i += 1;
            }
        }
        client.write_all(&h)?;
        client.write_all(&payload)?;
    }
}

/// Starts node `i` listening on `listen`, asking `peers`.
fn node(bed: &Bed, i: usize, listen: &str, peers: &[&str], secret: &str, extra: &[&str]) -> Daemon {
    let file = bed.tmp.path().join(format!("secret-{i}"));
    std::fs::write(&file, secret).expect("secret file");
    let mut args: Vec<String> = vec![
        "--block-size".into(),
        "64KiB".into(),
        "--peer-listen".into(),
        listen.into(),
        "--peer-secret-file".into(),
        file.display().to_string(),
    ];
    for p in peers {
        args.extend(["--peer".into(), (*p).to_owned()]);
    }
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    bed.start_node(i, &args)
}

/// Two nodes: node 0 (the honest peer) and node 1, which reaches node 0 only through a
/// proxy carrying out `attack`; and a file of `blocks` blocks that node 1 sees the
/// proxy's address own (so node 1 asks node 0 for it, through the proxy).
fn proxied_pair(bed: &Bed, attack: Attack, blocks: u64) -> (Vec<Daemon>, Proxy, String, u64) {
    let secret = "peer authentication shared secret";
    let (a0, a1) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let proxy = Proxy::start(a0.clone(), attack);
    let root = bed.backing.display().to_string();
    let rel = (0..200)
        .map(|i| format!("ds/p{i}"))
        .find(|p| {
            shardcache_daemon::peer::file_owner([a1.as_str(), proxy.addr.as_str()], &root, p)
                == Some(proxy.addr.as_str())
        })
        .expect("a file the proxy owns");
    let len = blocks * BLOCK;
    write_file(&bed.path(&rel), 21, len);
    let nodes = vec![
        node(bed, 0, &a0, &[&a1], secret, &[]),
        node(bed, 1, &a1, &[&proxy.addr], secret, &[]),
    ];
    (nodes, proxy, rel, len)
}

/// (a) A man in the middle of the block stream replaces one block's bytes after the
/// handshake and puts the xxh3 of its bytes in the header. The receiver refuses the
/// block (its MAC does not verify), counts it, and the read gets the right bytes from
/// the backing store.
#[test]
fn a_block_substituted_on_the_wire_with_a_matching_checksum_is_refused() {
    let bed = Bed::new();
    let (nodes, proxy, rel, len) = proxied_pair(&bed, Attack::SubstituteBlock, 8);
    let (got, _) = read_all(&bed.node_client(1), &bed.path(&rel)).expect("read");
    let c = nodes[1].counters();
    eprintln!(
        "substituted {}; node 1: from peers {}, peer errors {}, forged {}, backing reads {}",
        proxy.done(),
        c.peer_blocks_in,
        c.peer_errors,
        c.peer_forged,
        c.backing_reads
    );
    assert_eq!(proxy.done(), 1, "the proxy substituted one block");
    assert!(got == content(21, len), "the reader got the true bytes");
    // What node 1 kept is right too.
    let (again, _) = read_all(&bed.node_client(1), &bed.path(&rel)).expect("read");
    assert!(again == content(21, len));
    assert!(c.peer_errors >= 1, "the substituted block was refused");
    assert_eq!(c.peer_forged, 1, "for its MAC, and counted");
    assert!(
        c.backing_reads >= 1,
        "and read from the backing store instead"
    );
    assert_eq!(
        nodes[0].counters().peer_forged,
        0,
        "the requests went through untouched"
    );
}

/// (b) A man in the middle answers a later block request on a connection with an
/// earlier reply of the same connection, recorded (a valid reply, for another block):
/// refused, and the read gets the right bytes.
#[test]
fn a_block_reply_replayed_from_an_earlier_request_is_refused() {
    let bed = Bed::new();
    let (nodes, proxy, rel, len) = proxied_pair(&bed, Attack::ReplayBlock, 32);
    let (got, _) = read_all(&bed.node_client(1), &bed.path(&rel)).expect("read");
    let c = nodes[1].counters();
    eprintln!(
        "replayed {}; node 1: from peers {}, peer errors {}, forged {}, backing reads {}",
        proxy.done(),
        c.peer_blocks_in,
        c.peer_errors,
        c.peer_forged,
        c.backing_reads
    );
    assert!(proxy.done() >= 1, "the proxy replayed a reply");
    assert!(got == content(21, len), "the reader got the true bytes");
    let (again, _) = read_all(&bed.node_client(1), &bed.path(&rel)).expect("read");
    assert!(again == content(21, len));
    assert!(
        c.peer_errors >= proxy.done(),
        "every replayed reply was refused"
    );
    assert_eq!(c.peer_forged, proxy.done(), "for its MAC, and counted");
}

/// (c) A man in the middle rewrites the ranks in another node's `Ranks` reply (which
/// steer the cluster placement): node 0 runs ranks 0 and 1 of a 3-rank job, node 1 runs
/// rank 1. Honestly answered, node 1 never knows a node for rank 2 and places nothing;
/// with the forged reply ("ranks 0 and 2") it would place the job over both nodes. The
/// reply is refused, counted, and nothing is placed.
#[test]
fn a_tampered_ranks_reply_is_refused_and_steers_nothing() {
    let bed = Bed::new();
    let secret = "ranks authentication shared secret";
    let (a0, a1) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let proxy = Proxy::start(a0.clone(), Attack::RewriteRanks);
    let files: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    for i in 0..6 {
        write_file(&bed.path(&format!("ds/s{i}")), i, 2 * BLOCK);
    }
    let nodes = [
        node(&bed, 0, &a0, &[&a1], secret, &[]),
        node(&bed, 1, &a1, &[&proxy.addr], secret, &[]),
    ];
    for (i, ranks) in [(0usize, vec![0u64, 1]), (1, vec![1])] {
        let m = serde_json::json!({
            "version": 1, "job": "train", "root": bed.path("ds"), "files": files,
            "immutable": true,
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 5,
                     "epochs": 2, "world_size": 3, "ranks": ranks}
        });
        bed.node_client(i)
            .register(&m.to_string())
            .expect("register");
    }
    // Node 1 asks for ranks every 100 ms while it knows no node for some rank: wait for
    // 10 tampered replies (bounded: 20 s), watching whether node 1 placed the job.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut placed = 0;
    while proxy.done() < 10 && Instant::now() < deadline {
        let job = nodes[1].status().jobs.into_iter().next().expect("the job");
        placed = placed.max(job.placement_nodes);
        if placed > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let c = nodes[1].counters();
    eprintln!(
        "tampered replies {}; node 1 placed over {placed} nodes; forged {}",
        proxy.done(),
        c.peer_forged
    );
    assert!(proxy.done() >= 1, "the proxy rewrote a reply");
    assert_eq!(
        placed, 0,
        "node 1 took the forged ranks: the job was placed"
    );
    assert!(c.peer_forged >= 1, "the forged replies were counted");
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A file that `me` sees `owner` own when the members are `me` and `owner`.
fn owned_by(bed: &Bed, me: &str, owner: &str, prefix: &str) -> String {
    let root = bed.backing.display().to_string();
    (0..200)
        .map(|i| format!("ds/{prefix}{i}"))
        .find(|p| shardcache_daemon::peer::file_owner([me, owner], &root, p) == Some(owner))
        .expect("a file the owner owns")
}

/// (d) With TLS configured (certificates from files, mutual): two nodes exchange blocks
/// (block stream) and ranks (gRPC) through TLS, and a listener on the path sees none of
/// the block's bytes; a node whose certificate comes from another CA gets nothing, nor
/// does a node without TLS; a certificate that does not verify against the node's own
/// CA file is refused by `--check-config`.
#[test]
fn tls_peers_exchange_blocks_and_refuse_other_cas_and_plaintext() {
    let bed = Bed::new();
    let secret = "peer tls cluster shared secret";
    let (cluster, other) = (Ca::new("cluster"), Ca::new("other"));
    let dir = |n: &str| bed.tmp.path().join(n);
    let a: Vec<String> = (0..4)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    // Node 1 reaches node 0 through a proxy that records what it carries.
    let watch = Proxy::start(a[0].clone(), Attack::Watch);
    let tls0 = cluster.issue(&dir("tls-0"), &[&cluster]).flags();
    let tls1 = cluster.issue(&dir("tls-1"), &[&cluster]).flags();
    // Node 2's certificate is from another CA (it trusts both: its own check passes).
    let tls2 = other.issue(&dir("tls-2"), &[&cluster, &other]).flags();
    let nodes = [
        node(&bed, 0, &a[0], &[&a[1]], secret, &strs(&tls0)),
        node(&bed, 1, &a[1], &[&watch.addr], secret, &strs(&tls1)),
        node(&bed, 2, &a[2], &[&a[0]], secret, &strs(&tls2)),
        node(&bed, 3, &a[3], &[&a[0]], secret, &[]),
    ];
    let len = 6 * BLOCK;

    // Blocks over TLS, checked by their MAC inside it.
    let rel = owned_by(&bed, &a[1], &watch.addr, "t");
    write_file(&bed.path(&rel), 31, len);
    let (got, _) = read_all(&bed.node_client(1), &bed.path(&rel)).expect("read");
    assert!(got == content(31, len), "node 1 read the right bytes");
    let c1 = nodes[1].counters();
    let out0 = nodes[0].counters().peer_blocks_out;
    eprintln!(
        "node 1: from peers {} (errors {}), node 0 sent {out0}",
        c1.peer_blocks_in, c1.peer_errors
    );
    assert_eq!(
        c1.peer_blocks_in, 6,
        "every block came from node 0, over TLS"
    );
    assert_eq!(c1.peer_errors + c1.peer_forged, 0);
    let seen = watch.seen.lock().expect("seen").clone();
    let block = &content(31, len)[..64];
    assert!(seen.len() as u64 > len, "the proxy carried the blocks");
    assert!(
        !seen.windows(block.len()).any(|w| w == block),
        "a listener saw a block's bytes"
    );

    // Ranks over TLS (gRPC): node 1 learns node 0's ranks and places the job.
    for i in 0..6 {
        write_file(&bed.path(&format!("job/s{i}")), 40 + i, BLOCK);
    }
    let files: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    for (i, rank) in [(0usize, 0u64), (1, 1)] {
        let m = serde_json::json!({
            "version": 1, "job": "train", "root": bed.path("job"), "files": files,
            "immutable": true,
            "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 5,
                     "epochs": 2, "world_size": 2, "ranks": [rank]}
        });
        bed.node_client(i)
            .register(&m.to_string())
            .expect("register");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let placed = loop {
        let job = nodes[1].status().jobs.into_iter().next().expect("the job");
        if job.placement_nodes == 2 || Instant::now() > deadline {
            break job.placement_nodes;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(placed, 2, "node 1 got node 0's ranks over TLS");

    // Another CA's certificate, and no TLS at all: nothing from node 0, right bytes.
    let refused0 = nodes[0].counters().peer_refused;
    for (i, prefix) in [(2usize, "o"), (3, "p")] {
        let rel = owned_by(&bed, &a[i], &a[0], prefix);
        write_file(&bed.path(&rel), 50 + i as u64, len);
        let (got, _) = read_all(&bed.node_client(i), &bed.path(&rel)).expect("read");
        assert!(got == content(50 + i as u64, len), "node {i}: right bytes");
        let c = nodes[i].counters();
        eprintln!(
            "node {i}: from peers {}, errors {}, backing reads {}",
            c.peer_blocks_in, c.peer_errors, c.backing_reads
        );
        assert_eq!(c.peer_blocks_in, 0, "node {i} got nothing from node 0");
        assert!(c.peer_errors >= 1, "node {i} tried");
    }
    let c0 = nodes[0].counters();
    eprintln!(
        "node 0: refused {} more callers; sent {} blocks in all",
        c0.peer_refused - refused0,
        c0.peer_blocks_out
    );
    assert!(c0.peer_refused >= refused0 + 2, "node 0 refused both");

    // A certificate its own CA file does not vouch for: the configuration is refused,
    // naming the key.
    let bad = other.issue(&dir("tls-bad"), &[&cluster]).flags();
    let out = std::process::Command::new(shardcache_tests::bin("shardcached"))
        .args(["--backing-root", &bed.backing.display().to_string()])
        .args(["--peer-listen", "127.0.0.1:1", "--peer", "127.0.0.1:2"])
        .args(["--peer-secret-file", &dir("secret-0").display().to_string()])
        .args(&bad)
        .arg("--check-config")
        .output()
        .expect("run shardcached --check-config");
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("--check-config: {err}");
    assert!(
        !out.status.success(),
        "accepted a certificate its CA does not vouch for"
    );
    assert!(err.contains("peer_tls_cert"), "{err}");
}
