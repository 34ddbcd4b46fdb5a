//! RedN programs (RedN Figs. 4, 5/6, 9 and 12) run by the engine on managed QPs after a client
//! SEND, with no server thread involved, over real UDP sockets on 127.0.0.1.

use netstack::redn::builder::{entry, ChainBuilder, Entry, Remote};
use netstack::redn::programs::{hash_get_request, insert_bucket, ClientBuffer, HashGetServer};
use netstack::redn::wqe::{self, off};
use netstack::verbs::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);
/// How long a test waits to be sure an answer does not come.
const SILENCE: Duration = Duration::from_millis(150);

/// The server: a context, memory, a worker with its loopback peer, and the client-facing
/// managed QP `q` (connected to the client's `c`).
struct Bench {
    sctx: Context,
    _spd: Pd,
    data: Mr,
    worker: Qp,
    _peer: Qp,
    wcq: Cq,
    wring: Mr,
    scratch: Mr,
    q: Qp,
    qring: Mr,
    rcq: Cq,
    _cctx: Context,
    c: Qp,
    ccq: Cq,
    cbuf: Mr,
}

fn bench(worker_slots: usize, q_slots: usize) -> Bench {
    bench_with(worker_slots, q_slots, ContextConfig::default())
}

fn bench_with(worker_slots: usize, q_slots: usize, cfg: ContextConfig) -> Bench {
    let sctx = Context::open(cfg).unwrap();
    let spd = sctx.alloc_pd();
    let data = spd.reg_mr(1 << 16, Access::ALL).unwrap();
    let wcq = sctx.create_cq_ignore_overrun(64).unwrap();
    let managed = |n| QpInitAttr {
        managed_slots: n,
        ..Default::default()
    };
    let worker = sctx.create_qp(&spd, &wcq, &wcq, managed(worker_slots)).unwrap();
    let peer = sctx.create_qp(&spd, &wcq, &wcq, QpInitAttr::default()).unwrap();
    worker.connect(&peer.local_endpoint()).unwrap();
    peer.connect(&worker.local_endpoint()).unwrap();
    let wring = worker.reg_wq_mr(&spd, Access::ALL).unwrap();
    let scratch = spd.reg_mr(64, Access::ALL).unwrap();
    let qcq = sctx.create_cq_ignore_overrun(64).unwrap();
    let rcq = sctx.create_cq_ignore_overrun(64).unwrap();
    let q = sctx.create_qp(&spd, &qcq, &rcq, managed(q_slots)).unwrap();
    let qring = q.reg_wq_mr(&spd, Access::ALL).unwrap();
    let cctx = Context::open(ContextConfig::default()).unwrap();
    let cpd = cctx.alloc_pd();
    let ccq = cctx.create_cq(256).unwrap();
    let c = cctx.create_qp(&cpd, &ccq, &ccq, QpInitAttr::default()).unwrap();
    let cbuf = cpd.reg_mr(4096, Access::ALL).unwrap();
    c.connect(&q.local_endpoint()).unwrap();
    q.connect(&c.local_endpoint()).unwrap();
    for i in 0..16 {
        c.post_recv(RecvWr {
            wr_id: 1000 + i,
            sg_list: [cbuf.sge(2048, 8)].into_iter().collect(),
        })
        .unwrap();
    }
    Bench {
        sctx,
        _spd: spd,
        data,
        worker,
        _peer: peer,
        wcq,
        wring,
        scratch,
        q,
        qring,
        rcq,
        _cctx: cctx,
        c,
        ccq,
        cbuf,
    }
}

