//! End to end: three storage nodes, an agent exporting a 3-replica volume over NBD, driven by
//! a raw NBD client (protocol errors, out-of-range requests, a bad magic on one connection while
//! another keeps working) and by real clients (qemu-io, qemu-img convert) for data integrity;
//! then a corrupted block on one replica is read through failover and repaired.

use block_agent::link::{Carrier, Link, LinkConfig};
use block_agent::nbd::proto::*;
use block_agent::nbd::server::{serve_tcp, Exports};
use block_agent::storage_node::{NodeConfig, StorageNode};
use block_agent::volume::{Volume, VolumeConfig};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

const SIZE: u64 = 64 << 20;

struct Cluster {
    nodes: Vec<StorageNode>,
    nbd: SocketAddr,
    volume: Arc<Volume>,
    exports: Arc<Exports>,
    rt: tokio::runtime::Runtime,
    dir: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn cluster(tag: &str, replicas: usize, carrier: Carrier) -> Cluster {
    let dir = std::env::temp_dir().join(format!("nbd-e2e-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let nodes: Vec<StorageNode> = (0..replicas)
        .map(|i| {
            let n = StorageNode::start(NodeConfig::new(dir.join(format!("node{i}")))).unwrap();
            n.create_volume(7, SIZE).unwrap();
            n
        })
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let links = nodes
        .iter()
        .map(|n| Arc::new(Link::start(LinkConfig::new(n.addr(), carrier)).unwrap()))
        .collect();
    let volume = Volume::new(7, SIZE, links, VolumeConfig::default());
    let exports = Exports::new();
    exports.insert("vol", volume.clone());
    let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let nbd = l.local_addr().unwrap();
    rt.spawn(serve_tcp(exports.clone(), l));
    Cluster {
        nodes,
        nbd,
        volume,
        exports,
        rt,
        dir,
    }
}

/// A minimal NBD client (fixed newstyle, GO, optional structured replies).
struct Raw {
    s: TcpStream,
}

impl Raw {
    fn connect(addr: SocketAddr, export: &str, structured: bool) -> Result<(Raw, u64), String> {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).unwrap();
        assert_eq!(u64::from_be_bytes(hello[0..8].try_into().unwrap()), NBDMAGIC);
        assert_eq!(u64::from_be_bytes(hello[8..16].try_into().unwrap()), IHAVEOPT);
        s.write_all(&3u32.to_be_bytes()).unwrap();
        let mut raw = Raw { s };
        if structured {
            let (typ, _) = raw.option(OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(typ, REP_ACK);
        }
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        raw.s.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
        raw.s.write_all(&OPT_GO.to_be_bytes()).unwrap();
        raw.s.write_all(&(d.len() as u32).to_be_bytes()).unwrap();
        raw.s.write_all(&d).unwrap();
        let mut size = 0;
        loop {
            let (typ, data) = raw.reply();
            match typ {
                REP_INFO if u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT => {
                    size = u64::from_be_bytes(data[2..10].try_into().unwrap());
                    let flags = u16::from_be_bytes([data[10], data[11]]);
                    assert_eq!(flags, EXPORT_FLAGS);
                }
                REP_INFO => {}
                REP_ACK => return Ok((raw, size)),
                e => return Err(format!("GO refused: {e:#x} {}", String::from_utf8_lossy(&data))),
            }
        }
    }

    fn option(&mut self, opt: u32, data: &[u8]) -> (u32, Vec<u8>) {
        self.s.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
        self.s.write_all(&opt.to_be_bytes()).unwrap();
        self.s.write_all(&(data.len() as u32).to_be_bytes()).unwrap();
        self.s.write_all(data).unwrap();
        self.reply()
    }

    fn reply(&mut self) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(u64::from_be_bytes(h[0..8].try_into().unwrap()), REPLY_MAGIC);
        let typ = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).unwrap();
        (typ, d)
    }

    fn send(&mut self, typ: u16, flags: u16, handle: u64, offset: u64, length: u32, data: &[u8]) {
        let r = Request {
            flags,
            typ,
            handle,
            offset,
            length,
        };
        self.s.write_all(&r.encode()).unwrap();
        self.s.write_all(data).unwrap();
    }

    /// A simple reply: (handle, error), reading `read_len` data bytes on success.
    fn simple(&mut self, read_len: usize) -> (u64, u32, Vec<u8>) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), SIMPLE_REPLY_MAGIC);
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let handle = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let mut d = Vec::new();
        if err == 0 && read_len > 0 {
            d = vec![0u8; read_len];
            self.s.read_exact(&mut d).unwrap();
        }
        (handle, err, d)
    }
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn raw_client_gets_nbd_errors_and_the_agent_keeps_serving() {
    let c = cluster("raw", 1, Carrier::Udp { paths: 4 });
    assert!(
        Raw::connect(c.nbd, "nope", false).is_err(),
        "an unknown export is refused"
    );
    let (mut a, size) = Raw::connect(c.nbd, "vol", false).unwrap();
    assert_eq!(size, SIZE);
    let block: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 251) as u8).collect();
    a.send(CMD_WRITE, CMD_FLAG_FUA, 1, 4096, 8192, &block);
    assert_eq!(a.simple(0), (1, 0, vec![]));
    a.send(CMD_READ, 0, 2, 4096, 8192, &[]);
    assert_eq!(a.simple(8192), (2, 0, block.clone()));
    // unaligned write and read (read-modify-write of the edge blocks)
    a.send(CMD_WRITE, 0, 3, 4096 + 100, 5, b"hello");
    assert_eq!(a.simple(0).1, 0);
    a.send(CMD_READ, 0, 4, 4096 + 98, 9, &[]);
    let mut want = block[98..107].to_vec();
    want[2..7].copy_from_slice(b"hello");
    assert_eq!(a.simple(9).2, want);
    // out of range and malformed requests get their errors; the connection goes on
    a.send(CMD_READ, 0, 5, SIZE - 4096, 8192, &[]);
    assert_eq!(a.simple(0).1, EINVAL);
    a.send(CMD_WRITE, 0, 6, SIZE, 4096, &block[..4096]);
    assert_eq!(a.simple(0).1, ENOSPC);
    a.send(42, 0, 7, 0, 4096, &[]);
    assert_eq!(a.simple(0).1, EINVAL);
    a.send(CMD_READ, CMD_FLAG_FUA, 8, 0, 4096, &[]);
    assert_eq!(a.simple(0).1, EINVAL);
    // zeroing is fast (deallocated), except when the zeros must stay allocated
    a.send(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE, 9, 0, 4096, &[]);
    assert_eq!(a.simple(0).1, ENOTSUP);
    a.send(CMD_WRITE_ZEROES, 0, 10, 4096, 4096, &[]);
    assert_eq!(a.simple(0).1, 0);
    a.send(CMD_FLUSH, 0, 11, 0, 0, &[]);
    assert_eq!(a.simple(0).1, 0);
    a.send(CMD_READ, 0, 12, 4096, 8192, &[]);
    let got = a.simple(8192).2;
    assert!(got[..4096].iter().all(|&b| b == 0), "zeroed");
    assert_eq!(&got[4096..], &block[4096..]);
    // a second client, then garbage on the first: only the first connection closes
    let (mut b, _) = Raw::connect(c.nbd, "vol", true).unwrap();
    a.s.write_all(&[0xde; 28]).unwrap();
    let mut buf = [0u8; 1];
    a.s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    assert_eq!(a.s.read(&mut buf).unwrap_or(0), 0, "the bad connection is closed");
    // structured read on the second connection
    b.send(CMD_READ, 0, 13, 8192, 4096, &[]);
    let mut h = [0u8; 20];
    b.s.read_exact(&mut h).unwrap();
    assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), STRUCTURED_REPLY_MAGIC);
    assert_eq!(u16::from_be_bytes([h[6], h[7]]), CHUNK_OFFSET_DATA);
    let mut d = vec![0u8; 8 + 4096];
    b.s.read_exact(&mut d).unwrap();
    assert_eq!(&d[8..], &block[4096..]);
    b.send(CMD_READ, 0, 14, SIZE, 4096, &[]);
    b.s.read_exact(&mut h).unwrap();
    assert_eq!(u16::from_be_bytes([h[6], h[7]]), CHUNK_ERROR);
    let mut d = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
    b.s.read_exact(&mut d).unwrap();
    assert_eq!(u32::from_be_bytes(d[0..4].try_into().unwrap()), EINVAL);
    assert!(c.exports.stats.bad_magic.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    drop(b);
}

