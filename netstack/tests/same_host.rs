//! The same-host one-copy path (`netstack::samehost`): between two `shm` contexts on one host a
//! WRITE or READ is one copy by the requester's core, no packets; the responder's checks (key,
//! protection domain, rights, bounds, a deregistered region, the peer QP's state) still hold,
//! each failure answered by the packet path's NAK with nothing touched; caller memory goes by
//! CMA; with the path off, the same traffic goes as packets.

use netstack::config::LinkMode;
use netstack::verbs::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

struct Side {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn side(copy: bool) -> Side {
    let ctx = Context::open(ContextConfig {
        link: LinkMode::Shm,
        same_host_copy: copy,
        ..Default::default()
    })
    .unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let mr = pd.reg_mr(4 << 20, Access::ALL).unwrap();
    Side { ctx, pd, cq, qp, mr }
}

fn pair(copy: bool) -> (Side, Side) {
    let (a, b) = (side(copy), side(copy));
    a.qp.connect(&b.qp.local_endpoint()).unwrap();
    b.qp.connect(&a.qp.local_endpoint()).unwrap();
    (a, b)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1] ^ seed)
        .collect()
}

fn write(a: &Side, local: Sge, addr: u64, rkey: u32) -> Wc {
    a.qp.post_send(SendWr::new(1, WrOpcode::RdmaWrite).sge(local).remote(addr, rkey))
        .unwrap();
    a.cq.next(T).expect("write completion")
}

fn read(a: &Side, local: Sge, addr: u64, rkey: u32) -> Wc {
    a.qp.post_send(SendWr::new(2, WrOpcode::RdmaRead).sge(local).remote(addr, rkey))
        .unwrap();
    a.cq.next(T).expect("read completion")
}

#[test]
fn writes_and_reads_between_same_host_contexts_are_one_copy_with_no_packets() {
    let (a, b) = pair(true);
    let (sa0, sb0) = (a.ctx.stats(), b.ctx.stats());
    let mut moved = 0u64;
    for (i, len) in [1usize << 20, 1, 4097, 3 << 20].into_iter().enumerate() {
        let data = pattern(len, i as u8);
        a.mr.write(0, &data);
        b.mr.region().fill(100, len, !(i as u8));
        let wc = write(&a, a.mr.sge(0, len), b.mr.addr() + 100, b.mr.rkey());
        assert_eq!(wc.status, WcStatus::Success);
        assert!(b.mr.region().equals(100, &data), "the WRITE of {len} landed");
        a.mr.region().fill(0, len, 0);
        let wc = read(&a, a.mr.sge(0, len), b.mr.addr() + 100, b.mr.rkey());
        assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, len as u32));
        assert!(a.mr.region().equals(0, &data), "the READ of {len} returned the bytes");
        moved += 2 * len as u64;
    }
    let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
    assert_eq!(sa.same_host_copy_bytes - sa0.same_host_copy_bytes, moved, "{sa:?}");
    assert_eq!(sa.same_host_ops - sa0.same_host_ops, 8);
    // nothing of it went as packets: no payload copied by either stack, (almost) no packets
    // (a multipath probe or a validation challenge may still pass)
    for (s, s0) in [(&sa, &sa0), (&sb, &sb0)] {
        assert_eq!(s.tx_payload_copy_bytes, s0.tx_payload_copy_bytes, "{s:?}");
        assert_eq!(s.rx_payload_copy_bytes, s0.rx_payload_copy_bytes, "{s:?}");
        assert!(s.tx_bytes - s0.tx_bytes < 4096, "{s:?}");
    }
    // the same counts on the Prometheus endpoint
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    netstack::telemetry::serve_prometheus(format!("127.0.0.1:{port}").parse().unwrap()).unwrap();
    netstack::telemetry::collect_now();
    let mut http = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    std::io::Write::write_all(&mut http, b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    std::io::Read::read_to_string(&mut http, &mut page).unwrap();
    // a context's value of `metric` with `label` on the page
    let value = |side: &Side, metric: &str, label: &str| -> f64 {
        let ctx = side.qp.local_endpoint().addr.to_string();
        page.lines()
            .find(|l| l.starts_with(metric) && l.contains(&format!("context=\"{ctx}\"")) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {metric} {label} for {ctx} in:\n{page}"))
    };
    assert_eq!(
        value(&a, "flexns_same_host_bytes_total", "how=\"copy\""),
        sa.same_host_copy_bytes as f64
    );
    assert_eq!(value(&a, "flexns_same_host_bytes_total", "how=\"cma\""), 0.0);
    assert_eq!(value(&a, "flexns_same_host_ops_total", ""), sa.same_host_ops as f64);
    // and the responder's side: what `a` wrote into `b` and read back out of it
    assert_eq!(
        value(&b, "flexns_same_host_peer_bytes_total", "direction=\"in\""),
        (moved / 2) as f64
    );
    assert_eq!(
        value(&b, "flexns_same_host_peer_bytes_total", "direction=\"out\""),
        (moved / 2) as f64
    );
}

#[test]
fn the_responders_checks_still_answer_and_touch_nothing() {
    let (a, b) = pair(true);
    let len = 8192;
    a.mr.write(0, &pattern(len, 7));
    b.mr.region().fill(0, 4 << 20, 0x5A);
    let untouched = |b: &Side| b.mr.region().equals(0, &vec![0x5A; 4 << 20]);
    let copies = |a: &Side| a.ctx.stats().same_host_ops;
    // a bad rkey
    let wc = write(&a, a.mr.sge(0, len), b.mr.addr(), b.mr.rkey() ^ 0x100);
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert!(untouched(&b));
    // the QP is in error now, as after any NAK: a fresh pair for each case
    let (a, b) = pair(true);
    a.mr.write(0, &pattern(len, 7));
    b.mr.region().fill(0, 4 << 20, 0x5A);
    // past the region's end
    let wc = write(&a, a.mr.sge(0, len), b.mr.addr() + (4 << 20) - 100, b.mr.rkey());
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert!(untouched(&b));
    // a region without remote rights
    let (a, b) = pair(true);
    a.mr.write(0, &pattern(len, 7));
    let ro = b.pd.reg_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_READ).unwrap();
    ro.region().fill(0, 1 << 20, 0x5A);
    let wc = write(&a, a.mr.sge(0, len), ro.addr(), ro.rkey());
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert!(ro.region().equals(0, &vec![0x5A; 1 << 20]));
    // a region of another protection domain
    let (a, b) = pair(true);
    let other = b.ctx.alloc_pd().reg_mr(1 << 20, Access::ALL).unwrap();
    other.region().fill(0, 1 << 20, 0x5A);
    let wc = write(&a, a.mr.sge(0, len), other.addr(), other.rkey());
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert!(other.region().equals(0, &vec![0x5A; 1 << 20]));
    // a deregistered region: its rkey is dead on this path too
    let (a, b) = pair(true);
    let gone = b.pd.reg_mr(1 << 20, Access::ALL).unwrap();
    let (addr, rkey, region) = (gone.addr(), gone.rkey(), gone.region().clone());
    assert_eq!(write(&a, a.mr.sge(0, len), addr, rkey).status, WcStatus::Success);
    region.fill(0, 1 << 20, 0x5A);
    drop(gone);
    let wc = write(&a, a.mr.sge(0, len), addr, rkey);
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert!(region.equals(0, &vec![0x5A; 1 << 20]));
    // none of the refused ones was copied: only the one WRITE before the deregistration
    assert_eq!(copies(&a), 1, "{:?}", a.ctx.stats());
}

