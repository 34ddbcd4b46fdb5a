//! netstack's verbs API, and the KV-cache engine on it, attached to a real `flexnsd` process
//! (`ContextConfig::flexnsd`): the same code that runs on an in-process engine runs through the
//! daemon, against an in-process peer; what only an in-process engine has is refused by name;
//! a daemon that dies flushes the outstanding work through the same API.

use netstack::verbs::*;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

mod common;
use common::Daemon;

impl Daemon {
    /// A context attached to this daemon.
    fn context(&self) -> Context {
        let ctx = Context::open(ContextConfig {
            flexnsd: Some(self.socket.clone()),
            ..Default::default()
        })
        .expect("attach");
        assert!(ctx.is_attached());
        ctx
    }

    /// Bytes the daemon's engine sent and received, all attachments together.
    fn engine_bytes(&self) -> u64 {
        let st = flexnsd::client::Attachment::connect(&self.socket, "stats")
            .unwrap()
            .engine_stats()
            .unwrap();
        st.tx_bytes + st.rx_bytes
    }
}

/// One side of a connection: a QP with its CQs and 1 MiB of registered memory.
struct Side {
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

const LEN: usize = 1 << 20;

fn side(ctx: &Context) -> Side {
    let pd = ctx.alloc_pd();
    let mr = pd.reg_mr(LEN, Access::ALL).unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    Side { _pd: pd, cq, qp, mr }
}

fn connect(a: &Side, b: &Side) {
    let (ea, eb) = (a.qp.local_endpoint(), b.qp.local_endpoint());
    a.qp.connect(&eb).unwrap();
    // the other side as a connection manager's acceptor does it (RTR as the peer named it,
    // then RTS), so both paths of the state machine go through
    b.qp.accept(&ea).unwrap();
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
}

fn next_ok(cq: &Cq, what: &str) -> Wc {
    let wc = cq
        .next(T)
        .unwrap_or_else(|| panic!("{what}: no completion within {T:?}"));
    assert_eq!(wc.status, WcStatus::Success, "{what}: {wc:?}");
    wc
}

/// Fresh bytes for one operation (data that did not exist at the target before it).
fn fresh(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// WRITE, READ, SEND with immediate, and both atomics from `a` to `b`, each checked at its
/// target; the same code whichever mode either context runs in.
fn exercise(a: &Side, b: &Side, seed: u64) {
    // WRITE 256 KiB into b
    let w = fresh(seed, 256 << 10);
    a.mr.write(0, &w);
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, w.len()))
            .remote(b.mr.addr() + 4096, b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(next_ok(&a.cq, "WRITE").opcode, WcOpcode::RdmaWrite);
    let mut got = vec![0u8; w.len()];
    b.mr.read(4096, &mut got);
    assert!(got == w, "WRITE: the target does not hold the bytes written");

    // READ 64 KiB of b's memory (fresh there) into a
    let r = fresh(seed + 1, 64 << 10);
    b.mr.write(512 << 10, &r);
    a.qp.post_send(
        SendWr::new(2, WrOpcode::RdmaRead)
            .sge(a.mr.sge(768 << 10, r.len()))
            .remote(b.mr.addr() + (512 << 10), b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(next_ok(&a.cq, "READ").byte_len as usize, r.len());
    let mut got = vec![0u8; r.len()];
    a.mr.read(768 << 10, &mut got);
    assert!(got == r, "READ: the local buffer does not hold the remote bytes");

    // SEND with immediate into a posted receive
    let m = fresh(seed + 2, 3000);
    b.qp.post_recv(RecvWr {
        wr_id: 77,
        sg_list: [b.mr.sge(900 << 10, 4096)].into_iter().collect(),
    })
    .unwrap();
    a.mr.write(100, &m);
    a.qp.post_send(
        SendWr::new(3, WrOpcode::SendWithImm)
            .sge(a.mr.sge(100, m.len()))
            .imm(0xfeed_0000 | seed as u32 & 0xffff),
    )
    .unwrap();
    next_ok(&a.cq, "SEND");
    let rwc = next_ok(&b.cq, "RECV");
    assert_eq!((rwc.wr_id, rwc.byte_len as usize), (77, m.len()));
    assert_eq!(rwc.imm_data, Some(0xfeed_0000 | seed as u32 & 0xffff));
    let mut got = vec![0u8; m.len()];
    b.mr.read(900 << 10, &mut got);
    assert!(got == m, "SEND: the receive buffer does not hold the message");

    // fetch-and-add, then compare-and-swap, on a word of b
    let word = 1000 << 10;
    let base = seed << 8;
    b.mr.write(word, &base.to_le_bytes());
    a.qp.post_send(
        SendWr::new(4, WrOpcode::AtomicFetchAndAdd)
            .sge(a.mr.sge(8, 8))
            .remote(b.mr.addr() + word as u64, b.mr.rkey())
            .atomic(5, 0),
    )
    .unwrap();
    next_ok(&a.cq, "FAA");
    assert_eq!(a.mr.load_u64(8), Some(base), "FAA returns the old value");
    a.qp.post_send(
        SendWr::new(5, WrOpcode::AtomicCmpAndSwp)
            .sge(a.mr.sge(16, 8))
            .remote(b.mr.addr() + word as u64, b.mr.rkey())
            .atomic(base + 5, 42),
    )
    .unwrap();
    next_ok(&a.cq, "CAS");
    assert_eq!(a.mr.load_u64(16), Some(base + 5), "CAS returns the old value");
    assert_eq!(b.mr.load_u64(word), Some(42), "CAS swapped");
}

/// The same code runs with the requester attached to flexnsd and the responder in-process,
/// the other way round, and both attached; the daemon's engine counts the bytes of the work,
/// so it is not an engine in this process that moved them.
#[test]
fn the_verbs_api_runs_unchanged_through_flexnsd() {
    let d = Daemon::start("modes");
    let local = Context::open(ContextConfig::default()).unwrap();
    for (i, (a_attached, b_attached)) in [(true, false), (false, true), (true, true)].into_iter().enumerate() {
        let ca = if a_attached { d.context() } else { local.clone() };
        let cb = if b_attached { d.context() } else { local.clone() };
        let (a, b) = (side(&ca), side(&cb));
        connect(&a, &b);
        let before = d.engine_bytes();
        exercise(&a, &b, 10 + i as u64);
        exercise(&b, &a, 20 + i as u64);
        let after = d.engine_bytes();
        assert!(
            after >= before + 2 * ((256 << 10) + (64 << 10) + 3000),
            "case {i}: the daemon's engine sent and received {} bytes, fewer than the work",
            after - before
        );
        // counters come from the daemon's engine
        let attached = if a_attached { &a } else { &b };
        let st = attached.qp.stats();
        assert!(st.tx_packets > 0 && st.rx_packets > 0, "case {i}: {st:?}");
        assert!(ca.stats().rx_datagrams > 0 && cb.stats().rx_datagrams > 0);
    }
}

/// What runs only in an in-process engine is refused through flexnsd with an error that names
/// it; nothing is silently dropped.
#[test]
fn what_runs_only_in_process_is_refused_by_name() {
    let d = Daemon::start("refused");
    let ctx = d.context();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(16).unwrap();
    let unsupported = |r: Result<(), VerbsError>, what: &str| match r {
        Err(VerbsError::Unsupported(m)) => assert!(m.contains(what), "{what}: {m}"),
        other => panic!("{what}: {other:?}"),
    };
    let managed = QpInitAttr {
        managed_slots: 16,
        ..Default::default()
    };
    unsupported(ctx.create_qp(&pd, &cq, &cq, managed).map(drop), "managed");
    let ll = QpInitAttr {
        low_latency: true,
        ..Default::default()
    };
    unsupported(ctx.create_qp(&pd, &cq, &cq, ll).map(drop), "low_latency");
    // caller memory that does not start on a page boundary cannot be moved into a memfd in
    // place (the page's first bytes are another allocation's): refused, the reason named
    let mut buf = vec![0u8; 3 << 16];
    let off = 8 + (4096 - buf.as_ptr() as usize % 4096) % 4096;
    // SAFETY: `buf` outlives the call, which refuses the span without touching it.
    let raw = unsafe { pd.reg_mr_raw(buf.as_mut_ptr().add(off), 1 << 16, Access::ALL) };
    unsupported(raw.map(drop), "page boundary");
    let shared = std::sync::Arc::new(netstack::mem::Region::alloc_shareable(1 << 20));
    let mr = pd.reg_region(shared.clone(), Access::ALL).unwrap();
    assert_eq!(mr.addr(), shared.addr());
    drop(mr);
    unsupported(ctx.create_cq_ignore_overrun(16).map(drop), "RedN");
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    unsupported(qp.set_paths(2, Default::default()), "one path");
    qp.set_paths(1, Default::default()).unwrap();
    unsupported(qp.post_managed(&SendWr::new(1, WrOpcode::Send), 0).map(drop), "managed");
    let handler = |_c: netstack::offload::OffloadCall| -> netstack::offload::HandlerFuture {
        Box::pin(async { Err(netstack::offload::OffloadError::Handler("unused".into())) })
    };
    match ctx
        .offload()
        .register_opcode(0x100, netstack::offload::QpFilter::Any, handler)
    {
        Err(netstack::offload::OffloadError::Unavailable(why)) => assert!(why.contains("flexnsd"), "{why}"),
        other => panic!("offload registration: {:?}", other.map(|_| ())),
    }
    unsupported(
        ctx.solar_client("127.0.0.1:7".parse().unwrap(), Default::default(), None)
            .map(drop),
        "Solar",
    );
    // a bad socket names itself
    let bad = Context::open(ContextConfig {
        flexnsd: Some("/nonexistent/flexnsd.sock".into()),
        ..Default::default()
    });
    match bad {
        Err(e) => assert!(e.to_string().contains("/nonexistent/flexnsd.sock"), "{e}"),
        Ok(_) => panic!("attached to a socket that does not exist"),
    }
}

/// A daemon killed with work outstanding: the receive posted through the verbs API completes
/// with WR_FLUSH_ERR within a second, the QP reads ERR and a new post is refused.
#[test]
fn a_daemon_that_dies_flushes_through_the_verbs_api() {
    let mut d = Daemon::start("dies");
    let local = Context::open(ContextConfig::default()).unwrap();
    let ctx = d.context();
    let (a, b) = (side(&ctx), side(&local));
    connect(&a, &b);
    a.qp.post_recv(RecvWr {
        wr_id: 9,
        sg_list: [a.mr.sge(0, 64)].into_iter().collect(),
    })
    .unwrap();
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let t0 = Instant::now();
    let wc = a.cq.next(T).expect("a flush completion");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "flushed after {:?}",
        t0.elapsed()
    );
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::WrFlushErr));
    assert_eq!(a.qp.state(), QpState::Err);
    assert!(a
        .qp
        .post_send(SendWr::new(1, WrOpcode::Send).sge(a.mr.sge(0, 8)))
        .is_err());
    // nothing more will come, and the wait says so at once
    let t0 = Instant::now();
    assert!(a.cq.next(Duration::from_secs(5)).is_none());
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "waited {:?} on a dead daemon",
        t0.elapsed()
    );
}

