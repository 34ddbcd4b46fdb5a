//! Unpredictable identifiers (issue 43, item 4): memory keys, QP numbers and initial PSNs are
//! drawn at random per context, as an RNIC draws an rkey's key byte and starts QPNs and PSNs
//! unpredictably, so that an identifier guessed or seen elsewhere reaches nothing. Real
//! contexts over UDP on 127.0.0.1, and simulated ones whose identifiers follow from the seed.

use netstack::link::sim::{Faults, SimNet};
use netstack::mem::Region;
use netstack::verbs::*;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);
const MASK24: u32 = 0xFF_FFFF;

/// A connected pair of QPs between two contexts, each with its own CQ.
struct Conn {
    cq: Cq,
    qp: Qp,
    _peer: (Cq, Qp),
}

fn connect(a: &Context, apd: &Pd, b: &Context, bpd: &Pd) -> Conn {
    let (ca, cb) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let qa = a.create_qp(apd, &ca, &ca, QpInitAttr::default()).unwrap();
    let qb = b.create_qp(bpd, &cb, &cb, QpInitAttr::default()).unwrap();
    qa.connect(&qb.local_endpoint()).unwrap();
    qb.connect(&qa.local_endpoint()).unwrap();
    Conn {
        cq: ca,
        qp: qa,
        _peer: (cb, qb),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// Two contexts' first memory regions: each one's rkey differs from its lkey, and neither key
/// is the other context's (a constant first key would let one captured or guessed key open
/// every server's first region).
#[test]
fn each_context_draws_its_own_keys_and_an_rkey_is_not_the_lkey() {
    let mut keys = Vec::new();
    let mut ctxs = Vec::new();
    for _ in 0..3 {
        let ctx = Context::open(ContextConfig::default()).unwrap();
        let mr = ctx.alloc_pd().reg_mr(4096, Access::ALL).unwrap();
        assert_ne!(mr.rkey(), mr.lkey(), "a region's rkey is not its lkey");
        keys.push((mr.lkey(), mr.rkey()));
        ctxs.push((ctx, mr));
    }
    for i in 0..keys.len() {
        for j in i + 1..keys.len() {
            // 32 random bits each: equal by chance with odds 2^-32
            assert_ne!(keys[i].1, keys[j].1, "first rkeys of two contexts: {keys:x?}");
            assert_ne!(keys[i].0, keys[j].0, "first lkeys of two contexts: {keys:x?}");
        }
    }
}

/// A peer reaches registered memory only with the region's current rkey: not with its lkey,
/// and not with the rkey of an earlier registration of the same memory (deregistered, then
/// registered again in the same slot of the table). Each refused READ or WRITE completes
/// with a remote access error and touches no byte on either side; the current rkey works.
#[test]
fn only_the_current_rkey_reaches_memory() {
    let server = Context::open(ContextConfig::default()).unwrap();
    let client = Context::open(ContextConfig::default()).unwrap();
    let (spd, cpd) = (server.alloc_pd(), client.alloc_pd());
    let local = cpd.reg_mr(8192, Access::ALL).unwrap();
    let region = Arc::new(Region::alloc(8192));
    let secret = pattern(8192, 0x5A);
    region.write(0, &secret);
    let old = spd.reg_region(region.clone(), Access::ALL).unwrap();
    let stale = old.rkey();
    // the old registration works while it lives
    let c = connect(&client, &cpd, &server, &spd);
    c.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaRead)
            .sge(local.sge(0, 4096))
            .remote(region.addr(), stale),
    )
    .unwrap();
    assert_eq!(c.cq.next(T).expect("read completion").status, WcStatus::Success);
    assert!(local.region().equals(0, &secret[..4096]));
    drop(old);
    let new = spd.reg_region(region.clone(), Access::ALL).unwrap();
    assert_ne!(new.rkey(), stale, "re-registration draws a new rkey");
    local.region().fill(0, 8192, 0);
    for (what, key) in [("stale rkey", stale), ("lkey", new.lkey())] {
        // a remote access error ends the requester's QP: a fresh connection per attempt
        let c = connect(&client, &cpd, &server, &spd);
        c.qp.post_send(
            SendWr::new(2, WrOpcode::RdmaRead)
                .sge(local.sge(0, 4096))
                .remote(region.addr(), key),
        )
        .unwrap();
        let wc = c.cq.next(T).expect("read completion");
        assert_eq!(wc.status, WcStatus::RemAccessErr, "READ with the {what} {key:#x}");
        assert!(
            local.region().equals(0, &[0u8; 8192]),
            "READ with the {what} placed bytes"
        );
        let c = connect(&client, &cpd, &server, &spd);
        local.region().fill(4096, 4096, 0xEE);
        c.qp.post_send(
            SendWr::new(3, WrOpcode::RdmaWrite)
                .sge(local.sge(4096, 4096))
                .remote(region.addr(), key),
        )
        .unwrap();
        let wc = c.cq.next(T).expect("write completion");
        assert_eq!(wc.status, WcStatus::RemAccessErr, "WRITE with the {what} {key:#x}");
        assert!(region.equals(0, &secret), "WRITE with the {what} changed the region");
        local.region().fill(4096, 4096, 0);
    }
    let c = connect(&client, &cpd, &server, &spd);
    c.qp.post_send(
        SendWr::new(4, WrOpcode::RdmaRead)
            .sge(local.sge(0, 8192))
            .remote(region.addr(), new.rkey()),
    )
    .unwrap();
    assert_eq!(c.cq.next(T).expect("read completion").status, WcStatus::Success);
    assert!(local.region().equals(0, &secret));
}

