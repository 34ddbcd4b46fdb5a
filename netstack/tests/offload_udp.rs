//! The offloading engine over real UDP sockets on 127.0.0.1: built-in handlers, custom handlers,
//! and every way a handler can fail, each answered without harming the QP or the data core.

use netstack::offload::builtin::{self, HashLayout, ListLayout};
use netstack::offload::*;
use netstack::verbs::*;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

struct Side {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn side(cfg: &ContextConfig) -> Side {
    let ctx = Context::open(cfg.clone()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(256).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let mr = pd.reg_mr(1 << 20, Access::ALL).unwrap();
    Side { ctx, pd, cq, qp, mr }
}

fn pair(cfg: &ContextConfig) -> (Side, Side) {
    let (a, b) = (side(cfg), side(cfg));
    a.qp.connect(&b.qp.local_endpoint()).unwrap();
    b.qp.connect(&a.qp.local_endpoint()).unwrap();
    (a, b)
}

/// Posts an offload and waits for its completion.
fn offload(c: &Side, opcode: u16, req: &[u8], resp_len: usize) -> Wc {
    c.qp.post_offload(7, opcode, req, c.mr.sge(0, resp_len)).unwrap();
    let wc = c.cq.next(T).expect("offload completion");
    assert_eq!(wc.opcode, WcOpcode::Offload);
    wc
}

fn resp(c: &Side, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    c.mr.read(0, &mut v);
    v
}

#[test]
fn batched_read_returns_every_range_in_one_response() {
    let (client, server) = pair(&ContextConfig::default());
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    server.mr.write(0, &data);
    let _h = server
        .ctx
        .offload()
        .register_opcode(builtin::BATCH_READ, QpFilter::Any, builtin::batch_read())
        .unwrap();
    let _d = server.ctx.offload().register_dma_region(&server.mr, false);
    let base = server.mr.addr();
    let ranges: Vec<(u64, u32)> = (0..32u64).map(|i| (base + i * 200 + 3, 64)).collect();
    let wc = offload(
        &client,
        builtin::BATCH_READ,
        &builtin::encode_batch_read(server.mr.rkey(), &ranges),
        4096,
    );
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(wc.byte_len, 32 * 64);
    let got = resp(&client, 32 * 64);
    for (i, (a, l)) in ranges.iter().enumerate() {
        let off = (a - base) as usize;
        assert_eq!(&got[i * 64..(i + 1) * 64], &data[off..off + *l as usize], "range {i}");
    }
    // a multi-packet response (3 packets of a 1024-byte MTU)
    let mut cfg = ContextConfig::default();
    cfg.qp.mtu = 1024;
    let (client, server) = pair(&cfg);
    server.mr.write(0, &data);
    let _h = server
        .ctx
        .offload()
        .register_opcode(builtin::BATCH_READ, QpFilter::Any, builtin::batch_read())
        .unwrap();
    let _d = server.ctx.offload().register_dma_region(&server.mr, false);
    let base = server.mr.addr();
    let wc = offload(
        &client,
        builtin::BATCH_READ,
        &builtin::encode_batch_read(server.mr.rkey(), &[(base, 2000), (base + 5000, 700)]),
        8192,
    );
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 2700));
    let got = resp(&client, 2700);
    assert_eq!(&got[..2000], &data[..2000]);
    assert_eq!(&got[2000..], &data[5000..5700]);
    assert_eq!(server.ctx.offload().stats().dma_ops, 2, "one DMA per range");
}

fn build_list(mr: &Mr, n: u64, value_len: usize) -> u64 {
    let node = 16 + value_len;
    for i in 0..n {
        let off = (i as usize) * node;
        let next = if i + 1 < n { mr.addr() + (off + node) as u64 } else { 0 };
        mr.write(off, &(1000 + i).to_le_bytes());
        mr.write(off + 8, &next.to_le_bytes());
        mr.write(off + 16, &vec![i as u8 + 1; value_len]);
    }
    mr.addr()
}

