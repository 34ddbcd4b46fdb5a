//! The shared-memory link (`link = "shm"`): contexts on one host move their datagrams through
//! rings after a HELLO/ACK over UDP, fall back to UDP for a peer that does not run it, wake a
//! sleeping peer with a doorbell, and carry traffic between two processes.

use netstack::config::LinkMode;
use netstack::verbs::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

struct Side {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn side(link: LinkMode) -> Side {
    let ctx = Context::open(ContextConfig {
        link,
        // these tests are about the rings: WRITEs and READs go through them as packets
        same_host_copy: false,
        ..Default::default()
    })
    .unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let mr = pd.reg_mr(4 << 20, Access::ALL).unwrap();
    Side {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

fn pair(a: LinkMode, b: LinkMode) -> (Side, Side) {
    let (a, b) = (side(a), side(b));
    a.qp.connect(&b.qp.local_endpoint()).unwrap();
    b.qp.connect(&a.qp.local_endpoint()).unwrap();
    (a, b)
}

/// The most rings one side of a pair may have sent through: one per source port a path of
/// either QP used (requests leave from the path's port, and the answers to them from the
/// answering side's port of the same index). A path starts on the main port and moves to a
/// spare port at a timeout while no answer came (one at the first READ when the peer
/// connects late, or a long stall on a loaded machine).
fn rings_for(sides: &[&Side]) -> u64 {
    1 + sides
        .iter()
        .flat_map(|s| s.qp.path_stats())
        .map(|p| p.repaths as u64)
        .sum::<u64>()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// WRITEs `len` fresh bytes from `a` into `b`, READs them back into `a` at offset `len`, and
/// SENDs 64 bytes; checks every byte and completion.
fn round(a: &Side, b: &Side, len: usize, seed: u8) {
    let data = pattern(len, seed);
    a.mr.write(0, &data);
    b.mr.region().fill(0, len, !seed);
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, len))
            .remote(b.mr.addr(), b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(a.cq.next(T).expect("write completion").status, WcStatus::Success);
    assert!(b.mr.region().equals(0, &data), "the WRITE landed");
    a.qp.post_send(
        SendWr::new(2, WrOpcode::RdmaRead)
            .sge(a.mr.sge(len, len))
            .remote(b.mr.addr(), b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(a.cq.next(T).expect("read completion").status, WcStatus::Success);
    assert!(a.mr.region().equals(len, &data), "the READ returned the bytes");
    b.qp.post_recv(RecvWr {
        wr_id: 3,
        sg_list: [b.mr.sge(2 * len, 64)].into_iter().collect(),
    })
    .unwrap();
    a.qp.post_send(SendWr::new(4, WrOpcode::Send).sge(a.mr.sge(0, 64)))
        .unwrap();
    assert_eq!(a.cq.next(T).expect("send completion").status, WcStatus::Success);
    let wc = b.cq.next(T).expect("recv completion");
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 64));
    assert!(b.mr.region().equals(2 * len, &data[..64]));
}

#[test]
fn same_host_contexts_move_datagrams_through_rings() {
    let (a, b) = pair(LinkMode::Shm, LinkMode::Shm);
    // the first round's datagrams go over UDP until each side has read its HELLO's ACK (late
    // on a loaded machine); the rounds after it go through the rings
    let mut first = None;
    for (i, len) in [1 << 20, 4096, 100_000, 1 << 20].into_iter().enumerate() {
        round(&a, &b, len, i as u8);
        round(&b, &a, len, 100 + i as u8);
        first.get_or_insert((a.ctx.stats(), b.ctx.stats()));
    }
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    let (fa, fb) = first.unwrap();
    let rings = rings_for(&[&a, &b]);
    for (s, f) in [(&sa, &fa), (&sb, &fb)] {
        assert!((1..=rings).contains(&s.shm_peers), "{s:?}");
        // most sends after the first round went through a ring (a path that moved to a spare
        // port sends its first datagrams from there over UDP)
        let (ring, all) = (s.shm_tx_messages - f.shm_tx_messages, s.tx_messages - f.tx_messages);
        assert!(2 * ring >= all && s.shm_rx_messages > f.shm_rx_messages, "{f:?}\n{s:?}");
        assert_eq!((s.rx_bad_icrc, s.rx_malformed), (0, 0), "{s:?}");
    }
    // the rings carried what one side sent and the other received
    assert!(sa.shm_tx_messages <= sb.shm_rx_messages + 1 && sb.shm_tx_messages <= sa.shm_rx_messages + 1);
    // the same counters on the Prometheus endpoint
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    netstack::telemetry::serve_prometheus(format!("127.0.0.1:{port}").parse().unwrap()).unwrap();
    netstack::telemetry::collect_now();
    let mut http = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    std::io::Read::read_to_string(&mut http, &mut page).unwrap();
    let ctx = a.qp.local_endpoint().addr.to_string();
    let value = |metric: &str, label: &str| -> f64 {
        page.lines()
            .find(|l| l.starts_with(metric) && l.contains(&format!("context=\"{ctx}\"")) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {metric} {label} for {ctx} in:\n{page}"))
    };
    // (late ACKs may have moved the counters since the snapshot above)
    assert!(value("flexns_shm_messages_total", "direction=\"tx\"") >= sa.shm_tx_messages as f64);
    assert!(value("flexns_shm_messages_total", "direction=\"rx\"") >= sa.shm_rx_messages as f64);
    assert!((1.0..=rings as f64).contains(&value("flexns_shm_peers", "")));
    // the names of the ring files are gone once both ends mapped them (a ring the last rounds
    // opened may still wait for its HELLO on a loaded machine: the cores are still running)
    let left = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("flexns-shm-{}-", std::process::id())))
            .collect()
    };
    let until = std::time::Instant::now() + T;
    while !left().is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(left().is_empty(), "ring files left: {:?}", left());
}

#[test]
fn a_udp_peer_is_reached_over_udp() {
    let (a, b) = pair(LinkMode::Shm, LinkMode::Udp);
    for i in 0..3 {
        round(&a, &b, 200_000, i);
        round(&b, &a, 200_000, 50 + i);
    }
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    assert_eq!(
        (sa.shm_peers, sa.shm_tx_messages, sa.shm_rx_messages),
        (0, 0, 0),
        "{sa:?}"
    );
    // the HELLOs reached a plain UDP engine, which dropped them as malformed
    assert!(sb.rx_malformed >= 1, "{sb:?}");
}

#[test]
fn a_sleeping_peer_is_woken_by_a_doorbell() {
    let (a, b) = pair(LinkMode::Shm, LinkMode::Shm);
    round(&a, &b, 4096, 1);
    for i in 0..5u8 {
        // both cores go idle past their spin time and sleep on their sockets
        std::thread::sleep(Duration::from_millis(30));
        round(&a, &b, 4096, i);
    }
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    assert!(sa.shm_doorbells + sb.shm_doorbells >= 5, "{sa:?} {sb:?}");
    assert!(sa.shm_tx_messages > 0 && sb.shm_tx_messages > 0);
}

#[test]
fn two_processes_share_rings() {
    if std::env::var_os(CHILD).is_some() {
        return child_side().unwrap();
    }
    // the other process is this test binary again, running this test as the child
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "two_processes_share_rings",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    let a = side(LinkMode::Shm);
    // the child's endpoint and memory key, one line each way
    let line = peer_says(&mut out, "PEER ");
    let (ep, addr, rkey) = peer_line(&line).unwrap();
    a.qp.connect(&ep).unwrap();
    writeln!(stdin, "{}", my_line(&a.qp.local_endpoint(), a.mr.addr(), a.mr.rkey())).unwrap();
    // small READs until the handshake over UDP has put this side's requests on a ring
    reads_until_requests_take_a_ring(&a.ctx, &a.qp, &a.cq, a.mr.sge(2 << 20, 8), addr, rkey).unwrap();
    // WRITE 1 MiB of fresh bytes into the child, then SEND its length; the child WRITEs the
    // same range back into this process at offset 1 MiB and SENDs back
    let len = 1 << 20;
    let data = pattern(len, 42);
    a.mr.write(0, &data);
    a.mr.region().fill(len, len, 0);
    a.qp.post_recv(RecvWr {
        wr_id: 9,
        sg_list: [a.mr.sge(3 << 20, 64)].into_iter().collect(),
    })
    .unwrap();
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, len))
            .remote(addr, rkey),
    )
    .unwrap();
    a.qp.post_send(SendWr::new(2, WrOpcode::Send).sge(a.mr.sge(0, 8)))
        .unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        let wc = a.cq.next(T).expect("completion");
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        got.push(wc.wr_id);
    }
    got.sort();
    assert_eq!(got, [1, 2, 9]);
    assert!(
        a.mr.region().equals(len, &data),
        "the child's WRITE carried the bytes back"
    );
    drop(stdin);
    let rest = peer_says(&mut out, "shm_rx_messages ");
    assert!(child.wait().unwrap().success());
    let s = a.ctx.stats();
    // (at most one ring per port either side's path used: the child's moves are not seen here)
    assert!(s.shm_peers >= 1, "{s:?}");
    assert!(
        s.shm_tx_messages > 10 && s.shm_rx_messages > 10,
        "{s:?} {:?}; the child: {rest}",
        a.qp.path_stats()
    );
    // the child's own count: ring messages it received
    let child_rx: u64 = rest.split_whitespace().next().unwrap().parse().unwrap();
    assert!(child_rx > 10, "child: {rest}");
}

