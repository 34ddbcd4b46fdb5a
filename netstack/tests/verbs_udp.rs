//! Two contexts in one process over real UDP sockets on 127.0.0.1.

use netstack::verbs::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

struct Side {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

/// How a test side is built.
struct Opts {
    ctx: ContextConfig,
    attr: QpInitAttr,
    cqe: usize,
    mr_len: usize,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            ctx: ContextConfig::default(),
            attr: QpInitAttr::default(),
            cqe: 1024,
            mr_len: 1 << 20,
        }
    }
}

fn side_with(o: &Opts) -> Side {
    let ctx = Context::open(o.ctx.clone()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(o.cqe).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, o.attr).unwrap();
    let mr = pd.reg_mr(o.mr_len, Access::ALL).unwrap();
    Side {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

fn pair_with(o: &Opts) -> (Side, Side) {
    let a = side_with(o);
    let b = side_with(o);
    a.qp.connect(&b.qp.local_endpoint()).unwrap();
    b.qp.connect(&a.qp.local_endpoint()).unwrap();
    (a, b)
}

fn side(cfg: RcConfig, mr_len: usize) -> Side {
    side_with(&Opts {
        ctx: ContextConfig {
            qp: cfg,
            ..Default::default()
        },
        mr_len,
        ..Default::default()
    })
}

fn pair(cfg: RcConfig, mr_len: usize) -> (Side, Side) {
    pair_with(&Opts {
        ctx: ContextConfig {
            qp: cfg,
            ..Default::default()
        },
        mr_len,
        ..Default::default()
    })
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[0] ^ seed)
        .collect()
}

#[test]
fn write_read_send_atomics_both_recovery_modes() {
    for recovery in [Recovery::GoBackN, Recovery::SelectiveRepeat] {
        let cfg = RcConfig {
            recovery,
            ..Default::default()
        };
        let (a, b) = pair(cfg, 1 << 20);
        let data = pattern(300_000, 7);
        a.mr.write(0, &data);
        // WRITE
        a.qp.post_send(
            SendWr::new(1, WrOpcode::RdmaWrite)
                .sge(a.mr.sge(0, data.len()))
                .remote(b.mr.addr(), b.mr.rkey()),
        )
        .unwrap();
        let wc = a.cq.next(T).expect("write completion");
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (1, WcStatus::Success, WcOpcode::RdmaWrite)
        );
        let mut got = vec![0u8; data.len()];
        b.mr.read(0, &mut got);
        assert_eq!(got, data);
        // READ it back elsewhere
        a.qp.post_send(
            SendWr::new(2, WrOpcode::RdmaRead)
                .sge(a.mr.sge(500_000, data.len()))
                .remote(b.mr.addr(), b.mr.rkey()),
        )
        .unwrap();
        assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
        a.mr.read(500_000, &mut got);
        assert_eq!(got, data);
        // SEND with immediate
        b.qp.post_recv(RecvWr {
            wr_id: 77,
            sg_list: [b.mr.sge(900_000, 10_000)].into_iter().collect(),
        })
        .unwrap();
        a.qp.post_send(
            SendWr::new(3, WrOpcode::SendWithImm)
                .sge(a.mr.sge(0, 9_000))
                .imm(0xabcd),
        )
        .unwrap();
        assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
        let r = b.cq.next(T).unwrap();
        assert_eq!(
            (r.wr_id, r.opcode, r.byte_len, r.imm_data),
            (77, WcOpcode::Recv, 9_000, Some(0xabcd))
        );
        let mut g2 = vec![0u8; 9_000];
        b.mr.read(900_000, &mut g2);
        assert_eq!(g2, data[..9_000]);
        // atomics
        b.mr.write(8, &[0u8; 16]);
        for i in 0..10u64 {
            a.qp.post_send(
                SendWr::new(10 + i, WrOpcode::AtomicFetchAndAdd)
                    .sge(a.mr.sge(16, 8))
                    .remote(b.mr.addr() + 8, b.mr.rkey())
                    .atomic(3, 0),
            )
            .unwrap();
        }
        for _ in 0..10 {
            assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
        }
        assert_eq!(b.mr.load_u64(8), Some(30));
        a.qp.post_send(
            SendWr::new(30, WrOpcode::AtomicCmpAndSwp)
                .sge(a.mr.sge(24, 8))
                .remote(b.mr.addr() + 8, b.mr.rkey())
                .atomic(30, 99),
        )
        .unwrap();
        assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
        assert_eq!(a.mr.load_u64(24), Some(30));
        assert_eq!(b.mr.load_u64(8), Some(99));
    }
}