#[test]
fn list_walk_finds_misses_and_stops_at_its_hop_bound() {
    let (client, server) = pair(&ContextConfig::default());
    let head = build_list(&server.mr, 8, 64);
    let _h = server
        .ctx
        .offload()
        .register_opcode(
            builtin::LIST_WALK,
            QpFilter::Any,
            builtin::list_walk(ListLayout::packed(64)),
        )
        .unwrap();
    let _d = server.ctx.offload().register_dma_region(&server.mr, false);
    let wc = offload(
        &client,
        builtin::LIST_WALK,
        &builtin::encode_list_walk(1007, head, 16, server.mr.rkey()),
        128,
    );
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 72));
    let r = resp(&client, 72);
    assert_eq!(u32::from_le_bytes(r[..4].try_into().unwrap()), builtin::FOUND);
    assert_eq!(u32::from_le_bytes(r[4..8].try_into().unwrap()), 8, "eight hops");
    assert_eq!(&r[8..], &[8u8; 64][..]);
    let wc = offload(
        &client,
        builtin::LIST_WALK,
        &builtin::encode_list_walk(5, head, 16, server.mr.rkey()),
        128,
    );
    assert_eq!(wc.byte_len, 8);
    assert_eq!(resp(&client, 4), builtin::NOT_FOUND.to_le_bytes());
    let wc = offload(
        &client,
        builtin::LIST_WALK,
        &builtin::encode_list_walk(1007, head, 3, server.mr.rkey()),
        128,
    );
    assert_eq!(wc.byte_len, 8);
    assert_eq!(resp(&client, 4), builtin::HOP_LIMIT.to_le_bytes());
    // a head outside the registered region is a DMA fault, not an access
    let wc = offload(
        &client,
        builtin::LIST_WALK,
        &builtin::encode_list_walk(1, 0x10, 16, server.mr.rkey()),
        128,
    );
    assert_eq!(wc.status, WcStatus::RemOpErr);
    assert_eq!(wc.vendor_err, OffloadStatus::DmaFault as u32);
    assert_eq!(client.qp.state(), QpState::Rts, "a failed offload leaves the QP usable");
}

#[test]
fn hash_lookup_follows_the_overflow_chain() {
    let (client, server) = pair(&ContextConfig::default());
    // 4 buckets of 64 B (3 slots of 16 B + link word at 56), entries at 4096.., overflow at 512
    let m = &server.mr;
    let layout = HashLayout {
        rkey: m.rkey(),
        table_addr: m.addr(),
        buckets: 4,
        bucket_len: 64,
        slots: 3,
        slot_len: 16,
        key_off: 0,
        ptr_off: 8,
        link_off: 56,
        data_base: m.addr(),
        ptr_mask: u64::MAX >> 16,
        len_off: 0,
        value_off: 8,
        max_value: 1024,
        max_chain: 4,
    };
    let put = |slot_addr: usize, key: u64, entry: usize, value: &[u8]| {
        m.write(slot_addr, &key.to_le_bytes());
        m.write(slot_addr + 8, &(entry as u64 | 0xAB << 48).to_le_bytes());
        m.write(entry, &(value.len() as u32).to_le_bytes());
        m.write(entry + 8, value);
    };
    // bucket 2 full of other keys, its overflow bucket (at 512) holds key 77
    for s in 0..3 {
        put(2 * 64 + s * 16, 10 + s as u64, 4096 + s * 256, b"other");
    }
    m.write(2 * 64 + 56, &(m.addr() + 512).to_le_bytes());
    put(512, 77, 8192, b"value of seventy-seven");
    let _h = server
        .ctx
        .offload()
        .register_opcode(builtin::HASH_LOOKUP, QpFilter::Any, builtin::hash_lookup(layout))
        .unwrap();
    let _d = server.ctx.offload().register_dma_region(&server.mr, false);
    let wc = offload(&client, builtin::HASH_LOOKUP, &builtin::encode_hash_lookup(77, 2), 256);
    assert_eq!(wc.status, WcStatus::Success);
    let r = resp(&client, wc.byte_len as usize);
    assert_eq!(u32::from_le_bytes(r[..4].try_into().unwrap()), builtin::FOUND);
    assert_eq!(
        u32::from_le_bytes(r[4..8].try_into().unwrap()),
        2,
        "two buckets visited"
    );
    assert_eq!(&r[8..], b"value of seventy-seven");
    let wc = offload(&client, builtin::HASH_LOOKUP, &builtin::encode_hash_lookup(11, 2), 256);
    assert_eq!(&resp(&client, wc.byte_len as usize)[8..], b"other");
    let wc = offload(&client, builtin::HASH_LOOKUP, &builtin::encode_hash_lookup(78, 2), 256);
    assert_eq!(resp(&client, 4), builtin::NOT_FOUND.to_le_bytes());
    // a bucket past the table is a bad request
    let wc2 = offload(&client, builtin::HASH_LOOKUP, &builtin::encode_hash_lookup(78, 9), 256);
    assert_eq!(
        (wc.status, wc2.vendor_err),
        (WcStatus::Success, OffloadStatus::BadRequest as u32)
    );
}