/// A client that asks for far more than its budget and reads nothing back is held at its
/// budget (the agent stops reading its requests; its memory stays bounded), while another
/// connection is served; once it reads, every one of its requests is answered.
#[test]
fn a_flooding_connection_waits_at_its_budget_and_others_are_served() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = cluster("flood", 1, Carrier::Udp { paths: 4 });
    let budget = c.exports.max_inflight_bytes();
    let (mut a, _) = Raw::connect(c.nbd, "vol", false).unwrap();
    const READ: u32 = 8 << 20;
    let n = 2 * budget / READ as usize + 4; // twice the budget, and more
    for h in 0..n as u64 {
        a.send(CMD_READ, 0, h, (h * READ as u64) % (SIZE - READ as u64), READ, &[]);
    }
    // wait until the agent stops taking A's requests
    let mut last = u64::MAX;
    let t = std::time::Instant::now();
    loop {
        std::thread::sleep(std::time::Duration::from_millis(300));
        let now = c.exports.stats.requests.load(Relaxed);
        if now == last || t.elapsed().as_secs() > 20 {
            break;
        }
        last = now;
    }
    let taken = c.exports.stats.requests.load(Relaxed) as usize;
    assert!(
        taken <= budget / READ as usize + 1,
        "{taken} of A's {n} requests taken with a budget of {budget} B (its replies unread)"
    );
    assert!(c.exports.stats.throttled.load(Relaxed) >= 1, "A waited for its budget");
    // another connection is served meanwhile
    let (mut b, _) = Raw::connect(c.nbd, "vol", false).unwrap();
    let block: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 253) as u8).collect();
    let t = std::time::Instant::now();
    b.send(CMD_WRITE, 0, 1, 0, 4096, &block);
    assert_eq!(b.simple(0), (1, 0, vec![]));
    b.send(CMD_READ, 0, 2, 0, 4096, &[]);
    assert_eq!(b.simple(4096), (2, 0, block.clone()));
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "B waited {:?} behind A's flood",
        t.elapsed()
    );
    // A reads: every request answered, none dropped
    let mut seen = vec![false; n];
    for _ in 0..n {
        let (h, err, d) = a.simple(READ as usize);
        assert_eq!((err, d.len()), (0, READ as usize));
        seen[h as usize] = true;
    }
    assert!(seen.iter().all(|&x| x), "every request answered");
}