/// The copy counters measure: each kind of payload movement changes them by exactly the
/// bytes it copies (large WRITEs and SENDs by none on the way out).
#[test]
fn copy_counters_count_every_copy() {
    let (a, b) = pair(RcConfig::default(), 1 << 20);
    // each counter's change over `f`, and the responder's fused copies, from a run that
    // retransmitted nothing: under load a packet may time out and go again (a small payload
    // is snapshotted again, a READ response copied again), which is another transfer's count,
    // so such a run is measured again
    let retransmitted = || a.qp.stats().retransmitted_packets + b.qp.stats().retransmitted_packets;
    let d = |f: &dyn Fn(), s: &dyn Fn() -> (u64, u64, u64, u64)| {
        for _ in 0..10 {
            let (r, x, fx) = (retransmitted(), s(), b.ctx.stats().rx_fused_copy_bytes);
            f();
            let (y, fy) = (s(), b.ctx.stats().rx_fused_copy_bytes);
            if retransmitted() == r {
                return ((y.0 - x.0, y.1 - x.1, y.2 - x.2, y.3 - x.3), fy - fx);
            }
        }
        panic!("ten runs in a row retransmitted");
    };
    // (a tx, a rx, b tx, b rx)
    let snap = || {
        let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
        (
            sa.tx_payload_copy_bytes,
            sa.rx_payload_copy_bytes,
            sb.tx_payload_copy_bytes,
            sb.rx_payload_copy_bytes,
        )
    };
    let done = |c: &Cq| assert_eq!(c.next(T).unwrap().status, WcStatus::Success);
    // a 64 KiB WRITE: sent by reference, placed once at the responder
    let write = || {
        a.qp.post_send(
            SendWr::new(1, WrOpcode::RdmaWrite)
                .sge(a.mr.sge(0, 65536))
                .remote(b.mr.addr(), b.mr.rkey()),
        )
        .unwrap();
        done(&a.cq);
    };
    let (copies, fused) = d(&write, &snap);
    assert_eq!(copies, (0, 0, 0, 65536));
    // of its 16 packets (MTU 4096) the 15 after the first were placed in the ICRC's pass; the
    // first, whose RETH names the range, was checked before it was placed
    assert_eq!(fused, 65536 - 4096);
    // a 64 KiB READ: the responder snapshots its response, the requester places it
    let read = || {
        a.qp.post_send(
            SendWr::new(2, WrOpcode::RdmaRead)
                .sge(a.mr.sge(65536, 65536))
                .remote(b.mr.addr(), b.mr.rkey()),
        )
        .unwrap();
        done(&a.cq);
    };
    assert_eq!(d(&read, &snap).0, (0, 65536, 65536, 0));
    // a 200 B SEND: small payloads are snapshotted before the ICRC; placed into the receive
    let send = || {
        b.qp.post_recv(RecvWr {
            wr_id: 3,
            sg_list: [b.mr.sge(200_000, 4096)].into_iter().collect(),
        })
        .unwrap();
        a.qp.post_send(SendWr::new(3, WrOpcode::Send).sge(a.mr.sge(0, 200)))
            .unwrap();
        done(&a.cq);
        done(&b.cq);
    };
    assert_eq!(d(&send, &snap).0, (200, 0, 0, 200));
    // a 64 B INLINE SEND: into the WQE slots and out of them (2 copies each side of the send
    // queue), then the small-payload snapshot
    let inline = || {
        b.qp.post_recv(RecvWr {
            wr_id: 4,
            sg_list: [b.mr.sge(200_000, 4096)].into_iter().collect(),
        })
        .unwrap();
        a.qp.post_send(
            SendWr::new(4, WrOpcode::Send)
                .sge(a.mr.sge(0, 64))
                .flags(SendFlags::INLINE | SendFlags::SIGNALED),
        )
        .unwrap();
        done(&a.cq);
        done(&b.cq);
    };
    assert_eq!(d(&inline, &snap).0, (5 * 64, 0, 0, 64));
    // the staging memory a receive batch filled is reported beside the allocation
    let sb = b.ctx.stats();
    assert!(
        sb.staging_bytes_peak >= 4096 && sb.staging_bytes_peak <= sb.staging_bytes,
        "{sb:?}"
    );
}

