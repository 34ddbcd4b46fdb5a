//! Congestion control in the network simulator: each algorithm's reaction to its signal, end to
//! end through the real transport (switch queues, ECN marks, INT, grants).

use netstack::cc::CcKind;
use netstack::sim::{scaled_setup, topo, FlowSpec, LinkSpec, Network, NodeId};

const GBPS10: u64 = 10_000_000_000;
const LINK: LinkSpec = LinkSpec {
    rate_bps: GBPS10,
    delay_ns: 1_000,
};

struct Run {
    net: Network,
    port: (NodeId, usize),
    senders: usize,
    ms: u64,
}

/// `senders` long flows into one receiver through one switch for `ms` milliseconds.
fn dumbbell(cc: CcKind, senders: usize, ms: u64, int: bool) -> Run {
    let (qp, params, mut sw) = scaled_setup(GBPS10, 8_000);
    sw.int = int;
    let mut net = Network::new(7);
    let (hosts, s) = topo::star(&mut net, senders + 1, LINK, sw, qp, &params);
    let rx = hosts[senders];
    let port = topo::port_towards(&net, s, rx).unwrap();
    net.monitor(s, port, 10_000);
    net.rate_bin_ns = 1_000_000;
    for (i, &h) in hosts[..senders].iter().enumerate() {
        net.add_flow(FlowSpec {
            src: h,
            dst: rx,
            bytes: u64::MAX,
            start: i as u64 * 100_000,
            stop: Some(ms * 1_000_000),
            cc,
        });
    }
    net.run_flows(ms * 1_000_000 + 50_000_000);
    Run {
        net,
        port: (s, port),
        senders,
        ms,
    }
}

/// Median queue over the second half of the run, per-flow Gbit/s over it, Jain's index.
fn summary(r: &Run) -> (u64, Vec<f64>, f64, u64) {
    let st = r.net.port_stats(r.port.0, r.port.1);
    // samples every 10 µs; the second half of the run
    let (lo, hi) = (r.ms as usize * 50, r.ms as usize * 100);
    let mut q: Vec<u64> = st.queue_samples[lo.min(st.queue_samples.len())..hi.min(st.queue_samples.len())].to_vec();
    q.sort();
    let med = q.get(q.len() / 2).copied().unwrap_or(0);
    let res = r.net.flow_results();
    let rates: Vec<f64> = res
        .iter()
        .map(|f| {
            let b = &f.rx_bins;
            let (lo, hi) = (r.ms as usize / 2, r.ms as usize);
            (lo..hi).map(|i| b.get(i).copied().unwrap_or(0)).sum::<u64>() as f64 * 8.0 / ((hi - lo) as f64 * 1e6)
        })
        .collect();
    let s: f64 = rates.iter().sum();
    let s2: f64 = rates.iter().map(|x| x * x).sum();
    let jain = s * s / (rates.len() as f64 * s2);
    assert_eq!(rates.len(), r.senders);
    (med, rates, jain, st.drops)
}

fn util(rates: &[f64]) -> f64 {
    rates.iter().sum::<f64>() / 9.44 // goodput of a 10 Gbit/s link with 1 KiB packets
}

#[test]
fn without_cc_the_queue_sits_at_the_buffer_limit_with_drops() {
    let r = dumbbell(CcKind::None, 4, 6, true);
    let (q, _, _, drops) = summary(&r);
    let st = r.net.port_stats(r.port.0, r.port.1);
    // the queue fills the 500 KB buffer, drops, and stays high while losses are recovered
    assert!(st.max_queue > 490_000, "peak queue {}", st.max_queue);
    assert!(q > 200_000, "median queue {q}");
    assert!(drops > 100, "drops {drops}");
}