/// A side's line: its QP's whole endpoint (JSON: the peer accepts packets from every source
/// port it names, and a path that moves to a spare port sends from one), its memory's address
/// and its rkey.
fn my_line(ep: &Endpoint, addr: u64, rkey: u32) -> String {
    format!("{} {addr} {rkey}", serde_json::to_string(ep).unwrap())
}

/// Reads [`my_line`]'s fields back.
fn peer_line(line: &str) -> Result<(Endpoint, u64, u32), Box<dyn std::error::Error>> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != 3 {
        return Err(format!("bad peer line {line:?}").into());
    }
    Ok((serde_json::from_str(f[0])?, f[1].parse()?, f[2].parse()?))
}

/// Set in the child process of [`two_processes_share_rings`].
const CHILD: &str = "FLEXNS_SHM_LINK_CHILD";

/// Reads the child's output up to the line holding `tag` (the test harness prints its
/// own lines too); returns what follows the tag.
fn peer_says(out: &mut impl BufRead, tag: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child ended before saying {tag:?}"
        );
        // the harness may have begun the line ("test NAME ... ")
        if let Some(at) = line.find(tag) {
            return line[at + tag.len()..].to_string();
        }
    }
}

/// The child: a context with `link = "shm"` that prints its QP's endpoint and memory key
/// (`PEER` and [`my_line`]), reads the test's line (the same fields),
/// waits for the test's WRITE and SEND, WRITEs the same bytes back to the test at offset
/// 1 MiB, SENDs, and prints how many messages it received through rings once its stdin closes.
/// Posts small READs until one went out through a ring: every message this context sent
/// while it was in flight was a ring message. (A ring to the peer alone is not enough: answers
/// leave from the port the peer's requests came from, so after a path of the peer's moved, the
/// first ring may carry only the answers, and this side's requests still go over UDP.)
fn reads_until_requests_take_a_ring(
    ctx: &Context,
    qp: &Qp,
    cq: &Cq,
    into: Sge,
    addr: u64,
    rkey: u32,
) -> Result<(), String> {
    for _ in 0..1000 {
        let before = ctx.stats();
        qp.post_send(SendWr::new(100, WrOpcode::RdmaRead).sge(into).remote(addr, rkey))
            .map_err(|e| e.to_string())?;
        let wc = cq.next(T).ok_or("no READ completion")?;
        if wc.status != WcStatus::Success {
            return Err(format!("READ: {wc:?}"));
        }
        let after = ctx.stats();
        let sent = after.tx_messages - before.tx_messages;
        if sent >= 1 && after.shm_tx_messages - before.shm_tx_messages == sent {
            return Ok(());
        }
    }
    Err(format!("no ring to the peer: {:?}", ctx.stats()))
}