#[test]
fn bad_remote_access_naks_and_touches_nothing() {
    let (a, b) = pair(RcConfig::default(), 1 << 16);
    let before = pattern(1 << 16, 3);
    b.mr.write(0, &before);
    a.mr.write(0, &pattern(1 << 16, 9));
    let wc = {
        a.qp.post_send(
            SendWr::new(1, WrOpcode::RdmaWrite)
                .sge(a.mr.sge(0, 8192))
                .remote(b.mr.addr(), b.mr.rkey() ^ 0x100),
        )
        .unwrap();
        a.cq.next(T).unwrap()
    };
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert_eq!(a.qp.state(), QpState::Err);
    let mut got = vec![0u8; 1 << 16];
    b.mr.read(0, &mut got);
    assert_eq!(got, before);
    let _ = b.ctx.stats();
}

#[test]
fn garbage_datagrams_are_counted_and_dropped() {
    let (a, b) = pair(RcConfig::default(), 4096);
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let dst = b.ctx.local_addr();
    let mut rng = 12345u64;
    for i in 0..2000 {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let len = (rng >> 33) as usize % 5000;
        let mut buf: Vec<u8> = (0..len).map(|j| (rng >> (j % 56)) as u8).collect();
        if i % 3 == 0 && buf.len() > 16 {
            buf[0] = 0x0A; // plausible opcode, wrong everything else
            buf[1] = 0;
        }
        sock.send_to(&buf, dst).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    let s = b.ctx.stats();
    assert!(s.rx_malformed + s.rx_bad_icrc >= 1990, "{s:?}");
    // the QP still works
    a.mr.write(0, b"hello");
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, 5))
            .remote(b.mr.addr(), b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
}

#[test]
fn local_errors_and_queue_states() {
    let (a, b) = pair(RcConfig::default(), 1 << 16);
    // INLINE: the payload is copied at post time, so the buffer may change right after
    a.mr.write(0, b"inline!!");
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, 8))
            .remote(b.mr.addr(), b.mr.rkey())
            .flags(SendFlags::SIGNALED | SendFlags::INLINE),
    )
    .unwrap();
    a.mr.write(0, b"changed!");
    assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
    let mut g = [0u8; 8];
    b.mr.read(0, &mut g);
    assert_eq!(&g, b"inline!!");
    // INLINE above max_inline is refused at post time
    let big = SendWr::new(2, WrOpcode::RdmaWrite)
        .sge(a.mr.sge(0, 4096))
        .remote(b.mr.addr(), b.mr.rkey())
        .flags(SendFlags::INLINE);
    assert!(matches!(a.qp.post_send(big), Err(VerbsError::InlineTooLong { .. })));
    // a receive buffer smaller than the SEND: LOC_LEN_ERR at the receiver, REM_INV_REQ_ERR at the sender
    b.qp.post_recv(RecvWr {
        wr_id: 5,
        sg_list: [b.mr.sge(0, 10)].into_iter().collect(),
    })
    .unwrap();
    a.qp.post_send(SendWr::new(3, WrOpcode::Send).sge(a.mr.sge(0, 100)))
        .unwrap();
    assert_eq!(a.cq.next(T).unwrap().status, WcStatus::RemInvReqErr);
    let r = b.cq.next(T).unwrap();
    assert_eq!((r.wr_id, r.status), (5, WcStatus::LocLenErr));
    // a QP in ERR flushes what is posted to it
    a.qp.post_send(
        SendWr::new(4, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, 8))
            .remote(b.mr.addr(), b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(a.cq.next(T).unwrap().status, WcStatus::WrFlushErr);

    // a bad lkey completes with LOC_PROT_ERR
    let (c, d) = pair(RcConfig::default(), 4096);
    let bad = Sge {
        addr: c.mr.addr(),
        length: 8,
        lkey: c.mr.lkey() ^ 0x300,
    };
    c.qp.post_send(
        SendWr::new(9, WrOpcode::RdmaWrite)
            .sge(bad)
            .remote(d.mr.addr(), d.mr.rkey()),
    )
    .unwrap();
    assert_eq!(c.cq.next(T).unwrap().status, WcStatus::LocProtErr);
    assert_eq!(c.qp.state(), QpState::Err);

    // posting a send before RTS is refused
    let e = side(RcConfig::default(), 4096);
    let r = e.qp.post_send(SendWr::new(1, WrOpcode::RdmaWrite).sge(e.mr.sge(0, 8)));
    assert!(matches!(r, Err(VerbsError::Post(_))), "{r:?}");
    // recovery modes must match
    let f = side(
        RcConfig {
            recovery: Recovery::SelectiveRepeat,
            ..Default::default()
        },
        4096,
    );
    assert!(matches!(e.qp.connect(&f.qp.local_endpoint()), Err(VerbsError::Peer(_))));
}