#[test]
fn failures_are_answered_and_the_engine_keeps_serving() {
    let mut cfg = ContextConfig::default();
    cfg.offload.threads = 2;
    let (client, server) = pair(&cfg);
    let off = server.ctx.offload();
    // (printing a panic's backtrace may take longer than the default budget)
    let _panics = off
        .register_with_budget(
            0x10,
            QpFilter::Any,
            |_call: OffloadCall| async move {
                if std::hint::black_box(true) {
                    panic!("handler bug");
                }
                Err(OffloadError::Handler("unreachable".into()))
            },
            Duration::from_secs(5),
        )
        .unwrap();
    let _slow = off
        .register_with_budget(
            0x11,
            QpFilter::Any,
            |call: OffloadCall| async move {
                tokio::time::sleep(Duration::from_secs(5)).await;
                call.submit_resp()
            },
            Duration::from_millis(30),
        )
        .unwrap();
    let _spin = off
        .register_with_budget(
            0x12,
            QpFilter::Any,
            |call: OffloadCall| async move {
                // blocks its offload thread outright
                std::thread::sleep(Duration::from_millis(300));
                call.submit_resp()
            },
            Duration::from_millis(30),
        )
        .unwrap();
    let _long = off
        .register_opcode(0x13, QpFilter::Any, |mut call: OffloadCall| async move {
            call.alloc_resp(call.resp_capacity())?;
            call.submit_resp()
        })
        .unwrap();
    let _echo = off
        .register_opcode(
            0x14,
            QpFilter::Qpns(vec![server.qp.qp_num()]),
            |mut call: OffloadCall| async move {
                let req = call.request().to_vec();
                call.alloc_resp(req.len())?;
                call.resp_mut().copy_from_slice(&req);
                call.submit_resp()
            },
        )
        .unwrap();
    assert!(
        off.register_opcode(0x14, QpFilter::Any, builtin::batch_read()).is_err(),
        "an opcode is registered once per QP"
    );
    assert!(off
        .register_opcode(0xFF01, QpFilter::Any, builtin::batch_read())
        .is_err());

    let wc = offload(&client, 0x10, b"x", 64);
    assert_eq!(
        (wc.status, wc.vendor_err),
        (WcStatus::RemOpErr, OffloadStatus::Panicked as u32)
    );
    let wc = offload(&client, 0x99, b"x", 64);
    assert_eq!(wc.vendor_err, OffloadStatus::NoHandler as u32);
    let t = Instant::now();
    let wc = offload(&client, 0x11, b"x", 64);
    assert_eq!(wc.vendor_err, OffloadStatus::Timeout as u32);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "answered at the budget, not when the handler ends"
    );
    let wc = offload(&client, 0x13, b"x", 64);
    assert_eq!(
        (wc.status, wc.byte_len),
        (WcStatus::Success, 64),
        "a full buffer is fine"
    );

    // a handler blocking its thread neither stalls the data core nor the other offload thread
    let t = Instant::now();
    client.qp.post_offload(1, 0x12, b"x", client.mr.sge(0, 64)).unwrap();
    client
        .qp
        .post_send(
            SendWr::new(2, WrOpcode::RdmaRead)
                .sge(client.mr.sge(4096, 64))
                .remote(server.mr.addr(), server.mr.rkey()),
        )
        .unwrap();
    let first = client.cq.next(T).unwrap();
    let second = client.cq.next(T).unwrap();
    assert_eq!((first.wr_id, first.vendor_err), (1, OffloadStatus::Timeout as u32));
    assert_eq!((second.wr_id, second.status), (2, WcStatus::Success));
    assert!(t.elapsed() < Duration::from_millis(250), "{:?}", t.elapsed());
    let wc = offload(&client, 0x14, b"still serving", 64);
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 13));
    assert_eq!(resp(&client, 13), b"still serving");
    let s = off.stats();
    assert_eq!((s.panics, s.no_handler), (1, 1));
    assert!(s.timeouts >= 1);
    assert_eq!(client.qp.state(), QpState::Rts);
    drop(server.pd);
}

