//! Multipath over real UDP sockets on loopback: a QP sprayed over several source ports, and one
//! over two explicit address pairs (127.0.0.x addresses), each carrying verified data.

use netstack::path::SprayPolicy;
use netstack::verbs::*;
use std::net::Ipv4Addr;
use std::time::Duration;

const T: Duration = Duration::from_secs(20);
const LEN: usize = 4 << 20;

struct Side {
    _ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn side(bind: &str, extra: &[&str], paths: usize, policy: SprayPolicy) -> Side {
    let ctx = Context::open(ContextConfig {
        bind: bind.parse().unwrap(),
        extra_addrs: extra.iter().map(|a| a.parse::<Ipv4Addr>().unwrap()).collect(),
        qp: RcConfig {
            recovery: Recovery::SelectiveRepeat,
            ..RcConfig::default()
        },
        ..Default::default()
    })
    .unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    if paths > 1 {
        qp.set_paths(paths, policy).unwrap();
    }
    let mr = pd.reg_mr(LEN, Access::ALL).unwrap();
    Side {
        _ctx: ctx,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

/// Writes `LEN` bytes in 64 KiB WRITEs from `a` to `b`, then reads them back; checks both.
fn write_and_read_back(a: &Side, b: &Side) {
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + i / 4099) as u8).collect();
    a.mr.write(0, &data);
    let chunk = 64 << 10;
    let n = (LEN / chunk) as u64;
    for i in 0..n {
        let off = i as usize * chunk;
        let wr = SendWr::new(i, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(off, chunk))
            .remote(b.mr.addr() + off as u64, b.mr.rkey());
        a.qp.post_send(wr).unwrap();
    }
    for _ in 0..n {
        assert_eq!(a.cq.next(T).expect("completion").status, WcStatus::Success);
    }
    let mut got = vec![0u8; LEN];
    b.mr.read(0, &mut got);
    assert!(got == data, "WRITE data arrived intact");
    // READ it back over the same paths (the responses follow the requests)
    a.mr.write(0, &vec![0u8; LEN]);
    a.qp.post_send(
        SendWr::new(99, WrOpcode::RdmaRead)
            .sge(a.mr.sge(0, LEN))
            .remote(b.mr.addr(), b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(a.cq.next(T).expect("completion").status, WcStatus::Success);
    a.mr.read(0, &mut got);
    assert!(got == data, "READ data came back intact");
}

#[test]
fn a_qp_sprays_over_source_ports_and_the_peer_adopts_its_paths() {
    let a = side("127.0.0.1:0", &[], 8, SprayPolicy::RoundRobin);
    // b asks for nothing: it adopts a's eight paths when connecting
    let b = side("127.0.0.1:0", &[], 1, SprayPolicy::Single);
    let (ea, eb) = (a.qp.local_endpoint(), b.qp.local_endpoint());
    assert_eq!((ea.paths, ea.spray), (8, SprayPolicy::RoundRobin));
    assert_eq!(ea.sources.len(), 7, "seven more source ports: {ea:?}");
    b.qp.connect(&ea).unwrap();
    a.qp.connect(&eb).unwrap();
    assert_eq!(b.qp.path_stats().len(), 8);
    // a peer asking for more paths than this context has ports for gets as many as it has
    let c = side("127.0.0.1:0", &[], 12, SprayPolicy::RoundRobin);
    let d = side("127.0.0.1:0", &[], 1, SprayPolicy::Single);
    d.qp.connect(&c.qp.local_endpoint()).unwrap();
    assert_eq!(d.qp.path_stats().len(), 8, "path_ports = 8");
    write_and_read_back(&a, &b);
    let st = a.qp.path_stats();
    assert!(
        st.iter().all(|p| p.sent > 0 && p.up),
        "every path carried packets: {st:?}"
    );
    // RTT samples come from the packets that asked for an ACK (every 16th and each last)
    assert!(st.iter().any(|p| p.srtt_ns > 0), "RTT samples: {st:?}");
    // b answered the READ over the paths its requests came on
    assert!(b.qp.stats().tx_packets > 0);
    let (sa, sb) = (a.qp.stats(), b.qp.stats());
    assert_eq!(sa.path_downs, 0, "{sa:?}");
    assert_eq!(sb.duplicate_requests, 0, "no spurious resend on loopback: {sb:?}");
}

#[test]
fn explicit_address_pairs_carry_a_qp_over_two_local_addresses() {
    let a = side("127.0.0.11:0", &["127.0.0.12"], 2, SprayPolicy::RoundRobin);
    let b = side("127.0.0.13:0", &["127.0.0.14"], 1, SprayPolicy::Single);
    let ea = a.qp.local_endpoint();
    assert_eq!(ea.extra_addrs.len(), 1);
    assert_eq!(*ea.extra_addrs[0].ip(), Ipv4Addr::new(127, 0, 0, 12));
    b.qp.connect(&ea).unwrap();
    a.qp.connect(&b.qp.local_endpoint()).unwrap();
    write_and_read_back(&a, &b);
    let st = a.qp.path_stats();
    assert!(
        st.iter().all(|p| p.sent > 0),
        "both address pairs carried packets: {st:?}"
    );
}

#[test]
fn too_many_paths_for_the_ports_and_spraying_without_selective_repeat_are_refused() {
    let a = side("127.0.0.1:0", &[], 1, SprayPolicy::Single);
    let e = a.qp.set_paths(9, SprayPolicy::Weighted);
    assert!(e.is_ok(), "{e:?}");
    let b = side("127.0.0.1:0", &[], 1, SprayPolicy::Single);
    let e = a.qp.connect(&b.qp.local_endpoint()).unwrap_err().to_string();
    assert!(e.contains("path_ports"), "{e}");
    // go-back-N cannot spray
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(16).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let e = qp.set_paths(4, SprayPolicy::RoundRobin).unwrap_err().to_string();
    assert!(e.contains("selective-repeat"), "{e}");
    // one path per port with `single` (failover only) is fine in go-back-N
    qp.set_paths(4, SprayPolicy::Single).unwrap();
}