#[test]
fn async_cq_wait_and_caller_memory() {
    let (a, b) = pair(RcConfig::default(), 4096);
    // caller-owned memory registered with the unsafe constructor
    let mut mine = vec![0u8; 8192].into_boxed_slice();
    // SAFETY: `mine` outlives the MR and the work requests below, and is not touched through
    // Rust references until the MR is dropped.
    let raw = unsafe { a._pd.reg_mr_raw(mine.as_mut_ptr(), mine.len(), Access::LOCAL_WRITE) }.unwrap();
    b.mr.write(100, b"from the peer");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        a.qp.post_send(
            SendWr::new(1, WrOpcode::RdmaRead)
                .sge(raw.sge(10, 13))
                .remote(b.mr.addr() + 100, b.mr.rkey()),
        )
        .unwrap();
        tokio::time::timeout(T, a.cq.wait_async())
            .await
            .expect("completion arrives");
        let mut wc = [EMPTY_WC];
        assert_eq!(a.cq.poll(&mut wc), 1);
        assert_eq!(wc[0].status, WcStatus::Success);
    });
    drop(raw);
    assert_eq!(&mine[10..23], b"from the peer");
}

#[test]
fn gso_and_gro_batch_packets_when_on_and_not_when_off() {
    for on in [true, false] {
        let ctx = ContextConfig {
            gso: on,
            gro: on,
            ..Default::default()
        };
        let (a, b) = pair_with(&Opts {
            ctx,
            cqe: 64,
            mr_len: 4 << 20,
            ..Default::default()
        });
        let data = pattern(4 << 20, 1);
        a.mr.write(0, &data);
        a.qp.post_send(
            SendWr::new(1, WrOpcode::RdmaWrite)
                .sge(a.mr.sge(0, 4 << 20))
                .remote(b.mr.addr(), b.mr.rkey()),
        )
        .unwrap();
        assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
        let mut got = vec![0u8; 4 << 20];
        b.mr.read(0, &mut got);
        assert!(got == data, "data differs with gso/gro {on}");
        let (sa, sb) = (a.ctx.stats(), b.ctx.stats());
        assert!(sa.tx_packets >= 1024, "{sa:?}");
        if on {
            assert!(
                sa.tx_messages * 4 < sa.tx_packets,
                "GSO should pack several packets per send: {sa:?}"
            );
            assert!(
                sb.staging_fills < sb.rx_datagrams,
                "GRO should coalesce receives: {sb:?}"
            );
        } else {
            assert_eq!(sa.tx_messages, sa.tx_packets, "{sa:?}");
            assert_eq!(sb.staging_fills, sb.rx_datagrams, "{sb:?}");
        }
        assert!(sb.staging_bytes <= 2 << 20, "{sb:?}");
    }
}