#[test]
fn dcqcn_marks_cut_the_rates_and_bound_the_queue() {
    let (_, _, sw) = scaled_setup(GBPS10, 8_000);
    let kmax = sw.ecn.unwrap().kmax;
    let r = dumbbell(CcKind::Dcqcn, 4, 20, true);
    let (q, rates, jain, drops) = summary(&r);
    let st = r.net.port_stats(r.port.0, r.port.1);
    assert_eq!(drops, 0);
    assert!(st.ce_marks > 0);
    assert!(q < kmax, "median queue {q} above kmax {kmax}");
    assert!(r.net.flow_results().iter().all(|f| f.cnps > 0), "every sender got CNPs");
    assert!(jain > 0.85 && util(&rates) > 0.8, "jain {jain}, rates {rates:?}");
}

#[test]
fn hpcc_keeps_the_queue_near_zero_at_high_utilisation() {
    let r = dumbbell(CcKind::Hpcc, 4, 20, true);
    let (q, rates, jain, drops) = summary(&r);
    assert_eq!(drops, 0);
    assert!(q < 5_000, "median queue {q}");
    assert!(jain > 0.95 && util(&rates) > 0.75, "jain {jain}, rates {rates:?}");
}

#[test]
fn hpcc_refuses_a_path_without_int() {
    let r = dumbbell(CcKind::Hpcc, 1, 2, false);
    let f = &r.net.flow_results()[0];
    assert_eq!(f.cc_fault, Some(netstack::cc::hpcc::NO_INT));
    assert!(f.failed.is_some(), "the QP stopped: {f:?}");
    assert!(
        f.completed < 1 << 20,
        "it did not go on guessing: {} bytes",
        f.completed
    );
}

#[test]
fn swift_holds_the_queue_near_its_delay_target() {
    let r = dumbbell(CcKind::Swift, 4, 6, true);
    let (q, rates, jain, drops) = summary(&r);
    assert_eq!(drops, 0);
    // target 25 µs + 1 µs per hop over an 8 µs base RTT: ~20 KB at 10 Gbit/s, plus flow scaling
    assert!((5_000..80_000).contains(&q), "median queue {q}");
    assert!(jain > 0.9 && util(&rates) > 0.9, "jain {jain}, rates {rates:?}");
}

#[test]
fn timely_reacts_to_rtt_and_keeps_the_queue_below_t_high() {
    let r = dumbbell(CcKind::Timely, 4, 6, true);
    let (q, rates, _, drops) = summary(&r);
    assert_eq!(drops, 0);
    // t_high is 40 base RTTs (320 µs, 400 KB at 10 Gbit/s)
    assert!(q < 400_000, "median queue {q}");
    assert!(util(&rates) > 0.5, "rates {rates:?}");
}

#[test]
fn homa_grants_keep_an_incast_lossless() {
    let (qp, params, sw) = scaled_setup(GBPS10, 8_000);
    let rtt_bytes = params.homa.rtt_bytes;
    let mut net = Network::new(3);
    let n = 8;
    let (hosts, s) = topo::star(&mut net, n + 1, LINK, sw, qp, &params);
    let port = topo::port_towards(&net, s, hosts[n]).unwrap();
    for &h in &hosts[..n] {
        net.add_flow(FlowSpec {
            src: h,
            dst: hosts[n],
            bytes: 256 << 10,
            start: 0,
            stop: None,
            cc: CcKind::Homa,
        });
    }
    assert!(net.run_flows(100_000_000), "all flows finished");
    let st = net.port_stats(s, port);
    assert_eq!(st.drops, 0);
    // one RTT of unscheduled bytes per sender, then at most overcommit × RTT bytes granted
    assert!(
        st.max_queue < (n as u64 + 8) * rtt_bytes * 11 / 10,
        "peak {}",
        st.max_queue
    );
    let done = net.flow_results().iter().filter_map(|f| f.done_at).max().unwrap();
    let ideal = (n as u64 * (256 << 10)) as f64 * 8.0 / 10.0;
    assert!((done as f64) < ideal * 1.3, "{done} ns vs ideal {ideal}");
}

