//! Two engines in one process (embedded metadata), over each transport: writes and reads of
//! many slices land intact, notifications arrive after their data, statuses are right, and bad
//! requests are refused with messages that name what is wrong.

use kvcache_engine::*;
use std::time::Duration;

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed ^ (i >> 12) as u8))
        .collect()
}

fn engines(t: TransportKind, tag: &str) -> (TransferEngine, TransferEngine) {
    let mk = |role: &str| {
        let mut c = EngineConfig::new(&format!("{role}-{tag}-{}", std::process::id()), t);
        c.slice_size = Some(64 << 10);
        c.transfer_timeout = Duration::from_secs(10);
        TransferEngine::new(c).unwrap()
    };
    (mk("prefill"), mk("decode"))
}

fn round_trip(t: TransportKind) {
    let (p, d) = engines(t, &t.to_string());
    let n = 5 << 20;
    let remote = d.allocate_memory(8 << 20, Location::Cpu(0)).unwrap();
    let local = p.allocate_memory(8 << 20, Location::Cpu(0)).unwrap();
    let data = pattern(n, 7);
    local.write(0, &data);
    let seg = p.open_segment(d.segment_name()).unwrap();
    // a synchronous write of 80 slices, at an odd offset
    p.transfer_sync_write(seg, local.addr(), remote.addr() + 4096, n as u64)
        .unwrap();
    let mut got = vec![0u8; n];
    remote.read(4096, &mut got);
    assert!(got == data, "{t}: the written data differs at the target");
    // read it back into another part of the local buffer
    p.transfer_sync_read(seg, local.addr() + (6 << 20), remote.addr() + 4096, (2 << 20) as u64)
        .unwrap();
    let mut back = vec![0u8; 2 << 20];
    local.read(6 << 20, &mut back);
    assert!(back == data[..2 << 20], "{t}: read-back differs");

    // a batch of 4 requests with a notification: the notification comes after the data
    let b = p.allocate_batch(4).unwrap();
    let reqs: Vec<TransferRequest> = (0..4u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Write,
            source: local.addr() + i * 100_000,
            target: seg,
            target_offset: remote.addr() + (7 << 20) + i * 200_000,
            length: 100_000,
        })
        .collect();
    assert_eq!(p.batch_status(b).unwrap().state, TransferState::Waiting);
    let note = Notification {
        name: "prefill".into(),
        msg: "req-1 landed".into(),
    };
    p.submit_with_notify(b, &reqs, seg, &note).unwrap();
    let s = p.wait_batch(b, Duration::from_secs(10)).unwrap();
    assert_eq!(s.state, TransferState::Completed, "{t}");
    assert_eq!(s.transferred_bytes, 400_000);
    for i in 0..4 {
        let ts = p.transfer_status(b, i).unwrap();
        assert_eq!(ts.state, TransferState::Completed);
        assert_eq!(ts.transferred_bytes, 100_000);
    }
    let got = d.wait_notify(Duration::from_secs(5)).expect("notification");
    assert_eq!(got, note);
    for i in 0..4u64 {
        let mut v = vec![0u8; 100_000];
        remote.read((7 << 20) + i as usize * 200_000, &mut v);
        assert!(v == data[i as usize * 100_000..][..100_000]);
    }
    p.free_batch(b).unwrap();
    assert!(p.batch_status(b).is_err(), "a freed batch is gone");

    // a standalone notification
    p.send_notify(
        seg,
        &Notification {
            name: "n".into(),
            msg: "m".into(),
        },
    )
    .unwrap();
    assert_eq!(d.wait_notify(Duration::from_secs(5)).unwrap().msg, "m");

    // bad requests: named, nothing moves
    let e = p
        .transfer_sync_write(seg, local.addr(), remote.addr() + (8 << 20) - 10, 100)
        .unwrap_err();
    assert!(e.to_string().contains("not inside a buffer segment"), "{e}");
    let e = p.transfer_sync_write(seg, 0x10, remote.addr(), 100).unwrap_err();
    assert!(e.to_string().contains("source 0x10"), "{e}");
    let b = p.allocate_batch(1).unwrap();
    assert!(p.submit(b, &reqs).unwrap_err().to_string().contains("capacity"));
}

#[test]
fn flexns_round_trip() {
    round_trip(TransportKind::Flexns);
}

#[test]
fn tcp_round_trip() {
    round_trip(TransportKind::Tcp);
}

#[test]
fn a_peer_on_another_transport_is_an_error_not_a_fallback() {
    let f = TransferEngine::new(EngineConfig::new(
        &format!("f-{}", std::process::id()),
        TransportKind::Flexns,
    ))
    .unwrap();
    let t = TransferEngine::new(EngineConfig::new(
        &format!("t-{}", std::process::id()),
        TransportKind::Tcp,
    ))
    .unwrap();
    let e = f.open_segment(t.segment_name()).unwrap_err().to_string();
    assert!(e.contains("tcp transport") && e.contains("no fallback"), "{e}");
    let e = f.open_segment("nobody").unwrap_err().to_string();
    assert!(e.contains("nobody"), "{e}");
}