/// The KV-cache engine with its stack in flexnsd (`EngineConfig::set_flexnsd`, what
/// `kvcache-engine serve --flexnsd` sets) writes to and reads from an engine with an in-process
/// stack, and two attached engines transfer between themselves: every byte checked at its
/// target, the notification after its data, and the daemon counts the bytes it carried.
#[test]
fn the_kvcache_engine_runs_on_flexnsd() {
    use kvcache_engine::*;
    let d = Daemon::start("kvcache");
    let mk = |role: &str, attached: bool| {
        let mut c = EngineConfig::new(&format!("{role}-{}", std::process::id()), TransportKind::Flexns);
        c.slice_size = Some(64 << 10);
        c.transfer_timeout = T;
        if attached {
            c.set_flexnsd(d.socket.clone());
        }
        TransferEngine::new(c).unwrap()
    };
    let n = 3 << 20;
    for (i, (p_att, d_att)) in [(true, false), (false, true), (true, true)].into_iter().enumerate() {
        let (p, dec) = (mk(&format!("prefill{i}"), p_att), mk(&format!("decode{i}"), d_att));
        let local = p.allocate_memory(4 << 20, Location::Cpu(0)).unwrap();
        let remote = dec.allocate_memory(4 << 20, Location::Cpu(0)).unwrap();
        let data = fresh(100 + i as u64, n);
        local.write(0, &data);
        let before = d.engine_bytes();
        let seg = p.open_segment(dec.segment_name()).unwrap();
        p.transfer_sync_write(seg, local.addr(), remote.addr() + 4096, n as u64)
            .unwrap();
        let mut got = vec![0u8; n];
        remote.read(4096, &mut got);
        assert!(got == data, "case {i}: the written bytes differ at the target");
        // read part of it back elsewhere, fresh at the target first
        let back = fresh(200 + i as u64, 1 << 20);
        remote.write(4096, &back);
        p.transfer_sync_read(seg, local.addr() + (3 << 20), remote.addr() + 4096, 1 << 20)
            .unwrap();
        let mut got = vec![0u8; 1 << 20];
        local.read(3 << 20, &mut got);
        assert!(got == back, "case {i}: the bytes read back differ");
        // a batch with a notification: it arrives after its data
        let b = p.allocate_batch(2).unwrap();
        let reqs: Vec<TransferRequest> = (0..2u64)
            .map(|k| TransferRequest {
                opcode: Opcode::Write,
                source: local.addr() + k * 100_000,
                target: seg,
                target_offset: remote.addr() + (2 << 20) + k * 200_000,
                length: 100_000,
            })
            .collect();
        let note = Notification {
            name: "prefill".into(),
            msg: format!("case {i} landed"),
        };
        p.submit_with_notify(b, &reqs, seg, &note).unwrap();
        assert_eq!(p.wait_batch(b, T).unwrap().state, TransferState::Completed, "case {i}");
        assert_eq!(dec.wait_notify(T).expect("notification"), note);
        for k in 0..2usize {
            let mut v = vec![0u8; 100_000];
            remote.read((2 << 20) + k * 200_000, &mut v);
            assert!(v == data[k * 100_000..][..100_000], "case {i}: batch request {k}");
        }
        let carried = d.engine_bytes() - before;
        assert!(
            carried >= n as u64,
            "case {i}: the daemon's engine sent and received {carried} bytes for a {n}-byte write"
        );
    }
}