#[test]
fn added_control_loop_delay_slows_the_drain() {
    let drain = |d: u64| {
        let (qp, params, sw) = scaled_setup(GBPS10, 8_000);
        let mut net = Network::new(5);
        let (hosts, s) = topo::star(&mut net, 5, LINK, sw, qp, &params);
        let port = topo::port_towards(&net, s, hosts[4]).unwrap();
        net.monitor(s, port, 2_000);
        for &h in &hosts[..4] {
            net.set_feedback_delay(h, d);
            net.add_flow(FlowSpec {
                src: h,
                dst: hosts[4],
                bytes: u64::MAX,
                start: 0,
                stop: Some(1_500_000),
                cc: CcKind::Dcqcn,
            });
        }
        net.run_flows(50_000_000);
        let q = &net.port_stats(s, port).queue_samples;
        let (i, &peak) = q.iter().enumerate().max_by_key(|(_, &v)| v).unwrap();
        (peak, q[i..].iter().position(|&v| v <= peak / 10).unwrap())
    };
    let (p0, d0) = drain(0);
    let (p1, d1) = drain(50_000);
    // rate-based DCQCN keeps sending at the old rate for the extra delay: a higher peak that
    // takes longer to drain
    assert!(
        p1 > p0 * 5 / 4 && d1 > d0 * 5 / 4,
        "peak {p0} -> {p1}, drain {d0} -> {d1} samples"
    );
}

/// `N=4 cargo test --release --test sim_cc explore -- --ignored --nocapture` prints each
/// algorithm's queue, rates and fairness on the dumbbell.
#[test]
#[ignore]
fn explore() {
    let n: usize = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    for cc in CcKind::ALL {
        let r = dumbbell(cc, n, 20, true);
        let (q, rates, jain, drops) = summary(&r);
        eprintln!("{cc}: median queue {q} rates {rates:.2?} jain {jain:.3} drops {drops}");
    }
}

/// Four Swift flows through one switch under the network's random faults (loss, duplication,
/// corruption, jitter, drawn at the sending hosts) besides the switch's own queue: every byte
/// arrives, the transport resends what was lost or corrupted, and a second run of the seed
/// delivers the same datagrams at the same times.
#[test]
fn flows_finish_through_a_faulty_fabric_and_a_seed_replays() {
    let run = || {
        let (qp, params, sw) = scaled_setup(GBPS10, 8_000);
        let mut net = Network::new(11);
        net.set_faults(0.01, 0.002, 0.002, 2_000);
        let (hosts, _) = topo::star(&mut net, 5, LINK, sw, qp, &params);
        for &h in &hosts[..4] {
            net.add_flow(FlowSpec {
                src: h,
                dst: hosts[4],
                bytes: 1 << 20,
                start: 0,
                stop: None,
                cc: CcKind::Swift,
            });
        }
        let finished = net.run_flows(200_000_000);
        let out = (net.flow_results(), net.sim().stats(), net.sim().trace_hash());
        (finished, out, net.dropped_packets())
    };
    let (finished, (res, stats, hash), dropped) = run();
    assert!(finished, "all flows finished: {res:?}");
    for f in &res {
        assert_eq!(f.completed, 1 << 20, "{f:?}");
        assert!(f.failed.is_none(), "{f:?}");
    }
    assert!(
        stats.lost > 0 && stats.duplicated > 0 && stats.corrupted > 0,
        "{stats:?}"
    );
    // every corrupted datagram fails its ICRC at the receiving host
    assert!(dropped >= stats.corrupted, "dropped {dropped}: {stats:?}");
    let resent: u64 = res.iter().map(|f| f.retransmitted_packets).sum();
    assert!(resent > 0, "{res:?}");
    let (_, (res2, stats2, hash2), _) = run();
    assert_eq!((stats, hash), (stats2, hash2));
    assert_eq!(format!("{res:?}"), format!("{res2:?}"));
}