#[test]
fn qps_are_sharded_over_several_data_cores() {
    let open = || {
        Context::open(ContextConfig {
            data_cores: 3,
            ..Default::default()
        })
        .unwrap()
    };
    let (ca, cb) = (open(), open());
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (cqa, cqb) = (ca.create_cq(256).unwrap(), cb.create_cq(256).unwrap());
    let ma = pa.reg_mr(1 << 20, Access::ALL).unwrap();
    let mb = pb.reg_mr(1 << 20, Access::ALL).unwrap();
    ma.write(0, &pattern(1 << 20, 5));
    // QPs go to the core their QPN names (QPN mod cores); QPNs are random, so twelve of them
    // miss one of three cores about one time in 43: the QPs are made until each core has one
    // (or 100 pairs: a miss then is a one-in-10^17 event, or a bug), at least 12
    let mut ports = std::collections::HashSet::new();
    let mut core_port = std::collections::HashMap::new();
    let mut qps = Vec::new();
    while qps.len() < 12 || (ports.len() < 3 && qps.len() < 100) {
        let qa = ca.create_qp(&pa, &cqa, &cqa, QpInitAttr::default()).unwrap();
        let qb = cb.create_qp(&pb, &cqb, &cqb, QpInitAttr::default()).unwrap();
        qa.connect(&qb.local_endpoint()).unwrap();
        qb.connect(&qa.local_endpoint()).unwrap();
        let port = qa.local_endpoint().addr.port();
        ports.insert(port);
        // one core, one socket: every QP of a core sends from its port
        assert_eq!(
            *core_port.entry(qa.qp_num() % 3).or_insert(port),
            port,
            "QPN {}",
            qa.qp_num()
        );
        qps.push((qa, qb));
    }
    assert_eq!(ports.len(), 3, "QPs should be spread over 3 data cores (3 sockets)");
    // the WRITEs below use 12 of them, a QP of each core among them
    let mut cores = std::collections::HashSet::new();
    let (mut qps, mut rest): (Vec<_>, Vec<_>) = qps.into_iter().partition(|(qa, _)| cores.insert(qa.qp_num() % 3));
    qps.append(&mut rest);
    qps.truncate(12);
    for (i, (qa, _)) in qps.iter().enumerate() {
        let off = i * 65536;
        qa.post_send(
            SendWr::new(i as u64, WrOpcode::RdmaWrite)
                .sge(ma.sge(off, 65536))
                .remote(mb.addr() + off as u64, mb.rkey()),
        )
        .unwrap();
    }
    for _ in 0..qps.len() {
        assert_eq!(cqa.next(T).unwrap().status, WcStatus::Success);
    }
    let (mut x, mut y) = (vec![0u8; 12 * 65536], vec![0u8; 12 * 65536]);
    ma.read(0, &mut x);
    mb.read(0, &mut y);
    assert!(x == y);
    assert!(cb.stats().staging_bytes > 2 << 20, "each core has its own staging set");
}

/// `rounds` SEND ping-pongs of 64 B: `a` sends its round number with `a_flags` (signaled), `b`
/// echoes it with `echo_flags`; `next` reads a side's next completion. Every completion must
/// succeed, `b` sees nothing before the receive unless its echoes are signaled, and `a` checks
/// the echo.
fn ping_pong(
    a: &Side,
    b: &Side,
    rounds: u32,
    a_flags: SendFlags,
    echo_flags: SendFlags,
    next: &dyn Fn(&Side, u32) -> Wc,
) {
    for i in 0..rounds {
        b.qp.post_recv(RecvWr {
            wr_id: i as u64,
            sg_list: [b.mr.sge(400_000, 64)].into_iter().collect(),
        })
        .unwrap();
        a.qp.post_recv(RecvWr {
            wr_id: i as u64,
            sg_list: [a.mr.sge(900_000, 64)].into_iter().collect(),
        })
        .unwrap();
        a.mr.write(500_000, &i.to_le_bytes());
        a.qp.post_send(
            SendWr::new(i as u64, WrOpcode::Send)
                .sge(a.mr.sge(500_000, 64))
                .flags(a_flags),
        )
        .unwrap();
        // with signaled echoes, b's completions of its own echoes come first or after
        let r = loop {
            let w = next(b, i);
            if w.opcode == WcOpcode::Recv || !echo_flags.contains(SendFlags::SIGNALED) {
                break w;
            }
            assert_eq!(w.status, WcStatus::Success);
        };
        assert_eq!(
            (r.status, r.opcode, r.byte_len),
            (WcStatus::Success, WcOpcode::Recv, 64)
        );
        b.qp.post_send(
            SendWr::new(i as u64, WrOpcode::Send)
                .sge(b.mr.sge(400_000, 64))
                .flags(echo_flags),
        )
        .unwrap();
        let mut seen = (false, false);
        while seen != (true, true) {
            let w = next(a, i);
            assert_eq!(w.status, WcStatus::Success);
            match w.opcode {
                WcOpcode::Recv => seen.1 = true,
                _ => seen.0 = true,
            }
        }
        let mut echo = [0u8; 4];
        a.mr.read(900_000, &mut echo);
        assert_eq!(u32::from_le_bytes(echo), i);
    }
}