fn child_side() -> Result<(), Box<dyn std::error::Error>> {
    let t = Duration::from_secs(10);
    let ctx = Context::open(ContextConfig {
        link: LinkMode::Shm,
        ..Default::default()
    })?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64)?;
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default())?;
    let mr = pd.reg_mr(2 << 20, Access::ALL)?;
    println!("PEER {}", my_line(&qp.local_endpoint(), mr.addr(), mr.rkey()));
    let mut lines = std::io::stdin().lock().lines();
    let line = lines.next().ok_or("no peer line")??;
    let (peer, addr, rkey) = peer_line(&line)?;
    qp.post_recv(RecvWr {
        wr_id: 1,
        sg_list: [mr.sge(1 << 20, 64)].into_iter().collect(),
    })?;
    qp.connect(&peer)?;
    let wc = cq.next(t).ok_or("no SEND from the test")?;
    if wc.status != WcStatus::Success {
        return Err(format!("receive: {wc:?}").into());
    }
    // small READs until this side's requests go through a ring too
    reads_until_requests_take_a_ring(&ctx, &qp, &cq, mr.sge(1 << 20, 8), addr, rkey)?;
    // the SEND came after the WRITE: the first MiB holds the test's bytes
    qp.post_send(
        SendWr::new(2, WrOpcode::RdmaWrite)
            .sge(mr.sge(0, 1 << 20))
            .remote(addr + (1 << 20), rkey),
    )?;
    qp.post_send(SendWr::new(3, WrOpcode::Send).sge(mr.sge(0, 8)))?;
    for _ in 0..2 {
        let wc = cq.next(t).ok_or("no completion")?;
        if wc.status != WcStatus::Success {
            return Err(format!("send: {wc:?}").into());
        }
    }
    // wait for the test to finish with this process
    for l in lines {
        l?;
    }
    let st = ctx.stats();
    println!("shm_rx_messages {} {st:?} {:?}", st.shm_rx_messages, qp.path_stats());
    Ok(())
}
