//! The congestion-control experiments on the simulator (`ccsim`): each runs every selected
//! algorithm on the same topology and workload and returns JSON results and PNG panels.
//!
//! - [`fairness`]: 2 senders × 5 flows into one receiver, flows joining then leaving; per-flow
//!   rate and bottleneck queue over time (SwCC Fig. 12/13).
//! - [`loop_delay`]: queue drain time versus added control-loop delay (SwCC Fig. 1).
//! - [`fct`]: FCT slowdown by flow size, WebSearch at 30 % and 50 % load on a leaf-spine (HPCC
//!   Fig. 11 style).
//! - [`incast`]: N-to-1 incast: queue peak, drain time, completion time.
//!
//! The setup is the HPCC ns-3 one scaled down ([`netstack::sim::scaled_setup`]): 10 Gbit/s
//! hosts, 1 µs links, 1 KiB MTU, RED/ECN 40/160 KB, 500 KB per port, INT on every switch.

mod workload;

use crate::plot::Panel;
use netstack::cc::CcKind;
use netstack::sim::{scaled_setup, topo, FlowResult, FlowSpec, LinkSpec, Network};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const RATE: u64 = 10_000_000_000;
const LINK: LinkSpec = LinkSpec {
    rate_bps: RATE,
    delay_ns: 1_000,
};
/// Queue sampling period, and the finer one of the short experiments.
const SAMPLE_NS: u64 = 10_000;
const FINE_NS: u64 = 2_000;

/// How big a run is: `quick` runs are shorter (CI smoke tests).
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// A short run (CI smoke tests).
    pub quick: bool,
    /// Seed of the run's random choices (a run is reproducible from it).
    pub seed: u64,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Jain's fairness index of `x`.
pub fn jain(x: &[f64]) -> f64 {
    let s: f64 = x.iter().sum();
    let s2: f64 = x.iter().map(|v| v * v).sum();
    if s2 == 0.0 {
        return 0.0;
    }
    s * s / (x.len() as f64 * s2)
}

/// Gbit/s of a flow's received bytes between bins `lo..hi` of width `bin` ns.
fn gbps(f: &FlowResult, lo: usize, hi: usize, bin: u64) -> f64 {
    let b: u64 = (lo..hi).map(|i| f.rx_bins.get(i).copied().unwrap_or(0)).sum();
    b as f64 * 8.0 / ((hi - lo).max(1) as f64 * bin as f64)
}

fn queue_series(q: &[u64], until_ns: u64) -> Vec<(f64, f64)> {
    q.iter()
        .enumerate()
        .take((until_ns / SAMPLE_NS) as usize)
        .map(|(i, &b)| (i as f64 * SAMPLE_NS as f64 / 1e6, b as f64 / 1000.0))
        .collect()
}