#[test]
fn low_latency_qps_carry_every_operation() {
    let attr = QpInitAttr {
        low_latency: true,
        ..Default::default()
    };
    let (a, b) = pair_with(&Opts {
        attr,
        cqe: 256,
        ..Default::default()
    });
    let data = pattern(200_000, 3);
    a.mr.write(0, &data);
    // ping-pong of INLINE SENDs, both sides low-latency; unsignaled echoes
    let next = |s: &Side, i: u32| -> Wc {
        s.cq.next(T)
            .unwrap_or_else(|| panic!("iteration {i}: no completion within {T:?}, qp {:?}", s.qp.stats()))
    };
    ping_pong(
        &a,
        &b,
        200,
        SendFlags::INLINE | SendFlags::SIGNALED,
        SendFlags::INLINE,
        &next,
    );
    // multi-packet WRITE and READ over the same low-latency QP
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, data.len()))
            .remote(b.mr.addr() + 100_000, b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
    a.qp.post_send(
        SendWr::new(2, WrOpcode::RdmaRead)
            .sge(a.mr.sge(300_000, data.len()))
            .remote(b.mr.addr() + 100_000, b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
    let mut got = vec![0u8; data.len()];
    a.mr.read(300_000, &mut got);
    assert!(got == data);
}

#[test]
fn a_full_cq_loses_no_completion() {
    // room for 2 completions per data core
    let (a, b) = pair_with(&Opts {
        cqe: 2,
        mr_len: 1 << 16,
        ..Default::default()
    });
    for i in 0..100 {
        a.qp.post_send(
            SendWr::new(i, WrOpcode::RdmaWrite)
                .sge(a.mr.sge(0, 64))
                .remote(b.mr.addr(), b.mr.rkey()),
        )
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut ids = Vec::new();
    while ids.len() < 100 {
        let wc = a.cq.next(T).expect("every completion arrives");
        assert_eq!(wc.status, WcStatus::Success);
        ids.push(wc.wr_id);
    }
    assert_eq!(ids, (0..100).collect::<Vec<_>>(), "in order, none lost or repeated");
    assert!(a.cq.overruns() > 0, "the CQ was full at times");
    assert!(a.cq.next(Duration::from_millis(50)).is_none());
}

fn cc_opts(cc: netstack::cc::CcKind, rx_delay_us: u64) -> Opts {
    Opts {
        ctx: ContextConfig {
            qp: RcConfig {
                cc,
                ..RcConfig::default()
            },
            rx_delay_us,
            ..Default::default()
        },
        mr_len: 4 << 20,
        ..Default::default()
    }
}

fn cc_side(cc: netstack::cc::CcKind) -> Side {
    side_with(&cc_opts(cc, 0))
}

fn write_all(a: &Side, b: &Side, len: usize, n: u64) -> Vec<WcStatus> {
    for i in 0..n {
        a.qp.post_send(
            SendWr::new(i, WrOpcode::RdmaWrite)
                .sge(a.mr.sge(0, len))
                .remote(b.mr.addr(), b.mr.rkey()),
        )
        .unwrap();
    }
    (0..n).map(|_| a.cq.next(T).expect("completion").status).collect()
}

#[test]
fn homa_grants_carry_a_transfer_over_udp() {
    use netstack::cc::CcKind;
    // the receiver runs no CC of its own: it adopts Homa from the sender when connecting
    let a = cc_side(CcKind::Homa);
    let b = cc_side(CcKind::None);
    b.qp.connect(&a.qp.local_endpoint()).unwrap();
    a.qp.connect(&b.qp.local_endpoint()).unwrap();
    assert_eq!(b.qp.cc_info().map(|c| c.0), Some("homa"));
    let data = pattern(4 << 20, 9);
    a.mr.write(0, &data);
    assert!(write_all(&a, &b, 4 << 20, 4).iter().all(|s| *s == WcStatus::Success));
    let mut got = vec![0u8; 4 << 20];
    b.mr.read(0, &mut got);
    assert!(got == data, "data arrived intact");
    // beyond the unscheduled bytes of each message the sender waited for the receiver's grants
    let (sa, sb) = (a.qp.stats(), b.qp.stats());
    assert!(sb.grants_sent > 10 && sa.grants_received > 10, "{sa:?} {sb:?}");
    assert!(sa.cc_deferred > 0, "the TX function held packets for credit: {sa:?}");
}

#[test]
fn hpcc_refuses_a_path_without_int_telemetry() {
    use netstack::cc::CcKind;
    let (a, b) = pair_with(&cc_opts(CcKind::Hpcc, 0));
    let st = write_all(&a, &b, 1 << 20, 4);
    assert!(st.iter().any(|s| *s != WcStatus::Success), "{st:?}");
    assert_eq!(a.qp.cc_fault(), Some(netstack::cc::hpcc::NO_INT));
    assert_eq!(a.qp.state(), QpState::Err);
}

#[test]
fn different_cc_algorithms_are_refused_at_connect() {
    use netstack::cc::CcKind;
    let a = cc_side(CcKind::Dcqcn);
    let b = cc_side(CcKind::Swift);
    let e = a.qp.connect(&b.qp.local_endpoint()).unwrap_err().to_string();
    assert!(e.contains("swift") && e.contains("dcqcn"), "{e}");
}

#[test]
fn the_delay_line_adds_its_delay_to_every_round_trip() {
    use netstack::cc::CcKind;
    let (a, b) = pair_with(&cc_opts(CcKind::None, 500));
    let t = std::time::Instant::now();
    for _ in 0..10 {
        assert_eq!(write_all(&a, &b, 64, 1), vec![WcStatus::Success]);
    }
    // each WRITE waits for its ACK: data and ACK each sit 500 µs in a delay line
    assert!(t.elapsed() >= std::time::Duration::from_millis(10), "{:?}", t.elapsed());
}

/// Run to completion: the threads that post and poll run the engine (no hand-off), and a
/// context whose application never polls (the target of a WRITE) is served by its backstop.
#[test]
fn run_to_completion_contexts_carry_every_operation() {
    let o = Opts {
        ctx: ContextConfig {
            drive: Drive::Application,
            ..Default::default()
        },
        cqe: 256,
        ..Default::default()
    };
    let (a, b) = pair_with(&o);
    // (setting up the QPs ran b's cores from its application thread: the control commands)
    let before = b.ctx.stats();
    let data = pattern(300_000, 9);
    a.mr.write(0, &data);
    // a WRITE into a context nobody polls: its backstop thread receives and acknowledges
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, data.len()))
            .remote(b.mr.addr(), b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(a.cq.next(T).expect("write completion").status, WcStatus::Success);
    let mut got = vec![0u8; data.len()];
    b.mr.read(0, &mut got);
    assert!(got == data, "written data differs");
    let bs = b.ctx.stats();
    assert_eq!(
        bs.application_passes, before.application_passes,
        "b's application never called the engine"
    );
    assert!(
        bs.engine_thread_passes > before.engine_thread_passes,
        "b's backstop served the WRITE"
    );
    // a ping-pong of SENDs, each side's completions read by a spinning poll loop that runs
    // the engine itself
    let spin_next = |s: &Side| -> Wc {
        let deadline = std::time::Instant::now() + T;
        let mut wc = [EMPTY_WC];
        loop {
            if s.cq.poll(&mut wc) == 1 {
                return wc[0];
            }
            assert!(std::time::Instant::now() < deadline, "no completion within {T:?}");
            std::thread::yield_now();
        }
    };
    let before = (a.ctx.stats().application_passes, b.ctx.stats().application_passes);
    let calls = (a.ctx.stats().tx_calls, b.ctx.stats().tx_calls);
    ping_pong(&a, &b, 200, SendFlags::SIGNALED, SendFlags::SIGNALED, &|s, _| {
        spin_next(s)
    });
    let after = (a.ctx.stats().application_passes, b.ctx.stats().application_passes);
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "the polling threads ran the engine: {before:?} -> {after:?}"
    );
    // a receive's ACK waits for the application's next call, and posting a receive runs no
    // pass, so each side's ACK leaves in the same sendmmsg as its next SEND: one system call
    // per side per round, not two (400 and 400 when ACKs went at once)
    let calls = (a.ctx.stats().tx_calls - calls.0, b.ctx.stats().tx_calls - calls.1);
    eprintln!("sendmmsg calls in 200 rounds: a {}, b {}", calls.0, calls.1);
    assert!(calls.0 <= 250 && calls.1 <= 250, "ACKs went alone: {calls:?}");
    // a thread blocked in wait() is served by the backstop once it releases the cores
    let waiter = {
        let cq = a.cq.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + T;
            let mut wc = [EMPTY_WC];
            loop {
                if cq.poll(&mut wc) == 1 {
                    return wc[0];
                }
                assert!(std::time::Instant::now() < deadline, "no completion within {T:?}");
                cq.wait(Duration::from_millis(50));
            }
        })
    };
    a.qp.post_recv(RecvWr {
        wr_id: 999,
        sg_list: [a.mr.sge(900_000, 64)].into_iter().collect(),
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    b.qp.post_send(SendWr::new(7, WrOpcode::Send).sge(b.mr.sge(400_000, 64)))
        .unwrap();
    let w = waiter.join().unwrap();
    assert_eq!((w.wr_id, w.status), (999, WcStatus::Success));
}

/// One owner per QP: a state change travels to the QP's core behind the work requests posted
/// before it, so moving a QP to ERR right after posts flushes them (WR_FLUSH_ERR) and never
/// refuses them as posted to a QP in ERR (LOC_QP_OP_ERR), which is what a change applied beside
/// the queue instead of in it would do. The QP's peer address is a socket nobody reads, so no
/// post can complete before the change however the threads are scheduled (with a live peer a
/// loaded machine could finish them all first, and the test would prove nothing). Also over a
/// low-latency QP, whose posts run the core from the posting thread.
#[test]
fn a_state_change_after_posts_sees_those_posts() {
    for low_latency in [false, true] {
        let o = Opts {
            attr: QpInitAttr {
                low_latency,
                ..Default::default()
            },
            ..Default::default()
        };
        let a = side_with(&o);
        let b = side_with(&o);
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let std::net::SocketAddr::V4(silent_addr) = silent.local_addr().unwrap() else {
            unreachable!("bound to an IPv4 address")
        };
        let mut peer = b.qp.local_endpoint();
        peer.addr = silent_addr;
        a.qp.connect(&peer).unwrap();
        let n = 32;
        for i in 0..n {
            a.qp.post_send(
                SendWr::new(i, WrOpcode::RdmaWrite)
                    .sge(a.mr.sge(0, 65536))
                    .remote(b.mr.addr(), b.mr.rkey()),
            )
            .unwrap();
        }
        a.qp.modify_to_err();
        assert_eq!(a.qp.state(), QpState::Err);
        let st: Vec<(u64, WcStatus)> = (0..n)
            .map(|_| a.cq.next(T).map(|c| (c.wr_id, c.status)).expect("completion"))
            .collect();
        let want: Vec<(u64, WcStatus)> = (0..n).map(|i| (i, WcStatus::WrFlushErr)).collect();
        assert_eq!(st, want, "low_latency {low_latency}: every post flushed, in order");
        drop(silent);
        // a receive posted to the QP in ERR completes flushed, through the core
        a.qp.post_recv(RecvWr {
            wr_id: 99,
            sg_list: [a.mr.sge(0, 64)].into_iter().collect(),
        })
        .unwrap();
        let wc = a.cq.next(T).expect("flushed receive");
        assert_eq!((wc.wr_id, wc.status), (99, WcStatus::WrFlushErr));
    }
}
