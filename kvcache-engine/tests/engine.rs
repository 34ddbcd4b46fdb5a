//! Two engines in one process (embedded metadata), over each transport: writes and reads of
//! many slices land intact, notifications arrive after their data, statuses are right, and bad
//! requests are refused with messages that name what is wrong.

use kvcache_engine::*;
use std::time::Duration;

/// Bytes that never repeat within a transfer (a slice misplaced by any offset shows).
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n as u64)
        .map(|i| ((i ^ (seed as u64) << 40).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
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
    // 80 slices of 64 KiB over 4 lanes: the lanes pipeline (stop-and-wait had one in flight)
    let peak = TransferEngine::tcp_peak_in_flight();
    assert!(peak > 1, "a lane had at most {peak} request in flight");
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

#[test]
fn garbage_on_the_tcp_data_port_is_counted_and_the_engine_keeps_serving() {
    use std::io::{Read, Write};
    let (p, d) = engines(TransportKind::Tcp, "garbage");
    let data = d.local_descriptor().data.expect("a tcp engine has a data address");
    for junk in [
        &b"GET / HTTP/1.1\r\nHost: kvcache\r\nAccept: */*\r\n\r\n"[..],
        &[0u8; 64][..],
    ] {
        let mut s = std::net::TcpStream::connect(data).unwrap();
        s.write_all(junk).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply); // an error frame, then the connection closes
    }
    assert_eq!(d.malformed_frames(), 2);
    // a HELLO, then a WRITE just past the registered buffer: an error reply naming the range,
    // the payload drained, memory untouched, and the connection still serves
    let remote = d.allocate_memory(1 << 20, Location::Cpu(0)).unwrap();
    let frame = |op: u8, len: u32, addr: u64| {
        let mut h = vec![0u8; 32];
        h[0..4].copy_from_slice(&0x3154_564Bu32.to_le_bytes());
        h[4] = op;
        h[8..12].copy_from_slice(&len.to_le_bytes());
        h[24..32].copy_from_slice(&addr.to_le_bytes());
        h
    };
    let mut s = std::net::TcpStream::connect(data).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&frame(1, 0, 0)).unwrap();
    let mut r = [0u8; 32];
    s.read_exact(&mut r).unwrap();
    assert_eq!(r[5], 0, "HELLO accepted");
    let mut w = frame(2, 16, remote.addr() + (1 << 20) - 8);
    w.extend_from_slice(&[0xAB; 16]);
    s.write_all(&w).unwrap();
    s.read_exact(&mut r).unwrap();
    assert_eq!(r[5], 1, "an error reply");
    let mut msg = vec![0u8; u32::from_le_bytes(r[8..12].try_into().unwrap()) as usize];
    s.read_exact(&mut msg).unwrap();
    assert!(String::from_utf8_lossy(&msg).contains("not inside a registered buffer"));
    let mut tail = [0u8; 8];
    remote.read((1 << 20) - 8, &mut tail);
    assert_eq!(tail, [0u8; 8], "nothing written");
    let mut w = frame(2, 4, remote.addr() + 100);
    w.extend_from_slice(b"okay");
    s.write_all(&w).unwrap();
    s.read_exact(&mut r).unwrap();
    assert_eq!(r[5], 0, "the same connection still serves");
    let mut okay = [0u8; 4];
    remote.read(100, &mut okay);
    assert_eq!(&okay, b"okay");
    let local = p.allocate_memory(1 << 20, Location::Cpu(0)).unwrap();
    local.write(0, b"still serving");
    let seg = p.open_segment(d.segment_name()).unwrap();
    p.transfer_sync_write(seg, local.addr(), remote.addr(), 13).unwrap();
    let mut got = [0u8; 13];
    remote.read(0, &mut got);
    assert_eq!(&got, b"still serving");
}