impl Bench {
    fn builder(&self) -> ChainBuilder<'_> {
        ChainBuilder::new(&self.worker, &self.wcq, self.scratch.sge(0, 8), &self.wring).unwrap()
    }
    fn q_entry(&self, i: u64) -> Entry {
        entry(&self.q, i, self.qring.lkey(), self.qring.rkey()).unwrap()
    }
    fn data_at(&self, off: usize) -> Remote {
        Remote {
            addr: self.data.addr() + off as u64,
            rkey: self.data.rkey(),
        }
    }
    /// Posts a response entry on `q`: a WRITE_WITH_IMM of `len` bytes at data offset `src` to
    /// the client's buffer, posted as a NOOP that an `if` may turn on.
    fn response(&self, imm: u32, src: usize, len: u32, on: bool) -> Entry {
        let mut wr = SendWr::new(imm as u64, WrOpcode::RdmaWriteWithImm)
            .sge(self.data.sge(src, len as usize))
            .remote(self.cbuf.addr(), self.cbuf.rkey())
            .imm(imm)
            .flags(SendFlags(0));
        if !on {
            wr.opcode = WrOpcode::Noop;
        }
        let i = self.q.post_managed(&wr, 0).unwrap();
        self.q_entry(i)
    }
    /// The client's SEND of `msg`, and the immediate data of every answer within `SILENCE`.
    fn ask(&self, msg: &[u8]) -> Vec<u32> {
        self.cbuf.write(0, msg);
        self.c
            .post_send(SendWr::new(1, WrOpcode::Send).sge(self.cbuf.sge(0, msg.len())))
            .unwrap();
        let mut imms = Vec::new();
        let deadline = std::time::Instant::now() + SILENCE;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Some(wc) = self.ccq.next(left) else { break };
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            if wc.opcode == WcOpcode::RecvRdmaWithImm {
                imms.push(wc.imm_data.unwrap_or_default());
            }
        }
        imms
    }
}

/// RedN Fig. 4: `if (x == y) send(1) else send(0)`.
#[test]
fn fig4_if_sends_one_or_zero() {
    for (x, y, want) in [(42u64, 42u64, 1u64), (41, 42, 0)] {
        let b = bench(32, 4);
        b.data.write(8, &1u64.to_le_bytes()); // the 1 that R2 copies over R3's data
        let r3 = b.response(7, 0, 8, true);
        let mut ch = b.builder();
        ch.wait(b.rcq.cq_num(), b.rcq.produced() + 1).unwrap();
        // R2 (posted after the if's barrier, CAS, barrier): a NOOP whose operand x arrives with
        // the client's SEND; turned into a WRITE of 1 over R3's data when x == y
        let r2 = ch.worker_entry(b.worker.next_index() + 3).unwrap();
        ch.if_eq(r2, y, wqe::OP_WRITE, wqe::FLAG_SIGNALED).unwrap();
        let mut w = SendWr::new(0, WrOpcode::RdmaWrite)
            .sge(b.data.sge(8, 8))
            .remote(b.data.addr(), b.data.rkey())
            .flags(SendFlags::SIGNALED);
        w.opcode = WrOpcode::Noop;
        assert_eq!(ch.other(w, 0).unwrap(), r2.index);
        ch.barrier().unwrap();
        ch.enable(b.q.qp_num(), r3.index + 1).unwrap();
        let count = ch.count();
        assert_eq!((count.atomic, count.order), (1, 5), "{count:?}");
        ch.start().unwrap();
        drop(ch);
        b.q.post_recv(RecvWr {
            wr_id: 1,
            sg_list: [r2.sge(off::OPERAND, 6)].into_iter().collect(),
        })
        .unwrap();
        assert_eq!(b.ask(&x.to_le_bytes()[..6]), vec![7]);
        let mut got = [0u8; 8];
        b.cbuf.read(0, &mut got);
        assert_eq!(u64::from_le_bytes(got), want, "x = {x}, y = {y}");
        assert_eq!(b.sctx.redn_stats().aborts, 0);
    }
}