#[test]
fn a_destroyed_peer_qp_is_not_written_through() {
    let (a, b) = pair(true);
    let len = 4096;
    a.mr.write(0, &pattern(len, 3));
    assert_eq!(
        write(&a, a.mr.sge(0, len), b.mr.addr(), b.mr.rkey()).status,
        WcStatus::Success
    );
    let Side { qp: bqp, mr: bmr, .. } = b;
    bmr.region().fill(0, len, 0x5A);
    drop(bqp);
    a.qp.post_send(
        SendWr::new(9, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, len))
            .remote(bmr.addr(), bmr.rkey()),
    )
    .unwrap();
    // the packet path takes it: no one answers, and nothing was copied
    std::thread::sleep(Duration::from_millis(200));
    assert!(bmr.region().equals(0, &vec![0x5A; len]));
    assert_eq!(a.ctx.stats().same_host_ops, 1);
}

#[test]
fn caller_memory_is_reached_by_cma() {
    let (a, b) = pair(true);
    let len = 1 << 20;
    let mut buf = vec![0u8; len].into_boxed_slice();
    // SAFETY: the buffer outlives the registration (dropped after `caller` below) and is not
    // read through a reference while registered.
    let caller = unsafe { b.pd.reg_mr_raw(buf.as_mut_ptr(), len, Access::ALL) }.unwrap();
    let data = pattern(len, 11);
    a.mr.write(0, &data);
    let wc = write(&a, a.mr.sge(0, len), caller.addr(), caller.rkey());
    assert_eq!(wc.status, WcStatus::Success);
    assert!(caller.region().equals(0, &data));
    let s = a.ctx.stats();
    assert_eq!(
        (s.same_host_cma_bytes, s.same_host_copy_bytes),
        (len as u64, 0),
        "{s:?}"
    );
    drop(caller);
    drop(buf);
}

#[test]
fn with_the_path_off_the_same_traffic_goes_as_packets() {
    let (a, b) = pair(false);
    let len = 1 << 20;
    let data = pattern(len, 5);
    a.mr.write(0, &data);
    assert_eq!(
        write(&a, a.mr.sge(0, len), b.mr.addr(), b.mr.rkey()).status,
        WcStatus::Success
    );
    assert!(b.mr.region().equals(0, &data));
    let s = a.ctx.stats();
    assert_eq!(s.same_host_ops, 0);
    assert!(s.tx_bytes >= len as u64, "{s:?}");
}

/// Set in the child process of [`a_peer_process_that_died_is_not_written_to`].
const CHILD: &str = "FLEXNS_SAME_HOST_CHILD";