#[test]
fn bad_offload_posts_are_refused_locally() {
    let (client, _server) = pair(&ContextConfig::default());
    let big = vec![0u8; 5000];
    assert!(
        client.qp.post_offload(1, 1, &big, client.mr.sge(0, 64)).is_err(),
        "request over the MTU"
    );
    assert!(
        client.qp.post_offload(1, 1, b"x", client.mr.sge(0, 2 << 20)).is_err(),
        "response buffer over 1 MiB"
    );
    assert_eq!(client.qp.state(), QpState::Rts);
}

/// A handler that DMA-writes 16 bytes of 0xEE to `addr` with `rkey` (request: rkey u32, addr u64).
fn dma_writer() -> impl OffloadHandler {
    |mut call: OffloadCall| async move {
        let r = call.request();
        let rkey = u32::from_le_bytes(r[..4].try_into().unwrap());
        let addr = u64::from_le_bytes(r[4..12].try_into().unwrap());
        call.alloc_resp(16)?;
        call.resp_mut().fill(0xEE);
        let id = call.submit_dma(DmaOp::Write, rkey, addr, 0, 16)?;
        call.wait_dma(id).await?;
        call.submit_resp()
    }
}

fn write_req(rkey: u32, addr: u64) -> Vec<u8> {
    let mut v = rkey.to_le_bytes().to_vec();
    v.extend_from_slice(&addr.to_le_bytes());
    v
}

fn snapshot(mr: &Mr) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.read(0, &mut v);
    v
}

