//! A peer flooding notifications at an engine whose application does not take them is held at
//! its share of the queue (`TransferEngine::MAX_NOTIFIES_PER_PEER`) and told so: its
//! notifications and its batches with a notification fail with the cause, never silently,
//! while another peer's transfers and notifications keep flowing, in order; once the
//! application takes its notifications, the flooding peer's next notification goes through.
//! Three engines in one process, over each transport; the refusals are counted on the
//! Prometheus endpoint.

use kvcache_engine::*;
use std::io::{Read, Write};
use std::sync::OnceLock;
use std::time::Duration;

/// The Prometheus endpoint of this test process (installed before any engine builds its metrics).
fn metrics_port() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    *PORT.get_or_init(|| {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        netstack::telemetry::serve_prometheus(format!("127.0.0.1:{port}").parse().unwrap()).unwrap();
        port
    })
}

/// The value of the refusal counter of `transport` for a full queue.
fn refused_on_endpoint(transport: TransportKind) -> f64 {
    let mut http = std::net::TcpStream::connect(("127.0.0.1", metrics_port())).unwrap();
    http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    http.read_to_string(&mut page).unwrap();
    page.lines()
        .find(|l| {
            l.starts_with("flexns_kvcache_notifies_refused_total")
                && l.contains(&format!("transport=\"{transport}\""))
                && l.contains("reason=\"full\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no refusal counter for {transport} in:\n{page}"))
}

fn note(name: &str, i: usize) -> Notification {
    Notification {
        name: name.into(),
        msg: format!("{name} request {i} landed"),
    }
}

fn flood(t: TransportKind) {
    metrics_port();
    let tag = format!("{t}-{}", std::process::id());
    let mk = |role: &str| {
        let mut c = EngineConfig::new(&format!("{role}-{tag}"), t);
        c.transfer_timeout = Duration::from_secs(10);
        TransferEngine::new(c).unwrap()
    };
    let (decode, a, b) = (mk("decode"), mk("flooder"), mk("polite"));
    let pool = decode.allocate_memory(1 << 20, Location::Cpu(0)).unwrap();
    let (la, lb) = (
        a.allocate_memory(64 << 10, Location::Cpu(0)).unwrap(),
        b.allocate_memory(64 << 10, Location::Cpu(0)).unwrap(),
    );
    let (sa, sb) = (
        a.open_segment(decode.segment_name()).unwrap(),
        b.open_segment(decode.segment_name()).unwrap(),
    );
    let max = TransferEngine::MAX_NOTIFIES_PER_PEER;

    // A floods; the decode application takes nothing: A's share fills, then A is refused
    let mut sent = 0;
    let refusal = loop {
        match a.send_notify(sa, &note("A", sent)) {
            Ok(()) => sent += 1,
            Err(e) => break e.to_string(),
        }
        assert!(
            sent <= max,
            "{t}: {sent} notifications queued, past the per-peer bound {max}"
        );
    };
    assert_eq!(sent, max, "{t}: refused after {sent} notifications: {refusal}");
    assert!(
        refusal.contains("refused") && refusal.contains("is full") && refusal.contains("not taken"),
        "{t}: the refusal says why: {refusal}"
    );
    let mut refused = 1;

    // B's transfers with notifications, and its notifications alone, are served meanwhile; A
    // stays held, its batches with a notification failing with the cause
    la.write(0, &[0xA5; 4096]);
    for i in 0..20 {
        let data = vec![i as u8 + 1; 4096];
        lb.write(0, &data);
        let w = TransferRequest {
            opcode: Opcode::Write,
            source: lb.addr(),
            target: sb,
            target_offset: pool.addr() + i as u64 * 4096,
            length: 4096,
        };
        b.transfer_sync(sb, &[w], Some(&note("B", 2 * i)))
            .unwrap_or_else(|e| panic!("{t}: B's transfer {i} with its notification: {e}"));
        let mut got = vec![0u8; 4096];
        pool.read(i * 4096, &mut got);
        assert_eq!(got, data, "{t}: B's data {i}");
        b.send_notify(sb, &note("B", 2 * i + 1))
            .unwrap_or_else(|e| panic!("{t}: B's notification {i}: {e}"));

        let w = TransferRequest {
            opcode: Opcode::Write,
            source: la.addr(),
            target: sa,
            target_offset: pool.addr() + (512 << 10),
            length: 4096,
        };
        let e = a
            .transfer_sync(sa, &[w], Some(&note("A", sent + i)))
            .expect_err("A's batch with a notification fails while its share is full")
            .to_string();
        assert!(e.contains("refused") && e.contains("is full"), "{t}: A's batch: {e}");
        refused += 1;
        let e = a.send_notify(sa, &note("A", sent + i)).unwrap_err().to_string();
        assert!(e.contains("is full"), "{t}: {e}");
        refused += 1;
    }

    // the decode application takes what was queued: A's first `max`, then all of B's in order
    let got = decode.get_notifies();
    let (from_a, from_b): (Vec<_>, Vec<_>) = got.into_iter().partition(|n| n.name == "A");
    assert_eq!(from_a, (0..max).map(|i| note("A", i)).collect::<Vec<_>>(), "{t}");
    assert_eq!(from_b, (0..40).map(|i| note("B", i)).collect::<Vec<_>>(), "{t}");

    // A is served again: a notification alone and one after a batch
    a.send_notify(sa, &note("A", 10_000))
        .unwrap_or_else(|e| panic!("{t}: A after the drain: {e}"));
    let w = TransferRequest {
        opcode: Opcode::Write,
        source: la.addr(),
        target: sa,
        target_offset: pool.addr() + (512 << 10),
        length: 4096,
    };
    a.transfer_sync(sa, &[w], Some(&note("A", 10_001)))
        .unwrap_or_else(|e| panic!("{t}: A's batch after the drain: {e}"));
    assert_eq!(decode.get_notifies(), vec![note("A", 10_000), note("A", 10_001)], "{t}");

    // every refusal counted once (this test's transport label only)
    assert_eq!(refused_on_endpoint(t), refused as f64, "{t}: refusals counted");
}

#[test]
fn a_flooding_peer_is_refused_over_flexns_while_another_is_served() {
    flood(TransportKind::Flexns);
}

#[test]
fn a_flooding_peer_is_refused_over_tcp_while_another_is_served() {
    flood(TransportKind::Tcp);
}