/// RedN Figs. 5 and 6: `i = 0; while (i < 4) { if (x == A[i]) send(i); i++ }`, unrolled, without
/// and with `break`.
fn search(x: u64, with_break: bool) -> (Vec<u32>, u64) {
    let a = [5u64, 7, 9, 7];
    let b = bench(128, 8);
    for (i, v) in a.iter().enumerate() {
        b.data.write(64 + 8 * i, &v.to_le_bytes());
    }
    // the break's template: an unsignaled NOOP word 0
    b.data.write(256, &wqe::word0(wqe::OP_NOOP, 0, 0).to_le_bytes());
    let mut ch = b.builder();
    let mut scatter = SgList::new();
    ch.wait(b.rcq.cq_num(), b.rcq.produced() + 1).unwrap();
    for i in 0..a.len() {
        let resp = b.response(i as u32, 0, 0, false);
        // copy A[i] next to the response's opcode, then if (x == A[i]) turn it on
        ch.copy(resp.sge(off::OPERAND, 6), b.data_at(64 + 8 * i)).unwrap();
        let brk = with_break.then(|| {
            // break: a NOOP that becomes a WRITE making this iteration's last entry unsignaled
            // after: this copy, the response's if (3), the break's if (3)
            let e = ch.worker_entry(b.worker.next_index() + 7).unwrap();
            ch.copy(e.sge(off::OPERAND, 6), b.data_at(64 + 8 * i)).unwrap();
            e
        });
        let cas = ch.if_eq(resp, 0, wqe::OP_WRITE_IMM, 0).unwrap();
        scatter.push(ch.worker_entry(cas).unwrap().sge(off::COMPARE_ADD + 2, 6));
        if let Some(e) = brk {
            let cas2 = ch.if_eq(e, 0, wqe::OP_WRITE, wqe::FLAG_SIGNALED).unwrap();
            scatter.push(ch.worker_entry(cas2).unwrap().sge(off::COMPARE_ADD + 2, 6));
            let last = ch.worker_entry(b.worker.next_index() + 2).unwrap();
            let mut w = SendWr::new(0, WrOpcode::RdmaWrite)
                .sge(b.data.sge(256, 8))
                .remote(last.addr, b.wring.rkey())
                .flags(SendFlags::SIGNALED);
            w.opcode = WrOpcode::Noop;
            assert_eq!(ch.other(w, 0).unwrap(), e.index);
            ch.barrier().unwrap();
            assert_eq!(
                ch.other(SendWr::noop(0).flags(SendFlags::SIGNALED), 0).unwrap(),
                last.index
            );
        }
        ch.enable(b.q.qp_num(), resp.index + 1).unwrap();
        // the next iteration starts after everything of this one completed: when a break made
        // the last entry unsignaled, this never happens
        ch.barrier().unwrap();
    }
    ch.start().unwrap();
    drop(ch);
    b.q.post_recv(RecvWr {
        wr_id: 1,
        sg_list: scatter.clone(),
    })
    .unwrap();
    let msg: Vec<u8> = std::iter::repeat_n(&x.to_le_bytes()[..6], scatter.len())
        .flatten()
        .copied()
        .collect();
    let imms = b.ask(&msg);
    (imms, b.sctx.redn_stats().steps)
}

#[test]
fn fig5_unrolled_while_sends_every_match() {
    let (imms, _) = search(7, false);
    assert_eq!(imms, vec![1, 3]);
    assert!(search(4, false).0.is_empty());
}

#[test]
fn fig6_break_stops_the_loop_at_the_first_match() {
    let (imms, steps) = search(7, true);
    assert_eq!(imms, vec![1], "the break kept iteration 3 from running");
    let (_, all_steps) = search(4, true);
    assert!(steps < all_steps, "a break runs fewer entries ({steps} vs {all_steps})");
}

