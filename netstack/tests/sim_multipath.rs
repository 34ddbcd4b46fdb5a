//! Multipath in the network simulator: one QP sprayed over the two spines of a leaf-spine
//! fabric (ECMP hashes each path's 5-tuple), against the same QP on one path; and a fabric link
//! cut in the middle of a transfer and restored.

use netstack::cc::CcKind;
use netstack::path::SprayPolicy;
use netstack::sim::{scaled_setup, topo, FlowResult, FlowSpec, LinkSpec, Network};

const GBPS: u64 = 1_000_000_000;
const BIN_NS: u64 = 100_000;

/// Two leaves with a host each, two spines; hosts at 20 Gbit/s, fabric links at 10 Gbit/s, so
/// one path carries half of what a host can send. Returns the network and the two hosts.
fn fabric(seed: u64) -> (Network, Vec<usize>) {
    let (qp, params, sw) = scaled_setup(10 * GBPS, 8_000);
    let mut net = Network::new(seed);
    let t = topo::LeafSpine {
        leaves: 2,
        spines: 2,
        per_leaf: 1,
        host_link: LinkSpec {
            rate_bps: 20 * GBPS,
            delay_ns: 1_000,
        },
        fabric_link: LinkSpec {
            rate_bps: 10 * GBPS,
            delay_ns: 1_000,
        },
        switch: sw,
    };
    let hosts = topo::leaf_spine(&mut net, &t, qp, &params);
    net.rate_bin_ns = BIN_NS;
    (net, hosts)
}

struct Flow {
    bytes: u64,
    stop: Option<u64>,
    paths: usize,
    policy: SprayPolicy,
    cc: CcKind,
}

fn flow(net: &mut Network, hosts: &[usize], f: Flow) -> usize {
    let Flow {
        bytes,
        stop,
        paths,
        policy,
        cc,
    } = f;
    let f = net.add_flow(FlowSpec {
        src: hosts[0],
        dst: hosts[1],
        bytes,
        start: 0,
        stop,
        cc,
    });
    net.set_flow_paths(f, paths, policy);
    f
}

fn gbps(r: &FlowResult) -> f64 {
    r.completed as f64 * 8.0 / r.fct_ns.expect("finished") as f64
}

#[test]
fn spraying_fills_both_spines_without_spurious_retransmissions() {
    let bytes = 32 << 20;
    let run = |paths, policy| {
        let (mut net, hosts) = fabric(1);
        let cc = CcKind::None;
        flow(
            &mut net,
            &hosts,
            Flow {
                bytes,
                stop: None,
                paths,
                policy,
                cc,
            },
        );
        assert!(net.run_flows(1_000_000_000), "{paths} paths {policy}: finished");
        // what the switches dropped: spines 0 and 1 (two ports each), leaves 2 and 4 (three)
        let ports = [
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
            (2, 0),
            (2, 1),
            (2, 2),
            (4, 0),
            (4, 1),
            (4, 2),
        ];
        let drops: u64 = ports.iter().map(|&(n, p)| net.port_stats(n, p).drops).sum();
        (net.flow_results().remove(0), drops)
    };
    let (single, _) = run(1, SprayPolicy::Single);
    assert!(single.failed.is_none(), "{:?}", single.failed);
    let g1 = gbps(&single);
    assert!(g1 < 10.5, "one path is one 10 Gbit/s spine: {g1}");
    for policy in [SprayPolicy::Weighted, SprayPolicy::RoundRobin] {
        let (r, drops) = run(16, policy);
        assert!(r.failed.is_none(), "{:?}", r.failed);
        let g = gbps(&r);
        let used = r.paths.iter().filter(|p| p.sent > 0).count();
        eprintln!(
            "{policy}: {g:.2} Gbit/s vs {g1:.2} on one path; {used} paths used, {} retransmitted, {} spurious",
            r.retransmitted_packets, r.spurious_retransmissions
        );
        assert_eq!(used, 16, "{policy}: every path carried packets");
        // packets of one message overtake each other across the spines: none is resent for
        // that, only for what a full switch buffer dropped
        assert!(
            r.retransmitted_packets <= drops,
            "{policy}: {} resent, {drops} dropped",
            r.retransmitted_packets
        );
        assert_eq!(r.path_downs, 0, "{policy}: no path went down");
        if policy == SprayPolicy::Weighted {
            assert!(g >= 1.8 * g1, "{policy}: {g:.2} Gbit/s vs {g1:.2} on one path");
        }
    }
}