/// Page-aligned caller memory registered through an attached context (`reg_mr_raw`, what
/// flexns's libibverbs does for perftest's buffers) has its pages moved into a memfd in place:
/// the bytes it held are still there through the caller's own pointer, a peer's WRITE lands
/// where the caller reads it, and a READ takes what the caller wrote after registering. The same
/// pages are refused a second registration while the first lives, and taken again after it;
/// once the last registration goes they are private memory again, with their bytes.
#[test]
fn caller_memory_is_moved_into_a_memfd_in_place() {
    let d = Daemon::start("in-place");
    let local = Context::open(ContextConfig::default()).unwrap();
    let ctx = d.context();
    let (a, b) = (side(&ctx), side(&local));
    connect(&a, &b);
    // whole pages: the span shares no page with another allocation, which another thread
    // (another test) could be writing while the pages move
    let len = 6 * 4096;
    let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
    // SAFETY: a non-zero size; freed at the end, after the MR that uses it is gone.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!ptr.is_null());
    let before = fresh(1, len);
    // SAFETY: `ptr..ptr+len` is this allocation; no reference to it is held meanwhile.
    unsafe { std::ptr::copy_nonoverlapping(before.as_ptr(), ptr, len) };
    // SAFETY: page-aligned, readable and writable, valid until after the MR is dropped; no
    // other thread writes it.
    let mr = unsafe { a._pd.reg_mr_raw(ptr, len, Access::ALL) }.expect("registered in place");
    let mut now = vec![0u8; len];
    // SAFETY: as above; a copy out through the caller's pointer.
    unsafe { std::ptr::copy_nonoverlapping(ptr, now.as_mut_ptr(), len) };
    assert!(
        now == before,
        "the bytes under the caller's pointer changed when the pages moved"
    );
    // the peer WRITEs into it: the caller sees the bytes through its own pointer
    let w = fresh(2, 3 * 4096);
    b.mr.write(0, &w);
    b.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(b.mr.sge(0, w.len()))
            .remote(mr.addr() + 100, mr.rkey()),
    )
    .unwrap();
    next_ok(&b.cq, "WRITE into caller memory");
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(ptr.add(100), now.as_mut_ptr(), w.len()) };
    assert!(now[..w.len()] == w[..], "the WRITE did not land where the caller reads");
    // the caller writes through its pointer; the peer READs it
    let r = fresh(3, 4096);
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(r.as_ptr(), ptr.add(len - 4096), 4096) };
    b.qp.post_send(
        SendWr::new(2, WrOpcode::RdmaRead)
            .sge(b.mr.sge(8192, 4096))
            .remote(mr.addr() + (len - 4096) as u64, mr.rkey()),
    )
    .unwrap();
    next_ok(&b.cq, "READ of caller memory");
    let mut got = vec![0u8; 4096];
    b.mr.read(8192, &mut got);
    assert!(got == r, "the READ did not return what the caller wrote");
    // the same pages cannot be moved again while registered (a second file over the first
    // would part the two registrations silently); once deregistered, they can
    // SAFETY: as above.
    match unsafe { a._pd.reg_mr_raw(ptr, 4096, Access::ALL) } {
        Err(VerbsError::Unsupported(m)) => assert!(m.contains("registered already"), "{m}"),
        other => panic!("a second registration of the same pages: {:?}", other.map(|_| ())),
    }
    drop(mr);
    // SAFETY: as above.
    let again = unsafe { a._pd.reg_mr_raw(ptr, len, Access::ALL) }.expect("registered again");
    let mut now = vec![0u8; 4096];
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(ptr.add(len - 4096), now.as_mut_ptr(), 4096) };
    assert!(now == r, "the bytes changed when the pages moved a second time");
    let moved = || {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|l| l.contains("flexns-adopted"))
            .any(|l| {
                let (a, b) = l.split_whitespace().next().unwrap().split_once('-').unwrap();
                let (a, b) = (
                    usize::from_str_radix(a, 16).unwrap(),
                    usize::from_str_radix(b, 16).unwrap(),
                );
                a <= ptr as usize && (ptr as usize) < b
            })
    };
    assert!(moved(), "registered, the pages are a mapping of the memfd");
    drop(again);
    // deregistered, they are private memory again, with their bytes
    assert!(
        !moved(),
        "the pages are still the memfd's after the last registration went"
    );
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(ptr.add(len - 4096), now.as_mut_ptr(), 4096) };
    assert!(now == r, "the bytes changed when the pages became private again");
    // SAFETY: allocated above with this layout; the MR is gone (the pages stay a shared
    // mapping of the memfd, which the allocator may reuse as any memory).
    unsafe { std::alloc::dealloc(ptr, layout) };
}