/// The child: an `shm` context with a 4 MiB region; prints its endpoint, address and rkey,
/// connects to the parent's endpoint (one line on stdin), then waits to be killed.
fn child_side() {
    use std::io::BufRead;
    let s = side(true);
    let ep = serde_json::to_string(&s.qp.local_endpoint()).unwrap();
    println!("PEER {ep} {} {}", s.mr.addr(), s.mr.rkey());
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let parent: Endpoint = serde_json::from_str(line.trim()).unwrap();
    s.qp.connect(&parent).unwrap();
    println!("CONNECTED");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn a_peer_process_that_died_is_not_written_to() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    if std::env::var_os(CHILD).is_some() {
        return child_side();
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_peer_process_that_died_is_not_written_to",
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
    let mut said = |tag: &str| loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child ended before {tag:?}");
        // (the harness prints the test's name on the same line, before the child's first)
        if let Some(at) = line.find(tag) {
            return line[at + tag.len()..].trim().to_string();
        }
    };
    let peer = said("PEER ");
    let f: Vec<&str> = peer.split_whitespace().collect();
    let (ep, addr, rkey): (Endpoint, u64, u32) = (
        serde_json::from_str(f[0]).unwrap(),
        f[1].parse().unwrap(),
        f[2].parse().unwrap(),
    );
    assert!(ep.same_host.is_some(), "the child exports its memory");
    let a = side(true);
    a.qp.connect(&ep).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{}", serde_json::to_string(&a.qp.local_endpoint()).unwrap()).unwrap();
    said("CONNECTED");
    // into the other process's memory by one copy, and back
    let len = 1 << 20;
    let data = pattern(len, 77);
    a.mr.write(0, &data);
    assert_eq!(write(&a, a.mr.sge(0, len), addr, rkey).status, WcStatus::Success);
    a.mr.region().fill(0, len, 0);
    assert_eq!(read(&a, a.mr.sge(0, len), addr, rkey).status, WcStatus::Success);
    assert!(a.mr.region().equals(0, &data), "the bytes went to the child and back");
    let s = a.ctx.stats();
    assert_eq!((s.same_host_ops, s.same_host_copy_bytes), (2, 2 * len as u64), "{s:?}");
    // the child dies: its memory is still mapped here, but a WRITE must not "complete" into
    // it; it goes by packets, which no one answers, and fails as it would on a NIC
    child.kill().unwrap();
    child.wait().unwrap();
    a.qp.post_send(
        SendWr::new(5, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, len))
            .remote(addr, rkey),
    )
    .unwrap();
    let wc =
        a.cq.next(Duration::from_secs(60))
            .expect("the WRITE to a dead peer fails");
    assert_ne!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(a.ctx.stats().same_host_ops, 2);
}

#[test]
fn a_qp_connected_to_someone_else_is_not_written_through() {
    // V's QP is connected to A's; S is handed V's endpoint (its QP number and its export) as if
    // it were its peer's, e.g. by a caller forging an endpoint. A NIC's responder QP takes
    // requests only from its own peer; so must the copy path
    let (v, a) = pair(true);
    let s = side(true);
    s.qp.connect(&v.qp.local_endpoint()).unwrap();
    let len = 8192;
    s.mr.write(0, &pattern(len, 9));
    v.mr.region().fill(0, len, 0x5A);
    s.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(s.mr.sge(0, len))
            .remote(v.mr.addr(), v.mr.rkey()),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        v.mr.region().equals(0, &vec![0x5A; len]),
        "V's memory was written by a stranger"
    );
    assert_eq!(s.ctx.stats().same_host_ops, 0);
    // while A, V's real peer, still writes by one copy
    a.mr.write(0, &pattern(len, 10));
    assert_eq!(
        write(&a, a.mr.sge(0, len), v.mr.addr(), v.mr.rkey()).status,
        WcStatus::Success
    );
    assert!(v.mr.region().equals(0, &pattern(len, 10)));
    assert_eq!(a.ctx.stats().same_host_ops, 1);
}

#[test]
fn a_refused_second_connect_does_not_change_who_may_copy() {
    let (a, b) = pair(true);
    let c = side(true);
    // `a` is connected (RTS): connecting it again is refused and must change nothing
    assert!(a.qp.connect(&c.qp.local_endpoint()).is_err());
    c.qp.connect(&a.qp.local_endpoint()).unwrap();
    let len = 4096;
    b.mr.write(0, &pattern(len, 21));
    assert_eq!(
        write(&b, b.mr.sge(0, len), a.mr.addr(), a.mr.rkey()).status,
        WcStatus::Success
    );
    assert!(a.mr.region().equals(0, &pattern(len, 21)));
    assert_eq!(b.ctx.stats().same_host_ops, 1, "a's real peer still writes by one copy");
    c.mr.write(0, &pattern(len, 22));
    c.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(c.mr.sge(0, len))
            .remote(a.mr.addr(), a.mr.rkey()),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(a.mr.region().equals(0, &pattern(len, 21)), "c is not a's peer");
    assert_eq!(c.ctx.stats().same_host_ops, 0);
}
