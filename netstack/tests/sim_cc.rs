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

#[test]
fn explore() {
    let n: usize = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    for cc in CcKind::ALL {
        let r = dumbbell(cc, n, 20, true);
        let (q, rates, jain, drops) = summary(&r);
        let res = r.net.flow_results();
        eprintln!(
            "{cc}: queue {q} rates {rates:.2?} jain {jain:.3} drops {drops} max {} fail {:?} retx {}",
            r.net.port_stats(r.port.0, r.port.1).max_queue,
            res.iter().map(|f| f.failed.clone()).collect::<Vec<_>>(),
            res.iter().map(|f| f.retransmitted_packets).sum::<u64>()
        );
    }
}

#[test]
fn explore_homa() {
    let n: usize = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let r = dumbbell(CcKind::Homa, n, 5, true);
    let st = r.net.port_stats(r.port.0, r.port.1);
    for (i, q) in st.queue_samples.iter().enumerate().step_by(25).take(40) {
        eprint!("{}:{} ", i * 10, q / 1000);
    }
    eprintln!();
}