/// A post the daemon's engine refuses (an atomic at an unaligned address) after an unsignaled
/// WRITE: its error completion arrives once the WRITE has completed, and the QP goes on
/// serving. The daemon used to count outstanding sends by completions, so the unsignaled WRITE
/// (which completes silently) stayed outstanding for ever and the error, held until the sends
/// before it complete, never came: the QP hung.
#[test]
fn a_refused_post_after_an_unsignaled_send_is_answered_and_the_qp_goes_on() {
    let d = Daemon::start("unsignaled");
    let local = Context::open(ContextConfig::default()).unwrap();
    let ctx = d.context();
    let (a, b) = (side(&ctx), side(&local));
    connect(&a, &b);
    let w = fresh(4, 4096);
    a.mr.write(0, &w);
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, 4096))
            .remote(b.mr.addr(), b.mr.rkey())
            .flags(SendFlags(0)),
    )
    .unwrap();
    a.qp.post_send(
        SendWr::new(2, WrOpcode::AtomicFetchAndAdd)
            .sge(a.mr.sge(8192, 8))
            .remote(b.mr.addr() + 4, b.mr.rkey())
            .atomic(1, 0),
    )
    .unwrap();
    let wc = a.cq.next(T).expect("the refused atomic's completion");
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::LocQpOpErr), "{wc:?}");
    // the refusal leaves the QP as it was, as the in-process engine's refusal at the post does
    assert_eq!(a.qp.state(), QpState::Rts);
    let mut got = vec![0u8; 4096];
    b.mr.read(0, &mut got);
    assert!(got == w, "the unsignaled WRITE did not land");
    a.qp.post_send(
        SendWr::new(3, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, 64))
            .remote(b.mr.addr() + 8192, b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(next_ok(&a.cq, "WRITE after the refusal").wr_id, 3);
}

