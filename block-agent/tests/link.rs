//! A link follows its storage node to a new address (the node restarted elsewhere on the same
//! data): a read sent while the node was down is sent again to the new address and answered
//! with the data written before the restart, and the link goes on serving there. Over both
//! carriers; the TCP link on the test's runtime (as the agent runs it) and on a thread of its
//! own (opened outside a runtime).

use block_agent::link::{Carrier, Link, LinkConfig, LinkError, Reply, Target};
use block_agent::storage_node::{NodeConfig, StorageNode};
use std::sync::Arc;
use std::time::Duration;

const BLOCK: usize = 4096;
const VOLUME: u32 = 1;

fn block(seed: u8) -> Arc<[u8]> {
    (0..BLOCK).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

fn at(lba: u64) -> Target {
    Target {
        volume: VOLUME,
        lba,
        epoch: 0,
    }
}

/// The answer to a link request, within 20 s.
fn wait<T>(rt: &tokio::runtime::Runtime, tag: &str, what: &str, r: Reply<T>) -> Result<T, LinkError> {
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(20), r).await })
        .unwrap_or_else(|_| panic!("{tag}: {what}: no answer within 20 s"))
        .unwrap_or_else(|_| panic!("{tag}: {what}: dropped unanswered"))
}

fn follows(carrier: Carrier, tag: &str, in_runtime: bool) {
    let dir = std::env::temp_dir().join(format!("link-move-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let node = StorageNode::start(NodeConfig::new(&dir)).unwrap();
    node.create_volume(VOLUME, 64 * BLOCK as u64).unwrap();
    let rt = test_support::runtime();
    let link = {
        let _g = in_runtime.then(|| rt.enter());
        Link::start(LinkConfig::new(node.addr(), carrier)).unwrap()
    };
    let a = block(1);
    wait(&rt, tag, "the first write", link.write(at(3), a.clone(), false, 1)).unwrap();
    let old = node.addr();
    drop(node);
    // sent toward the node that is gone: it waits for the link to find the node again
    let pending = link.read(at(3), 1);
    let node = StorageNode::start(NodeConfig::new(&dir)).unwrap();
    assert_ne!(node.addr(), old, "{tag}: the node came back on another port");
    link.retarget(node.addr());
    assert_eq!(link.server(), node.addr());
    let got = wait(&rt, tag, "the read sent before the move", pending).unwrap();
    assert!(got[..] == a[..], "{tag}: the block written before the restart");
    let b = block(2);
    wait(
        &rt,
        tag,
        "a write after the move",
        link.write(at(4), b.clone(), false, 2),
    )
    .unwrap();
    let got = wait(&rt, tag, "a read after the move", link.read(at(4), 1)).unwrap();
    assert!(got[..] == b[..], "{tag}: the block written after the move");
    drop(link);
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tcp_link_follows_its_node_to_a_new_address() {
    follows(Carrier::Tcp, "tcp-rt", true);
    follows(Carrier::Tcp, "tcp-thread", false);
}

#[test]
fn a_solar_link_follows_its_node_to_a_new_address() {
    follows(Carrier::Udp { paths: 2 }, "udp", true);
}