fn random_image(path: &std::path::Path, bytes: usize, seed: u64) {
    let mut x = seed | 1;
    let data: Vec<u8> = (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(path, data).unwrap();
}

fn run(cmd: &mut Command) {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn integrity(carrier: Carrier, tag: &str) {
    if !have("qemu-img") {
        test_support::skip(
            &format!("nbd integrity {tag}"),
            test_support::Missing::Tool,
            "qemu-img is not installed (scripts/install-test-deps.sh installs qemu-utils)",
        );
        return;
    }
    let c = cluster(tag, 3, carrier);
    let uri = format!("nbd://{}/vol", c.nbd);
    let input = c.dir.join("in.img");
    let output = c.dir.join("out.img");
    // data of this run's own (the stores are new, but the pattern must not be a constant)
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    random_image(&input, SIZE as usize, seed);
    let diag = || {
        for (l, n) in c.volume.replicas().iter().zip(&c.nodes) {
            eprintln!(
                "link {:?}\nnode {:?} {:?} {:?}",
                l.status(),
                n.solar_stats(),
                n.counters(),
                n.store(7).unwrap().stats()
            );
        }
    };
    let o = Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&input)
        .arg(&uri)
        .output()
        .unwrap();
    if !o.status.success() {
        diag();
        panic!(
            "qemu-img convert into the volume failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &uri])
        .arg(&output));
    assert!(
        std::fs::read(&input).unwrap() == std::fs::read(&output).unwrap(),
        "image read back differs"
    );
    // every replica has it
    for n in &c.nodes {
        let s = n.store(7).unwrap();
        let data = std::fs::read(&input).unwrap();
        for lba in [0u64, 1, 4095, SIZE / 4096 - 1] {
            let (b, _, _) = s.read(lba).unwrap();
            assert_eq!(
                &b[..],
                &data[(lba * 4096) as usize..][..4096],
                "replica {} block {lba}",
                n.addr()
            );
        }
    }
    if !have("qemu-io") {
        test_support::skip(
            &format!("nbd integrity {tag} through qemu-io"),
            test_support::Missing::Tool,
            "qemu-io is not installed (scripts/install-test-deps.sh installs qemu-utils)",
        );
    } else {
        run(Command::new("qemu-io").args([
            "-f",
            "raw",
            &uri,
            "-c",
            "write -P 0xab 4096 8192",
            "-c",
            "read -P 0xab 4096 8192",
            "-c",
            "flush",
            "-c",
            "discard 1M 64k",
            "-c",
            "read -P 0 1M 64k",
            "-c",
            "write -z 2M 64k",
            "-c",
            "read -P 0 2M 64k",
        ]));
    }
}

#[test]
fn qemu_img_round_trip_over_solar_with_three_replicas() {
    integrity(Carrier::Udp { paths: 4 }, "solar");
}

#[test]
fn qemu_img_round_trip_over_tcp_with_three_replicas() {
    integrity(Carrier::Tcp, "tcp");
}

#[test]
fn a_corrupt_replica_block_is_read_from_another_and_repaired() {
    let c = cluster("repair", 3, Carrier::Udp { paths: 2 });
    let data: Vec<u8> = (0..4096u32 * 4).map(|i| (i % 253) as u8).collect();
    let v = c.volume.clone();
    c.rt.block_on(v.write(0, &data, true)).unwrap();
    // the write was acknowledged by a quorum (2 of 3): wait until the third copy landed too,
    // or a read would skip that replica as not yet clean and find only the damaged copies
    c.rt.block_on(v.quiesced(async {})).unwrap();
    // damage block 2 in every replica's data file except the last one; reads must still
    // return the good data and the damaged copies must be rewritten
    for n in &c.nodes[..2] {
        n.store(7).unwrap().checkpoint().unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(c.dir.join(format!(
                "node{}/vol-7.data",
                c.nodes.iter().position(|m| m.addr() == n.addr()).unwrap()
            )))
            .unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(&[0xFF; 16], 2 * 4096 + 100).unwrap();
    }
    for _ in 0..3 {
        let got = c.rt.block_on(v.read(0, data.len() as u64)).unwrap();
        assert!(got == data, "read returns the good copy");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let ok = c.nodes.iter().all(|n| n.store(7).unwrap().read(2).is_ok());
        if ok {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "damaged replicas were not repaired"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(v.counters().repairs.load(std::sync::atomic::Ordering::Relaxed) >= 1);
}