/// A QP's `max_recv_wr` and `max_send_wr` bound what it holds outstanding through the daemon as
/// in-process: the post past them is refused at once with `QueueFull`, not later by the daemon
/// with an error completion that would leave the QP looking failed.
#[test]
fn queue_depths_are_the_qps_own_through_the_daemon() {
    let d = Daemon::start("depths");
    let ctx = d.context();
    let pd = ctx.alloc_pd();
    let mr = pd.reg_mr(1 << 16, Access::ALL).unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let cfg = RcConfig {
        max_recv_wr: 100,
        ..ctx.config().qp
    };
    let attr = QpInitAttr {
        config: Some(cfg),
        ..Default::default()
    };
    let qp = ctx.create_qp(&pd, &cq, &cq, attr).unwrap();
    let recv = |i: u64| RecvWr {
        wr_id: i,
        sg_list: [mr.sge(0, 64)].into_iter().collect(),
    };
    for i in 0..100 {
        qp.post_recv(recv(i)).unwrap();
    }
    match qp.post_recv(recv(100)) {
        Err(VerbsError::Post(netstack::transport::rc::PostError::QueueFull(_))) => {}
        other => panic!("the 101st receive: {other:?}"),
    }
    assert_eq!(qp.state(), QpState::Init);
    // nothing was refused behind the application's back
    assert!(cq.next(Duration::from_millis(200)).is_none());
}