#[test]
fn a_cut_spine_link_is_routed_around_and_used_again_once_restored() {
    let (mut net, hosts) = fabric(2);
    let (cut_at, restore_at, end) = (5_000_000, 25_000_000, 65_000_000);
    // Swift keeps the queues short, so the paths' RTTs tell them apart (with no congestion
    // control the window fills the spine queues and the weighting settles more slowly)
    let spec = Flow {
        bytes: u64::MAX,
        stop: Some(end),
        paths: 8,
        policy: SprayPolicy::Weighted,
        cc: CcKind::Swift,
    };
    let f = flow(&mut net, &hosts, spec);
    // leaf 0 (node 2) reaches spine 0 on its port 0: data over spine 0 is lost from the cut
    // on. (Only that direction: the ACKs of a request go back on its path's return route, so a
    // path whose return is cut is down as well, and the QP keeps the paths that work both ways;
    // with independent hashes per direction that is a quarter of them, not half.)
    net.run_until(cut_at);
    net.set_port_up(2, 0, false);
    net.run_until(restore_at);
    net.set_port_up(2, 0, true);
    assert!(net.run_flows(end + 100_000_000), "the flow ends");
    let r = &net.flow_results()[f];
    assert!(r.failed.is_none(), "{:?}", r.failed);
    let bins = &r.rx_bins;
    let rate = |from: u64, to: u64| {
        let (a, b) = ((from / BIN_NS) as usize, (to / BIN_NS) as usize);
        bins[a..b].iter().sum::<u64>() as f64 * 8.0 / (to - from) as f64
    };
    let before = rate(1_000_000, cut_at);
    let during = rate(cut_at + 5_000_000, restore_at);
    let after = rate(restore_at + 20_000_000, end);
    // the longest time after the cut in which nothing was delivered
    let stall_bins = bins[(cut_at / BIN_NS) as usize..(restore_at / BIN_NS) as usize]
        .split(|&b| b > 0)
        .map(|s| s.len())
        .max()
        .unwrap_or(0);
    let stall_ms = stall_bins as f64 * BIN_NS as f64 / 1e6;
    eprintln!(
        "before {before:.2} Gbit/s, cut {during:.2}, restored {after:.2}; stall {stall_ms} ms; downs {}; spurious {}",
        r.path_downs, r.spurious_retransmissions
    );
    if std::env::var("SIM_DEBUG").is_ok() {
        for p in &r.paths {
            eprintln!("{p:?}");
        }
        eprintln!(
            "{:?}",
            &bins[(cut_at / BIN_NS) as usize - 5..(restore_at / BIN_NS) as usize]
        );
    }
    eprintln!("timeouts {} retx {}", r.timeouts, r.retransmitted_packets);
    assert!(before > 18.0, "both spines: {before}");
    assert!((8.0..10.5).contains(&during), "one spine's rate while cut: {during}");
    assert!(after > 18.0, "both spines again: {after}");
    assert!(r.path_downs > 0, "the paths over the cut link went down: {:?}", r.paths);
    assert!(r.paths.iter().all(|p| p.up), "and came back: {:?}", r.paths);
    assert!(
        r.paths.iter().any(|p| p.ups > 0 && p.probes_answered > 0),
        "{:?}",
        r.paths
    );
    assert!(stall_ms < 20.0, "stall {stall_ms} ms");
}