/// Offload DMA is checked as the requesting QP's own READ or WRITE would be: rkey, protection
/// domain, access flags, bounds and the server's opt-in. Each refusal is a DMA fault that
/// touches no memory, and the QP keeps serving.
#[test]
fn offload_dma_reaches_only_what_the_requesting_qp_may() {
    let (client, server) = pair(&ContextConfig::default());
    let off = server.ctx.offload();
    let _r = off
        .register_opcode(builtin::BATCH_READ, QpFilter::Any, builtin::batch_read())
        .unwrap();
    let _w = off.register_opcode(0x20, QpFilter::Any, dma_writer()).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
    server.mr.write(0, &data);
    let _d = off.register_dma_region(&server.mr, true);
    // memory of another protection domain on the same context, opted in for offloads
    let pd_b = server.ctx.alloc_pd();
    let other = pd_b.reg_mr(4096, Access::ALL).unwrap();
    other.write(0, &[0x5A; 4096]);
    let _do = off.register_dma_region(&other, true);
    // a read-only grant (REMOTE_READ only), opted in as writable
    let ro = server
        .pd
        .reg_mr(4096, Access::REMOTE_READ | Access::LOCAL_WRITE)
        .unwrap();
    ro.write(0, &[0x33; 4096]);
    let _dr = off.register_dma_region(&ro, true);
    // writable by clients, but opted in for offloads read-only
    let rw = server.pd.reg_mr(4096, Access::ALL).unwrap();
    let _drw = off.register_dma_region(&rw, false);
    // same PD and rkey valid, but never opted in
    let hidden = server.pd.reg_mr(4096, Access::ALL).unwrap();
    hidden.write(0, &[0x77; 4096]);
    let before: Vec<Vec<u8>> = [&server.mr, &other, &ro, &rw, &hidden].map(snapshot).to_vec();

    let fault = |wc: Wc, what: &str| {
        assert_eq!(
            (wc.status, wc.vendor_err),
            (WcStatus::RemOpErr, OffloadStatus::DmaFault as u32),
            "{what}"
        );
    };
    let read = |rkey: u32, addr: u64| {
        offload(
            &client,
            builtin::BATCH_READ,
            &builtin::encode_batch_read(rkey, &[(addr, 64)]),
            64,
        )
    };
    // the baseline: the QP's own region, with its rkey
    let wc = read(server.mr.rkey(), server.mr.addr() + 100);
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(resp(&client, 64), &data[100..164]);
    fault(
        read(other.rkey(), other.addr()),
        "a region of another protection domain",
    );
    fault(
        read(server.mr.rkey() ^ 0x01, server.mr.addr()),
        "a wrong rkey (other generation)",
    );
    fault(
        read(other.rkey(), server.mr.addr()),
        "the right address with another region's rkey",
    );
    fault(read(hidden.rkey(), hidden.addr()), "a region not opted in for offloads");
    fault(
        read(server.mr.rkey(), server.mr.addr() + (1 << 20) - 32),
        "a range past the region's end",
    );
    let write = |rkey: u32, addr: u64| offload(&client, 0x20, &write_req(rkey, addr), 16);
    fault(write(ro.rkey(), ro.addr()), "a write into a REMOTE_READ-only region");
    fault(write(rw.rkey(), rw.addr()), "a write into a region opted in read-only");
    fault(
        write(other.rkey(), other.addr()),
        "a write into another protection domain",
    );
    // a QP of the other protection domain cannot reach the first one's memory either
    let qp_b = server
        .ctx
        .create_qp(&pd_b, &server.cq, &server.cq, QpInitAttr::default())
        .unwrap();
    let qp_c = client
        .ctx
        .create_qp(&client.pd, &client.cq, &client.cq, QpInitAttr::default())
        .unwrap();
    qp_c.connect(&qp_b.local_endpoint()).unwrap();
    qp_b.connect(&qp_c.local_endpoint()).unwrap();
    let req = builtin::encode_batch_read(server.mr.rkey(), &[(server.mr.addr(), 64)]);
    qp_c.post_offload(9, builtin::BATCH_READ, &req, client.mr.sge(0, 64))
        .unwrap();
    fault(
        client.cq.next(T).unwrap(),
        "a QP of another PD naming the first PD's rkey",
    );
    // while the same QP reaches its own PD's memory
    let req = builtin::encode_batch_read(other.rkey(), &[(other.addr(), 64)]);
    qp_c.post_offload(10, builtin::BATCH_READ, &req, client.mr.sge(0, 64))
        .unwrap();
    let wc = client.cq.next(T).unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(resp(&client, 64), vec![0x5A; 64]);
    // nothing was touched, and the first QP still serves: its permitted write lands
    let after: Vec<Vec<u8>> = [&server.mr, &other, &ro, &rw, &hidden].map(snapshot).to_vec();
    assert!(before == after, "a refused DMA changed memory");
    let wc = write(server.mr.rkey(), server.mr.addr() + 64);
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(&snapshot(&server.mr)[64..80], &[0xEE; 16]);
    // a deregistered region is gone for offloads too
    let (k, a) = (hidden.rkey(), hidden.addr());
    let _dh = off.register_dma_region(&hidden, false);
    assert_eq!(read(k, a).status, WcStatus::Success);
    drop(hidden);
    fault(read(k, a), "a deregistered region");
    assert_eq!(client.qp.state(), QpState::Rts);
    assert_eq!(off.stats().dma_ops, 4, "only the permitted DMAs ran");
}