/// INLINE sends through the daemon at depth: 3 × the QP's 64 bounce slots, mostly unsignaled
/// (every 16th signaled), each with its own payload copied at post time and the caller's buffer
/// overwritten right after the post, as INLINE allows. Every payload arrives as it was at its
/// post: no slot is rewritten while its send is in flight.
#[test]
fn inline_sends_at_depth_keep_their_payloads() {
    let d = Daemon::start("inline");
    let local = Context::open(ContextConfig::default()).unwrap();
    let ctx = d.context();
    let small = |c: &Context| {
        let pd = c.alloc_pd();
        let mr = pd.reg_mr(LEN, Access::ALL).unwrap();
        let cq = c.create_cq(1024).unwrap();
        let cfg = RcConfig {
            max_send_wr: 64,
            max_recv_wr: 64,
            ..c.config().qp
        };
        let attr = QpInitAttr {
            config: Some(cfg),
            ..Default::default()
        };
        let qp = c.create_qp(&pd, &cq, &cq, attr).unwrap();
        Side { _pd: pd, cq, qp, mr }
    };
    let (a, b) = (small(&ctx), small(&local));
    connect(&a, &b);
    const N: u64 = 3 * 64;
    const SZ: usize = 200;
    let recv = |i: u64| RecvWr {
        wr_id: i,
        sg_list: [b.mr.sge((i % 64) as usize * 256, 256)].into_iter().collect(),
    };
    for i in 0..64 {
        b.qp.post_recv(recv(i)).unwrap();
    }
    let payload = |i: u64| fresh(1000 + i, SZ);
    let (mut posted, mut received) = (0u64, 0u64);
    let deadline = std::time::Instant::now() + T;
    let mut wcs = [EMPTY_WC; 16];
    while received < N {
        assert!(std::time::Instant::now() < deadline, "{received} of {N} arrived");
        if posted < N {
            let data = payload(posted);
            a.mr.write(0, &data);
            let mut wr = SendWr::new(posted, WrOpcode::Send).sge(a.mr.sge(0, SZ));
            if posted % 16 != 15 {
                wr = wr.flags(SendFlags(0));
            }
            match a.qp.post_send_inline(wr, &data) {
                Ok(()) => {
                    // INLINE: the caller's bytes may change at once
                    a.mr.write(0, &[0xEE; SZ]);
                    posted += 1;
                }
                Err(VerbsError::Post(netstack::transport::rc::PostError::QueueFull(_))) => {}
                Err(e) => panic!("INLINE post {posted}: {e}"),
            }
        }
        let n = a.cq.poll(&mut wcs);
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        let n = b.cq.poll(&mut wcs);
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            assert_eq!(
                (wc.wr_id, wc.byte_len as usize),
                (received, SZ),
                "receives complete in order"
            );
            let mut got = vec![0u8; SZ];
            b.mr.read((received % 64) as usize * 256, &mut got);
            assert!(got == payload(received), "INLINE send {received} arrived changed");
            if received + 64 < N {
                b.qp.post_recv(recv(received + 64)).unwrap();
            }
            received += 1;
        }
    }
}
