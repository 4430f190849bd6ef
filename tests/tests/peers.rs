//! Peers: several real daemons on loopback addresses sharing one backing root (the
//! shared file system), as the nodes of a cluster.
#![allow(clippy::unwrap_used)]

use shardcache_tests::{Bed, Daemon, content, read_all, write_file};

const BLOCK: u64 = 64 << 10;

/// A free TCP port on 127.0.0.1 (bound and released: the daemon binds it next).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `n` nodes that list each other; `secrets[i]` is node i's secret.
fn cluster(bed: &Bed, secrets: &[&str]) -> (Vec<Daemon>, Vec<String>) {
    let ports: Vec<u16> = secrets.iter().map(|_| free_port()).collect();
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let mut nodes = Vec::new();
    for (i, secret) in secrets.iter().enumerate() {
        let file = bed.tmp.path().join(format!("secret-{i}"));
        std::fs::write(&file, secret).unwrap();
        let mut args: Vec<String> = vec![
            "--block-size".into(),
            "64KiB".into(),
            "--peer-listen".into(),
            addrs[i].clone(),
            "--peer-secret-file".into(),
            file.display().to_string(),
        ];
        for (j, a) in addrs.iter().enumerate() {
            if j != i {
                args.extend(["--peer".into(), a.clone()]);
            }
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        nodes.push(bed.start_node(i, &args));
    }
    (nodes, addrs)
}

fn total(nodes: &[Daemon], f: impl Fn(&shardcache_client::proto::Counters) -> u64) -> u64 {
    nodes.iter().map(|d| f(&d.counters())).sum()
}

#[test]
fn three_nodes_read_the_backing_store_once_per_block() {
    let bed = Bed::new();
    let secret = "correct horse battery staple";
    let (nodes, _) = cluster(&bed, &[secret, secret, secret]);
    let len = 16 * BLOCK + 123;
    let nblocks = len.div_ceil(BLOCK);
    write_file(&bed.path("ds/shard-0"), 1, len);
    for (i, _) in nodes.iter().enumerate() {
        let (got, _) = read_all(&bed.node_client(i), &bed.path("ds/shard-0")).unwrap();
        assert!(got == content(1, len), "node {i}: wrong bytes");
    }
    let backing = total(&nodes, |c| c.backing_reads);
    let from_peers = total(&nodes, |c| c.peer_blocks_in);
    let fallback = total(&nodes, |c| c.fallback_bytes);
    eprintln!(
        "backing reads {backing}, blocks from peers {from_peers}, client fallback bytes {fallback}"
    );
    assert_eq!(
        backing, nblocks,
        "each block read from the backing store once, by its owner"
    );
    assert_eq!(fallback, 0);
    assert!(from_peers >= nblocks, "most blocks came from their owners");
    assert_eq!(total(&nodes, |c| c.peer_refused + c.peer_errors), 0);
    // Every node knows the three, all healthy.
    let st = nodes[0].status();
    assert_eq!(st.peers.len(), 3, "{:?}", st.peers);
    assert!(st.peers.iter().all(|p| p.healthy));
}

#[test]
fn a_node_without_the_secret_gets_nothing_and_still_reads_right() {
    let bed = Bed::new();
    let good = "the cluster's real shared secret";
    let (nodes, _) = cluster(&bed, &[good, good, "an impostor's wrong secret!"]);
    let len = 12 * BLOCK;
    write_file(&bed.path("ds/f"), 2, len);
    let (got, _) = read_all(&bed.node_client(2), &bed.path("ds/f")).unwrap();
    assert!(
        got == content(2, len),
        "the impostor's own client still reads right"
    );
    let refused: u64 = nodes[..2].iter().map(|d| d.counters().peer_refused).sum();
    let served: u64 = nodes[..2]
        .iter()
        .map(|d| d.counters().peer_blocks_out)
        .sum();
    eprintln!("refused {refused}, served {served}");
    assert!(refused >= 1, "the honest nodes refused the impostor");
    assert_eq!(served, 0, "and served it nothing");
    assert_eq!(nodes[2].counters().peer_blocks_in, 0);
}

#[test]
fn a_killed_node_costs_no_read_and_the_cluster_converges_when_it_returns() {
    let bed = Bed::new();
    let secret = "another long enough shared secret";
    let (mut nodes, _) = cluster(&bed, &[secret, secret, secret]);
    let files: Vec<(String, u64)> = (0..6)
        .map(|i| (format!("ds/part-{i}"), 4 * BLOCK + i))
        .collect();
    for (i, (p, len)) in files.iter().enumerate() {
        write_file(&bed.path(p), 10 + i as u64, *len);
    }
    // Node 0 reads half, node 2 dies, node 0 reads the rest and node 1 everything.
    for (i, (p, len)) in files.iter().enumerate().take(3) {
        let (got, _) = read_all(&bed.node_client(0), &bed.path(p)).unwrap();
        assert!(got == content(10 + i as u64, *len));
    }
    nodes[2].kill9();
    for node in [0, 1] {
        for (i, (p, len)) in files.iter().enumerate() {
            let (got, _) = read_all(&bed.node_client(node), &bed.path(p)).unwrap();
            assert!(
                got == content(10 + i as u64, *len),
                "node {node}, {p}: wrong bytes"
            );
        }
    }
    assert!(
        nodes[0].counters().peer_errors >= 1,
        "node 2's blocks were tried there first"
    );
    // It comes back (empty cache would be the same; here its cache survived): the
    // others take it in again on their next exchange with it.
    nodes[2].restart();
    for (i, (p, len)) in files.iter().enumerate() {
        let (got, _) = read_all(&bed.node_client(2), &bed.path(p)).unwrap();
        assert!(got == content(10 + i as u64, *len));
    }
    let st = nodes[2].status();
    assert_eq!(st.peers.len(), 3);
}