/// RedN Fig. 12: walk a linked list of 8 nodes `{key, value address, next}`, unrolled, sending
/// the value of the node whose key matches.
#[test]
fn fig12_list_walk_returns_the_matching_value() {
    for (key, want) in [(1005u64, Some(5u8)), (1000, Some(0)), (2000, None)] {
        let b = bench(256, 16);
        // nodes at 1024 + 64 j, values (64 B) at 8192 + 64 j, staging at 4096 + 32 j
        let node = |j: usize| b.data.addr() + 1024 + 64 * j as u64;
        for j in 0..8 {
            let off = 1024 + 64 * j;
            b.data.write(off, &(1000 + j as u64).to_le_bytes());
            b.data
                .write(off + 8, &(b.data.addr() + 8192 + 64 * j as u64).to_le_bytes());
            b.data
                .write(off + 16, &if j < 7 { node(j + 1) } else { 0 }.to_le_bytes());
            b.data.write(8192 + 64 * j, &[j as u8; 64]);
        }
        let mut ch = b.builder();
        let mut scatter = SgList::new();
        ch.wait(b.rcq.cq_num(), b.rcq.produced() + 1).unwrap();
        let mut next_read: Option<Entry> = None;
        for j in 0..8 {
            let staging = 4096 + 32 * j;
            let resp = {
                let mut wr = SendWr::new(j as u64, WrOpcode::RdmaWriteWithImm)
                    .sge(Sge {
                        addr: 0,
                        length: 64,
                        lkey: b.data.lkey(),
                    })
                    .remote(b.cbuf.addr() + 64, b.cbuf.rkey())
                    .imm(j as u32)
                    .flags(SendFlags(0));
                wr.opcode = WrOpcode::Noop;
                b.q_entry(b.q.post_managed(&wr, 0).unwrap())
            };
            // READ node j into staging (its address: the client's head, or node j-1's next)
            let read = ch
                .copy(
                    b.data.sge(staging, 24),
                    Remote {
                        addr: 0,
                        rkey: b.data.rkey(),
                    },
                )
                .unwrap();
            let read_e = ch.worker_entry(read).unwrap();
            match next_read {
                None => scatter.push(read_e.sge(off::REMOTE_ADDR, 8)),
                Some(prev) => assert_eq!(prev.index, read_e.index),
            }
            ch.barrier().unwrap();
            let staged = |o: usize| b.data.sge(staging + o, if o == 0 { 6 } else { 8 });
            ch.write(resp.field(off::OPERAND), staged(0)).unwrap();
            ch.write(resp.field(off::LOCAL_ADDR), staged(8)).unwrap();
            if j < 7 {
                // the next iteration's READ comes after this WRITE, the if (3) and the ENABLE
                let nr = ch.worker_entry(b.worker.next_index() + 5).unwrap();
                ch.write(nr.field(off::REMOTE_ADDR), staged(16)).unwrap();
                next_read = Some(nr);
            }
            let cas = ch.if_eq(resp, 0, wqe::OP_WRITE_IMM, 0).unwrap();
            scatter.push(ch.worker_entry(cas).unwrap().sge(off::COMPARE_ADD + 2, 6));
            ch.enable(b.q.qp_num(), resp.index + 1).unwrap();
        }
        let c = ch.count();
        assert_eq!((c.copy, c.atomic, c.order), (8 * 4 - 1, 8, 1 + 8 * 4), "{c:?}");
        ch.start().unwrap();
        drop(ch);
        b.q.post_recv(RecvWr {
            wr_id: 1,
            sg_list: scatter,
        })
        .unwrap();
        let mut msg = node(0).to_le_bytes().to_vec();
        for _ in 0..8 {
            msg.extend_from_slice(&key.to_le_bytes()[..6]);
        }
        let imms = b.ask(&msg);
        match want {
            Some(j) => {
                assert_eq!(imms, vec![j as u32], "key {key}");
                let mut v = [0u8; 64];
                b.cbuf.read(64, &mut v);
                assert_eq!(v, [j; 64]);
            }
            None => assert!(imms.is_empty(), "key {key}: {imms:?}"),
        }
        assert_eq!(b.sctx.redn_stats().aborts, 0);
    }
}