#[test]
fn inline_handlers_run_on_the_receiving_core_and_go_on_elsewhere_when_they_wait() {
    use std::sync::{Arc, Mutex};
    let (client, server) = pair(&ContextConfig::default());
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
    server.mr.write(0, &data);
    let off = server.ctx.offload();
    let _d = off.register_dma_region(&server.mr, false);
    // a built-in, inline: the same answer as on the offload threads
    let _b = off
        .register_inline(builtin::BATCH_READ, QpFilter::Any, builtin::batch_read())
        .unwrap();
    let base = server.mr.addr();
    let req = builtin::encode_batch_read(server.mr.rkey(), &[(base + 10, 100), (base + 3000, 50)]);
    let wc = offload(&client, builtin::BATCH_READ, &req, 4096);
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 150), "{wc:?}");
    let got = resp(&client, 150);
    assert_eq!(&got[..100], &data[10..110]);
    assert_eq!(&got[100..], &data[3000..3050]);
    // where a handler runs: on the data core's thread until it waits, then on an offload thread
    let threads: Arc<Mutex<Vec<String>>> = Arc::default();
    let name = || std::thread::current().name().unwrap_or("").to_string();
    let t = threads.clone();
    let _w = off
        .register_inline(0x0C01, QpFilter::Any, move |mut call: OffloadCall| {
            let t = t.clone();
            async move {
                t.lock().unwrap().push(name());
                if call.request() == b"wait" {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    t.lock().unwrap().push(name());
                }
                call.alloc_resp(4)?;
                call.resp_mut().copy_from_slice(b"done");
                call.submit_resp()
            }
        })
        .unwrap();
    let wc = offload(&client, 0x0C01, b"now", 64);
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 4), "{wc:?}");
    assert_eq!(&resp(&client, 4), b"done");
    let wc = offload(&client, 0x0C01, b"wait", 64);
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 4), "{wc:?}");
    let seen = threads.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(
        seen[0].starts_with("flexns-core") && seen[1].starts_with("flexns-core"),
        "{seen:?}"
    );
    assert!(seen[2].starts_with("flexns-offload"), "after its wait: {seen:?}");
    // a panic and a DMA fault inline: answered, and the QP and core keep serving
    let _p = off
        .register_inline(0x0C02, QpFilter::Any, |_call: OffloadCall| async move {
            if std::hint::black_box(true) {
                panic!("inline handler panics (expected by the test)");
            }
            Err(OffloadError::Handler("unreachable".into()))
        })
        .unwrap();
    let wc = offload(&client, 0x0C02, b"x", 64);
    assert_eq!(
        (wc.status, wc.vendor_err),
        (WcStatus::RemOpErr, OffloadStatus::Panicked as u32),
        "{wc:?}"
    );
    let wc = offload(
        &client,
        builtin::BATCH_READ,
        &builtin::encode_batch_read(server.mr.rkey(), &[(base + (1 << 20) - 8, 64)]),
        4096,
    );
    assert_eq!(
        (wc.status, wc.vendor_err),
        (WcStatus::RemOpErr, OffloadStatus::DmaFault as u32),
        "{wc:?}"
    );
    let wc = offload(&client, builtin::BATCH_READ, &req, 4096);
    assert_eq!(wc.status, WcStatus::Success);
    let st = off.stats();
    assert_eq!((st.ok, st.panics, st.errors), (4, 1, 1), "{st:?}");
}

/// A response buffer just short of a multiple of the MTU: the LAST packet gives 8 bytes to the
/// result, so it carries no data and starts past the buffer's end. The requester dropped it as
/// not fitting and the offload ended in RETRY_EXC_ERR (found by the whole-stack simulator).
#[test]
fn a_last_response_packet_with_only_the_result_is_accepted() {
    let (client, server) = pair(&ContextConfig::default());
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 11 % 251) as u8).collect();
    server.mr.write(0, &data);
    let off = server.ctx.offload();
    let _h = off
        .register_inline(builtin::BATCH_READ, QpFilter::Any, builtin::batch_read())
        .unwrap();
    let _d = off.register_dma_region(&server.mr, false);
    let mtu = client.qp.config().mtu as usize;
    for cap in [mtu - 6, mtu - 1, 2 * mtu - 3] {
        let want = cap.min(3000);
        let req = builtin::encode_batch_read(server.mr.rkey(), &[(server.mr.addr(), want as u32)]);
        let wc = offload(&client, builtin::BATCH_READ, &req, cap);
        assert_eq!(
            (wc.status, wc.byte_len as usize),
            (WcStatus::Success, want),
            "buffer of {cap}: {wc:?}"
        );
        assert_eq!(resp(&client, want), data[..want], "buffer of {cap}");
    }
}