/// (a) 2 senders × 5 flows into one receiver: flow `i` joins at `i × step` and the flows leave
/// in reverse order from `10 × step`.
pub fn fairness(algs: &[CcKind], s: Scale) -> (Value, Vec<Panel>) {
    let step: u64 = if s.quick { 300_000 } else { 2_000_000 };
    let bin: u64 = if s.quick { 50_000 } else { 100_000 };
    let end = 19 * step;
    let mut out = Vec::new();
    let mut panels = Vec::new();
    for &cc in algs {
        let (qp, params, sw) = scaled_setup(RATE, 8_000);
        let mut net = Network::new(s.seed);
        net.rate_bin_ns = bin;
        let (hosts, sw_node) = topo::star(&mut net, 3, LINK, sw, qp, &params);
        let rx = hosts[2];
        let port = topo::port_towards(&net, sw_node, rx).expect("route");
        net.monitor(sw_node, port, SAMPLE_NS);
        for i in 0..10u64 {
            net.add_flow(FlowSpec {
                src: hosts[(i % 2) as usize],
                dst: rx,
                bytes: u64::MAX,
                start: i * step,
                stop: Some((10 + 9 - i) * step),
                cc,
            });
        }
        net.run_flows(end + 100_000_000);
        let res = net.flow_results();
        let st = net.port_stats(sw_node, port);
        // all ten flows active: [9 step + step/4, 10 step)
        let (lo, hi) = (((9 * step + step / 4) / bin) as usize, ((10 * step) / bin) as usize);
        let rates: Vec<f64> = res.iter().map(|f| gbps(f, lo, hi, bin)).collect();
        let mut q: Vec<f64> = st.queue_samples[..(end / SAMPLE_NS) as usize]
            .iter()
            .map(|&b| b as f64)
            .collect();
        let r = json!({
            "cc": cc.name(),
            "jain_all_active": jain(&rates),
            "rates_all_active_gbps": rates,
            "total_all_active_gbps": rates.iter().sum::<f64>(),
            "queue_p50_bytes": pct(&mut q, 0.5),
            "queue_p99_bytes": pct(&mut q, 0.99),
            "queue_max_bytes": st.max_queue,
            "drops": st.drops,
            "ce_marks": st.ce_marks,
            "retransmitted_packets": res.iter().map(|f| f.retransmitted_packets).sum::<u64>(),
            "flows": res.iter().map(|f| json!({
                "start_ms": f.spec.start as f64 / 1e6,
                "stop_ms": f.spec.stop.map(|t| t as f64 / 1e6),
                "rate_gbps": (0..(end / bin) as usize).map(|i| gbps(f, i, i + 1, bin)).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "queue_kb": queue_series(&st.queue_samples, end).iter().map(|p| p.1).collect::<Vec<_>>(),
        });
        panels.push(Panel {
            title: format!("{cc}: per-flow rate"),
            x_label: "time (ms)".into(),
            y_label: "Gbit/s".into(),
            series: res
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    let pts = (0..(end / bin) as usize)
                        .map(|b| (b as f64 * bin as f64 / 1e6, gbps(f, b, b + 1, bin)))
                        .collect();
                    (format!("flow {i}"), pts)
                })
                .collect(),
            log_y: false,
        });
        panels.push(Panel {
            title: format!("{cc}: bottleneck queue"),
            x_label: "time (ms)".into(),
            y_label: "KB".into(),
            series: vec![("queue".into(), queue_series(&st.queue_samples, end))],
            log_y: false,
        });
        out.push(r);
    }
    (
        json!({"experiment": "fairness", "step_ms": step as f64 / 1e6, "bin_us": bin / 1000, "results": out}),
        panels,
    )
}

/// (b) 4 senders start at line rate into one receiver; the congestion feedback they get is
/// delayed by D. Drain time: from the queue's peak until it first falls below a tenth of it.
pub fn loop_delay(algs: &[CcKind], s: Scale) -> (Value, Vec<Panel>) {
    let delays_us: Vec<u64> = if s.quick {
        vec![0, 20, 100]
    } else {
        vec![0, 5, 10, 20, 50, 100, 200]
    };
    let dur: u64 = if s.quick { 1_500_000 } else { 3_000_000 };
    let mut out = Vec::new();
    let mut series = Vec::new();
    for &cc in algs.iter().filter(|&&c| c != CcKind::None) {
        let mut pts = Vec::new();
        let mut rows = Vec::new();
        for &d in &delays_us {
            let (qp, params, sw) = scaled_setup(RATE, 8_000);
            let mut net = Network::new(s.seed);
            let (hosts, sw_node) = topo::star(&mut net, 5, LINK, sw, qp, &params);
            let rx = hosts[4];
            let port = topo::port_towards(&net, sw_node, rx).expect("route");
            net.monitor(sw_node, port, FINE_NS);
            for &h in &hosts[..4] {
                net.set_feedback_delay(h, d * 1000);
                net.add_flow(FlowSpec {
                    src: h,
                    dst: rx,
                    bytes: u64::MAX,
                    start: 0,
                    stop: Some(dur),
                    cc,
                });
            }
            net.run_flows(dur + 100_000_000);
            let st = net.port_stats(sw_node, port);
            let q = &st.queue_samples[..((dur / FINE_NS) as usize).min(st.queue_samples.len())];
            let (ipk, &peak) = q.iter().enumerate().max_by_key(|(_, &v)| v).unwrap_or((0, &0));
            let drained = q[ipk..].iter().position(|&v| v <= peak / 10);
            let drain_us = drained.map(|i| i as f64 * FINE_NS as f64 / 1000.0);
            let mut tail: Vec<f64> = q[q.len() / 2..].iter().map(|&v| v as f64).collect();
            rows.push(json!({
                "added_delay_us": d,
                "peak_queue_bytes": peak,
                "peak_at_us": ipk as f64 * FINE_NS as f64 / 1000.0,
                "drain_time_us": drain_us,
                "steady_queue_p50_bytes": pct(&mut tail, 0.5),
                "drops": st.drops,
            }));
            if let Some(t) = drain_us {
                pts.push((d as f64, t));
            }
        }
        out.push(json!({"cc": cc.name(), "points": rows}));
        series.push((cc.name().to_string(), pts));
    }
    let panels = vec![Panel {
        title: "queue drain time vs added control-loop delay (4 senders at line rate)".into(),
        x_label: "added control-loop delay (us)".into(),
        y_label: "drain time (us)".into(),
        series,
        log_y: true,
    }];
    (
        json!({"experiment": "loop-delay", "senders": 4, "results": out}),
        panels,
    )
}

/// (c) FCT slowdown by flow size: WebSearch sizes (scaled by `1/10`) with Poisson arrivals at
/// 30 % and 50 % load between random host pairs of a leaf-spine.
pub fn fct(algs: &[CcKind], s: Scale) -> (Value, Vec<Panel>) {
    let (leaves, per_leaf, spines) = if s.quick { (2, 4, 2) } else { (4, 4, 2) };
    let arrivals_ns: u64 = if s.quick { 2_000_000 } else { 10_000_000 };
    let size_scale = 0.1;
    let base_rtt = 12_000;
    let mut out = Vec::new();
    let mut panels = Vec::new();
    for load in [0.3, 0.5] {
        let mut series = Vec::new();
        let mut rows = Vec::new();
        for &cc in algs {
            let (qp, params, sw) = scaled_setup(RATE, base_rtt);
            let mut net = Network::new(s.seed);
            let t = topo::LeafSpine {
                leaves,
                per_leaf,
                spines,
                host_link: LINK,
                fabric_link: LinkSpec {
                    rate_bps: 2 * RATE,
                    delay_ns: 1_000,
                },
                switch: sw,
            };
            let hosts = topo::leaf_spine(&mut net, &t, qp, &params);
            let mut rng = StdRng::seed_from_u64(s.seed ^ (load * 100.0) as u64);
            let mean = workload::WEBSEARCH.mean() * size_scale;
            let rate_per_host = load * RATE as f64 / 8.0 / mean; // flows per second
            for (i, &h) in hosts.iter().enumerate() {
                let mut t_ns = 0.0;
                loop {
                    t_ns += -(1.0 - rng.random::<f64>()).ln() / rate_per_host * 1e9;
                    if t_ns >= arrivals_ns as f64 {
                        break;
                    }
                    let mut dst = rng.random_range(0..hosts.len() - 1);
                    if dst >= i {
                        dst += 1;
                    }
                    let size = ((workload::WEBSEARCH.sample(&mut rng) * size_scale) as u64).max(1000);
                    net.add_flow(FlowSpec {
                        src: h,
                        dst: hosts[dst],
                        bytes: size,
                        start: t_ns as u64,
                        stop: None,
                        cc,
                    });
                }
            }
            let all_done = net.run_flows(arrivals_ns + 400_000_000);
            let res = net.flow_results();
            let same_leaf = |a: usize, b: usize| {
                hosts.iter().position(|&x| x == a).unwrap_or(0) / per_leaf
                    == hosts.iter().position(|&x| x == b).unwrap_or(0) / per_leaf
            };
            let mut flows: Vec<(u64, f64)> = res
                .iter()
                .filter_map(|f| {
                    let fct = f.fct_ns? as f64;
                    let hops = if same_leaf(f.spec.src, f.spec.dst) { 2.0 } else { 4.0 };
                    let pkts = f.spec.bytes.div_ceil(1024) as f64;
                    let wire = f.spec.bytes as f64 + pkts * 110.0;
                    let ideal = 2.0 * hops * 1000.0 + (hops - 1.0) * 1100.0 * 8.0 / 10.0 + wire * 8.0 / 10.0;
                    Some((f.spec.bytes, (fct / ideal).max(1.0)))
                })
                .collect();
            flows.sort_by_key(|f| f.0);
            let nb = 10;
            let buckets: Vec<Value> = (0..nb)
                .filter_map(|b| {
                    let lo = flows.len() * b / nb;
                    let hi = flows.len() * (b + 1) / nb;
                    let chunk = &flows[lo..hi];
                    let mut sd: Vec<f64> = chunk.iter().map(|f| f.1).collect();
                    let max_size = chunk.last()?.0;
                    Some(json!({"max_size_bytes": max_size, "flows": chunk.len(),
                        "p50": pct(&mut sd, 0.5), "p95": pct(&mut sd, 0.95), "p99": pct(&mut sd, 0.99)}))
                })
                .collect();
            let mut all: Vec<f64> = flows.iter().map(|f| f.1).collect();
            series.push((
                cc.name().to_string(),
                buckets
                    .iter()
                    .enumerate()
                    .map(|(i, b)| ((i + 1) as f64 * 10.0, b["p95"].as_f64().unwrap_or(0.0)))
                    .collect(),
            ));
            rows.push(json!({
                "cc": cc.name(),
                "flows": res.len(),
                "finished": flows.len(),
                "all_finished": all_done,
                "failed": res.iter().filter(|f| f.failed.is_some()).count(),
                "slowdown_p50": pct(&mut all, 0.5),
                "slowdown_p99": pct(&mut all, 0.99),
                "buckets": buckets,
            }));
        }
        panels.push(Panel {
            title: format!("WebSearch (sizes /10) at {:.0}% load: p95 FCT slowdown", load * 100.0),
            x_label: "flow size percentile (10% buckets, small to large)".into(),
            y_label: "p95 slowdown".into(),
            series,
            log_y: true,
        });
        out.push(json!({"load": load, "results": rows}));
    }
    let v = json!({"experiment": "fct", "workload": "websearch", "size_scale": size_scale,
        "topology": {"leaves": leaves, "hosts_per_leaf": per_leaf, "spines": spines,
        "host_gbps": 10, "fabric_gbps": 20}, "arrivals_ms": arrivals_ns as f64 / 1e6, "loads": out});
    (v, panels)
}

/// (d) N-to-1 incast: `n` senders each WRITE `size` bytes to one receiver at time 0.
pub fn incast(algs: &[CcKind], s: Scale) -> (Value, Vec<Panel>) {
    let (n, size) = if s.quick {
        (8usize, 128u64 << 10)
    } else {
        (16, 512 << 10)
    };
    let mut out = Vec::new();
    let mut qseries = Vec::new();
    for &cc in algs {
        let (qp, params, sw) = scaled_setup(RATE, 8_000);
        let kmin = sw.ecn.map_or(0, |e| e.kmin);
        let mut net = Network::new(s.seed);
        let (hosts, sw_node) = topo::star(&mut net, n + 1, LINK, sw, qp, &params);
        let rx = hosts[n];
        let port = topo::port_towards(&net, sw_node, rx).expect("route");
        net.monitor(sw_node, port, FINE_NS);
        for &h in &hosts[..n] {
            net.add_flow(FlowSpec {
                src: h,
                dst: rx,
                bytes: size,
                start: 0,
                stop: None,
                cc,
            });
        }
        let all = net.run_flows(1_000_000_000);
        let res = net.flow_results();
        let done = res.iter().filter_map(|f| f.done_at).max().unwrap_or(0);
        let st = net.port_stats(sw_node, port);
        let q = &st.queue_samples;
        let (ipk, &peak) = q.iter().enumerate().max_by_key(|(_, &v)| v).unwrap_or((0, &0));
        let below = q[ipk..].iter().position(|&v| v <= kmin);
        let ideal_ns = (n as u64 * size) as f64 * 8.0 / 10.0;
        out.push(json!({
            "cc": cc.name(),
            "senders": n,
            "bytes_each": size,
            "all_finished": all,
            "completion_us": done as f64 / 1000.0,
            "completion_over_ideal": done as f64 / ideal_ns,
            "goodput_gbps": (n as u64 * size) as f64 * 8.0 / done.max(1) as f64,
            "peak_queue_bytes": peak,
            "time_to_below_kmin_after_peak_us": below.map(|i| i as f64 / 1000.0 * FINE_NS as f64),
            "drops": st.drops,
            "retransmitted_packets": res.iter().map(|f| f.retransmitted_packets).sum::<u64>(),
            "max_fct_us": res.iter().filter_map(|f| f.fct_ns).max().unwrap_or(0) as f64 / 1000.0,
            "min_fct_us": res.iter().filter_map(|f| f.fct_ns).min().unwrap_or(0) as f64 / 1000.0,
        }));
        let pts = q
            .iter()
            .enumerate()
            .take(((done / FINE_NS) as usize + 10).min(q.len()))
            .map(|(i, &b)| (i as f64 * FINE_NS as f64 / 1000.0, b as f64 / 1000.0))
            .collect();
        qseries.push((cc.name().to_string(), pts));
    }
    let panels = vec![Panel {
        title: format!("{n}-to-1 incast of {} KiB each: bottleneck queue", size >> 10),
        x_label: "time (us)".into(),
        y_label: "KB".into(),
        series: qseries,
        log_y: false,
    }];
    (json!({"experiment": "incast", "results": out}), panels)
}