/// RedN Fig. 9: hash get with two candidate buckets in parallel chains, as a recycled loop that
/// keeps serving while the server's application thread is blocked.
#[test]
fn fig9_hash_get_serves_from_either_bucket_while_the_server_is_blocked() {
    let sctx = Context::open(ContextConfig::default()).unwrap();
    let cctx = Context::open(ContextConfig::default()).unwrap();
    let (spd, cpd) = (sctx.alloc_pd(), cctx.alloc_pd());
    let table = spd.reg_mr(64 * 16, Access::ALL).unwrap();
    let values = spd.reg_mr(64 * 64, Access::ALL).unwrap();
    let (qcq, rcq) = (
        sctx.create_cq_ignore_overrun(64).unwrap(),
        sctx.create_cq_ignore_overrun(64).unwrap(),
    );
    let ccq = cctx.create_cq(1024).unwrap();
    let cbuf = cpd.reg_mr(4096, Access::ALL).unwrap();
    let mut qs = Vec::new();
    let mut cs = Vec::new();
    for _ in 0..2 {
        let q = sctx
            .create_qp(
                &spd,
                &qcq,
                &rcq,
                QpInitAttr {
                    managed_slots: 1,
                    ..Default::default()
                },
            )
            .unwrap();
        let c = cctx.create_qp(&cpd, &ccq, &ccq, QpInitAttr::default()).unwrap();
        c.connect(&q.local_endpoint()).unwrap();
        q.connect(&c.local_endpoint()).unwrap();
        qs.push(q);
        cs.push(c);
    }
    let h1 = |k: u64| k % 64;
    let h2 = |k: u64| (k * 7 + 3) % 64;
    // 40 keys, each in one of its two buckets (the second when the first is taken)
    let mut stored = Vec::new();
    for k in 1..=40u64 {
        let v = values.addr() + 64 * (stored.len() as u64);
        if insert_bucket(&table, &[h1(k), h2(k)], k, v).is_none() {
            continue;
        }
        values.write(64 * stored.len(), &[k as u8; 64]);
        stored.push(k);
    }
    let server = HashGetServer::new(
        &sctx,
        &spd,
        &[&qs[0], &qs[1]],
        &rcq,
        table.rkey(),
        values.lkey(),
        64,
        ClientBuffer {
            addr: cbuf.addr() + 512,
            rkey: cbuf.rkey(),
        },
    )
    .unwrap();
    let c = server.per_round;
    assert_eq!(
        (c.copy, c.atomic, c.order),
        (3, 1 + 7, 7),
        "per-round work requests {c:?}"
    );
    let gets = 3 * 16 + 5;
    server.post_recvs(&qs[0], gets + 8).unwrap();
    for c in &cs {
        for i in 0..gets {
            c.post_recv(RecvWr {
                wr_id: i as u64,
                sg_list: [cbuf.sge(3000, 4)].into_iter().collect(),
            })
            .unwrap();
        }
    }
    let table_addr = table.addr();
    // the server's application thread blocks holding everything; the engine serves on
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let blocked = std::thread::spawn(move || {
        let _keep = (server, qs, table, values, spd, rcq, qcq, sctx);
        let _ = rx.recv();
    });
    for n in 0..gets {
        let k = stored[n % stored.len()];
        let msg = hash_get_request(k, n as u32, &[table_addr + h1(k) * 16, table_addr + h2(k) * 16]);
        cbuf.write(0, &msg);
        cs[0]
            .post_send(SendWr::new(n as u64, WrOpcode::Send).sge(cbuf.sge(0, msg.len())))
            .unwrap();
        loop {
            let wc = ccq.next(T).expect("an answer");
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            if wc.opcode == WcOpcode::RecvRdmaWithImm {
                assert_eq!(wc.imm_data, Some(n as u32), "get {n} of key {k}");
                break;
            }
        }
        let mut v = [0u8; 64];
        cbuf.read(512, &mut v);
        assert_eq!(v, [k as u8; 64], "get {n} of key {k}");
    }
    // a key in neither bucket gets no answer
    let msg = hash_get_request(999, 7777, &[table_addr, table_addr + 16]);
    cbuf.write(0, &msg);
    cs[0]
        .post_send(SendWr::new(1, WrOpcode::Send).sge(cbuf.sge(0, msg.len())))
        .unwrap();
    let deadline = std::time::Instant::now() + SILENCE;
    while let Some(wc) = ccq.next(deadline.saturating_duration_since(std::time::Instant::now())) {
        assert_ne!(wc.opcode, WcOpcode::RecvRdmaWithImm, "a miss is not answered");
    }
    drop(tx);
    blocked.join().unwrap();
    drop((cs, cbuf, cpd, cctx));
}