/// QP numbers are drawn at random (24-bit, never 0, 1 or 0xFFFFFF, unique among the context's
/// live QPs), not counted up from a base, and an initial PSN does not follow from the QPN and
/// the process id (the rule before: anyone who saw a QPN knew where its PSNs started).
#[test]
fn qpns_and_initial_psns_are_drawn_at_random() {
    let mut all = Vec::new();
    for _ in 0..2 {
        let ctx = Context::open(ContextConfig::default()).unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(16).unwrap();
        let qps: Vec<Qp> = (0..8)
            .map(|_| ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap())
            .collect();
        let ends: Vec<Endpoint> = qps.iter().map(|q| q.local_endpoint()).collect();
        let qpns: Vec<u32> = ends.iter().map(|e| e.qpn).collect();
        for e in &ends {
            assert!(e.qpn > 1 && e.qpn < MASK24, "qpn {:#x} is reserved", e.qpn);
            assert!(e.psn <= MASK24);
        }
        let mut uniq = qpns.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq.len(), qpns.len(), "live QPNs are unique: {qpns:x?}");
        // counted up (by any step) the QPNs are an arithmetic run: random ones are not
        let step = qpns[1].wrapping_sub(qpns[0]);
        assert!(
            qpns.windows(2).any(|w| w[1].wrapping_sub(w[0]) != step),
            "QPNs form a sequence: {qpns:x?}"
        );
        let derived = |q: u32| (q.wrapping_mul(0x9E37_79B9) ^ std::process::id()) & MASK24;
        assert!(
            ends.iter().any(|e| e.psn != derived(e.qpn)),
            "initial PSNs follow from the QPN and the process id: {ends:?}"
        );
        let mut psns: Vec<u32> = ends.iter().map(|e| e.psn).collect();
        psns.sort_unstable();
        psns.dedup();
        assert!(psns.len() > 1, "all initial PSNs equal");
        // a freed number may be drawn again, and the context keeps working
        drop(qps);
        let again = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
        assert!(again.qp_num() > 1 && again.qp_num() < MASK24);
        all.push(qpns);
    }
    assert_ne!(all[0], all[1], "two contexts drew the same QPNs");
}

/// A simulated context's QPNs, initial PSNs and keys follow from the network's seed (and the
/// context's address), not from the process: one seed replays them exactly, another seed
/// draws others.
#[test]
fn simulated_contexts_draw_identifiers_from_the_seed() {
    let ids = |seed: u64| {
        let net = SimNet::new(seed, Faults::default());
        let ctx = Context::open_simulated(
            ContextConfig {
                bind: SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 4791),
                ..ContextConfig::default()
            },
            &net,
        )
        .unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(16).unwrap();
        let mut out = Vec::new();
        for _ in 0..3 {
            let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
            let e = qp.local_endpoint();
            let mr = pd.reg_mr(64, Access::ALL).unwrap();
            assert_ne!(mr.lkey(), mr.rkey());
            out.push((e.qpn, e.psn, mr.lkey(), mr.rkey()));
        }
        out
    };
    let (a, b, c) = (ids(1), ids(1), ids(2));
    assert_eq!(a, b, "one seed, one set of identifiers");
    for (x, y) in a.iter().zip(&c) {
        assert!(
            x.0 != y.0 && x.1 != y.1 && x.3 != y.3,
            "seeds 1 and 2 drew the same identifiers: {a:x?} vs {c:x?}"
        );
    }
}