/// A recycled loop that only waits on itself never ends: the per-chain guard aborts it, and
/// the context's other chains keep running.
#[test]
fn a_runaway_chain_is_aborted_and_others_keep_running() {
    let mut cfg = ContextConfig::default();
    cfg.redn.max_wr_per_chain = 5_000;
    let b = bench_with(10, 4, cfg);
    let mut ch = b.builder();
    ch.begin_loop();
    ch.other(SendWr::noop(0).flags(SendFlags::SIGNALED), 0).unwrap();
    ch.barrier().unwrap();
    ch.other(SendWr::noop(0), 0).unwrap();
    // tail: a barrier, 2 adds (the two barriers), WAIT, ENABLE, 2 adds: 7; body 3
    ch.recycle(10, &[]).unwrap();
    ch.start().unwrap();
    drop(ch);
    let t = std::time::Instant::now();
    while b.sctx.redn_stats().aborts == 0 {
        assert!(
            t.elapsed() < T,
            "the runaway chain was not aborted: {:?}",
            b.sctx.redn_stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let s = b.sctx.redn_stats();
    assert!(s.steps >= 5_000, "{s:?}");
    assert_eq!(b.worker.state(), QpState::Err);
    // a fresh worker on the same context runs its chain
    let wcq = b.sctx.create_cq(64).unwrap();
    let w2 = b
        .sctx
        .create_qp(
            &b._spd,
            &wcq,
            &wcq,
            QpInitAttr {
                managed_slots: 8,
                ..Default::default()
            },
        )
        .unwrap();
    let p2 = b.sctx.create_qp(&b._spd, &wcq, &wcq, QpInitAttr::default()).unwrap();
    w2.connect(&p2.local_endpoint()).unwrap();
    p2.connect(&w2.local_endpoint()).unwrap();
    b.data.write(0, &[9u8; 8]);
    w2.post_send(
        SendWr::new(5, WrOpcode::RdmaWrite)
            .sge(b.data.sge(0, 8))
            .remote(b.data.addr() + 64, b.data.rkey()),
    )
    .unwrap();
    w2.enable(1).unwrap();
    let wc = wcq.next(T).expect("the second chain runs");
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
    assert_eq!(b.data.load_u64(64), Some(u64::from_le_bytes([9; 8])));
}

/// The per-QP rate guard spaces a chain's segments out.
#[test]
fn the_rate_guard_throttles_a_chain() {
    let mut cfg = ContextConfig::default();
    cfg.redn.max_wr_per_sec = 2_000;
    let b = bench_with(512, 4, cfg);
    let mut ch = b.builder();
    for _ in 0..200 {
        ch.other(SendWr::noop(0).flags(SendFlags::SIGNALED), 0).unwrap();
        ch.barrier().unwrap();
    }
    let end = ch.completions();
    let t = std::time::Instant::now();
    ch.start().unwrap();
    drop(ch);
    while b.wcq.produced() < end {
        assert!(t.elapsed() < T);
        std::thread::sleep(Duration::from_millis(2));
    }
    // 400 entries at 2000/s after a burst of 64: at least 0.15 s
    assert!(t.elapsed() >= Duration::from_millis(150), "{:?}", t.elapsed());
    assert!(b.sctx.redn_stats().throttled > 0);
}

/// Bad entries abort the chain: an unknown opcode, a WAIT on a CQ that does not exist.
#[test]
fn malformed_entries_abort_the_chain() {
    for bad in [0u8, 1] {
        let b = bench(8, 4);
        if bad == 0 {
            b.worker.post_send(SendWr::noop(0)).unwrap();
            b.wring.write(0, &[0x77]);
        } else {
            b.worker.post_send(SendWr::wait(0, 9999, 1)).unwrap();
        }
        b.worker.enable(1).unwrap();
        let t = std::time::Instant::now();
        while b.sctx.redn_stats().aborts == 0 {
            assert!(t.elapsed() < T);
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(b.worker.state(), QpState::Err);
    }
}

/// A chain's entries reach only what their QP may: a READ or WRITE naming memory of another
/// protection domain (or a wrong rkey) completes with a remote access error and moves no byte.
#[test]
fn chain_entries_reach_only_what_their_qp_may() {
    for (what, write, other_pd) in [
        ("READ of another PD's memory", false, true),
        ("WRITE into another PD's memory", true, true),
        ("WRITE with a wrong rkey", true, false),
    ] {
        let b = bench(8, 4);
        let pd2 = b.sctx.alloc_pd();
        let secret = if other_pd {
            pd2.reg_mr(4096, Access::ALL).unwrap()
        } else {
            b._spd.reg_mr(4096, Access::ALL).unwrap()
        };
        secret.write(0, &[0x5A; 64]);
        b.scratch.write(0, &[0x11; 8]);
        let target = Remote {
            addr: secret.addr(),
            rkey: if other_pd { secret.rkey() } else { secret.rkey() ^ 0x01 },
        };
        let mut ch = b.builder();
        if write {
            ch.write(target, b.scratch.sge(0, 8)).unwrap();
        } else {
            ch.copy(b.scratch.sge(0, 8), target).unwrap();
        }
        ch.start().unwrap();
        let wc = b.wcq.next(T).expect("the refused entry completes");
        assert_eq!(wc.status, WcStatus::RemAccessErr, "{what}: {wc:?}");
        let mut s = [0u8; 64];
        secret.read(0, &mut s);
        assert_eq!(s, [0x5A; 64], "{what}: the target changed");
        assert_eq!(
            b.scratch.load_u64(0),
            Some(u64::from_le_bytes([0x11; 8])),
            "{what}: scratch changed"
        );
    }
}
