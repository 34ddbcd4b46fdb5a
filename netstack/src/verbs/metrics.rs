//! A context's collector: the engine's, its QPs' and its offloading engine's counters copied
//! into the metrics registry once a second (see [`crate::telemetry`]). Every series carries
//! `context` = the context's data-path address.

use super::CtxInner;
use crate::cc::CcKind;
use crate::engine::CqShared;
use crate::engine::{Counter, EngineStats};
use crate::path::PathStats;
use crate::transport::rc::{QpErrorCause, RcStats};
use metrics::{counter, gauge, histogram};
use std::sync::Arc;

type EngineCounter = (
    &'static str,
    Option<(&'static str, &'static str)>,
    fn(&EngineStats) -> &Counter,
);

/// The engine's counters as metrics: name, optional label, which counter.
const ENGINE_COUNTERS: [EngineCounter; 24] = [
    ("flexns_engine_passes_total", Some(("thread", "engine")), |s| {
        &s.engine_thread_passes
    }),
    ("flexns_engine_passes_total", Some(("thread", "application")), |s| {
        &s.application_passes
    }),
    ("flexns_engine_passes_total", Some(("thread", "runtime-task")), |s| {
        &s.task_passes
    }),
    ("flexns_rx_packets_total", None, |s| &s.rx_datagrams),
    ("flexns_rx_bytes_total", None, |s| &s.rx_bytes),
    ("flexns_tx_packets_total", None, |s| &s.tx_packets),
    ("flexns_tx_bytes_total", None, |s| &s.tx_bytes),
    ("flexns_tx_errors_total", None, |s| &s.tx_errors),
    ("flexns_rx_ecn_ce_packets_total", None, |s| &s.rx_ce),
    ("flexns_rx_malformed_packets_total", Some(("kind", "truncated")), |s| {
        &s.rx_truncated
    }),
    ("flexns_rx_malformed_packets_total", Some(("kind", "oversized")), |s| {
        &s.rx_oversized
    }),
    (
        "flexns_rx_malformed_packets_total",
        Some(("kind", "unknown_opcode")),
        |s| &s.rx_unknown_opcode,
    ),
    (
        "flexns_rx_malformed_packets_total",
        Some(("kind", "bad_version")),
        |s| &s.rx_bad_version,
    ),
    ("flexns_rx_malformed_packets_total", Some(("kind", "bad_pad")), |s| {
        &s.rx_bad_pad
    }),
    ("flexns_rx_malformed_packets_total", Some(("kind", "bad_icrc")), |s| {
        &s.rx_bad_icrc
    }),
    ("flexns_rx_malformed_packets_total", Some(("kind", "unknown_qp")), |s| {
        &s.rx_unknown_qp
    }),
    (
        "flexns_rx_malformed_packets_total",
        Some(("kind", "wrong_source")),
        |s| &s.rx_wrong_source,
    ),
    ("flexns_payload_copy_bytes_total", Some(("direction", "tx")), |s| {
        &s.tx_payload_copy_bytes
    }),
    ("flexns_payload_copy_bytes_total", Some(("direction", "rx")), |s| {
        &s.rx_payload_copy_bytes
    }),
    ("flexns_rx_fused_copy_bytes_total", None, |s| &s.rx_fused_copy_bytes),
    ("flexns_same_host_bytes_total", Some(("how", "copy")), |s| {
        &s.same_host_copy_bytes
    }),
    ("flexns_same_host_bytes_total", Some(("how", "cma")), |s| {
        &s.same_host_cma_bytes
    }),
    ("flexns_same_host_ops_total", None, |s| &s.same_host_ops),
    ("flexns_tx_calls_total", None, |s| &s.tx_calls),
];

impl crate::telemetry::Collect for CtxInner {
    fn collect(&self) {
        let ctx = self.engine.cores()[0].local_addr().to_string();
        let c = |name: &'static str, v: u64| counter!(name, "context" => ctx.clone()).absolute(v);
        let ck = |name: &'static str, key: &'static str, val: &'static str, v: u64| {
            counter!(name, "context" => ctx.clone(), key => val).absolute(v)
        };

        // the engine: packets, bytes, drops by cause, copies (each counter summed over cores)
        let sum = |f: fn(&EngineStats) -> &Counter| self.engine.cores().iter().map(|c| f(&c.stats).get()).sum::<u64>();
        for (name, label, f) in ENGINE_COUNTERS {
            match label {
                Some((key, val)) => ck(name, key, val, sum(f)),
                None => c(name, sum(f)),
            }
        }
        let staging = self
            .engine
            .cores()
            .iter()
            .map(|c| c.stats.staging_bytes.get())
            .sum::<u64>();
        let peak = self
            .engine
            .cores()
            .iter()
            .map(|c| c.stats.staging_bytes_peak.get())
            .max()
            .unwrap_or(0);
        gauge!("flexns_staging_bytes", "context" => ctx.clone()).set(staging as f64);
        gauge!("flexns_staging_peak_bytes", "context" => ctx.clone()).set(peak as f64);

        // the link's own counters (shared-memory rings, `link = "shm"`), summed over cores
        let st = self.engine.stats();
        ck("flexns_shm_messages_total", "direction", "tx", st.shm_tx_messages);
        ck("flexns_shm_messages_total", "direction", "rx", st.shm_rx_messages);
        c("flexns_shm_doorbells_total", st.shm_doorbells);
        gauge!("flexns_shm_peers", "context" => ctx.clone()).set(st.shm_peers as f64);
        // what same-host peers copied into and out of this context's memory (its side of the
        // one-copy path, where no packet arrives)
        if let Some(h) = &self.same_host {
            let (written, read) = h.export.peer_bytes();
            ck("flexns_same_host_peer_bytes_total", "direction", "in", written);
            ck("flexns_same_host_peer_bytes_total", "direction", "out", read);
        }

        // the error counts of QPs already removed, read before the live ones: a QP removed in
        // between is missed this once rather than counted twice (the counter never goes down)
        let mut gone = [0u64; QpErrorCause::COUNT];
        for c in self.engine.cores() {
            for (g, n) in gone.iter_mut().zip(&c.stats.removed_qp_errors) {
                *g += n.get();
            }
        }

        // the QPs, summed, and their paths; their CQs; the limits congestion control set
        let mut t = RcStats::default();
        let mut qps = 0usize;
        let mut paths: Vec<PathStats> = Vec::new();
        let mut cqs: Vec<Arc<CqShared>> = Vec::new();
        let mut cc: Vec<(&'static str, Option<u64>, Option<u64>)> = Vec::new();
        for core in self.engine.cores() {
            // read on the core that owns the QPs, in one command
            let read = core.call_each(|slots| {
                let mut r = CoreQps::default();
                for s in slots {
                    r.qps += 1;
                    r.stats.add(&s.qp.stats());
                    r.paths.extend(s.qp.path_stats());
                    for q in [&s.send_cq, &s.recv_cq] {
                        if !r.cqs.iter().any(|c| Arc::ptr_eq(c, q)) {
                            r.cqs.push(q.clone());
                        }
                    }
                    let kind = s.qp.config().cc;
                    if kind != CcKind::None {
                        r.cc.push((kind.name(), s.qp.pacer().rate(), s.qp.pacer().window()));
                    }
                }
                r
            });
            let Some(r) = read else { continue };
            qps += r.qps;
            t.add(&r.stats);
            paths.extend(r.paths);
            for q in r.cqs {
                if !cqs.iter().any(|c| Arc::ptr_eq(c, &q)) {
                    cqs.push(q);
                }
            }
            cc.extend(r.cc);
        }
        // completions waiting in the CQs the QPs report to, and completions that found a CQ full
        let (used, room) = cqs
            .iter()
            .map(|q| q.occupancy())
            .fold((0, 0), |(u, r), (a, b)| (u + a, r + b));
        gauge!("flexns_cq_completions", "context" => ctx.clone()).set(used as f64);
        gauge!("flexns_cq_capacity_completions", "context" => ctx.clone()).set(room as f64);
        c("flexns_cq_overruns_total", cqs.iter().map(|q| q.overruns()).sum());
        // one sample per congestion-controlled QP per collection: the distribution over QPs
        // and time of the rate and window each algorithm set
        for (alg, rate, window) in cc {
            if let Some(r) = rate {
                histogram!("flexns_cc_rate_bytes_per_second", "context" => ctx.clone(), "algorithm" => alg)
                    .record(r as f64);
            }
            if let Some(w) = window {
                histogram!("flexns_cc_window_bytes", "context" => ctx.clone(), "algorithm" => alg).record(w as f64);
            }
        }
        gauge!("flexns_qps", "context" => ctx.clone()).set(qps as f64);
        c("flexns_retransmitted_packets_total", t.retransmitted_packets);
        c("flexns_spurious_retransmissions_total", t.spurious_retransmissions);
        c("flexns_retransmit_timeouts_total", t.timeouts);
        ck("flexns_naks_total", "kind", "sequence_sent", t.seq_naks_sent);
        ck("flexns_naks_total", "kind", "rnr_sent", t.rnr_naks_sent);
        ck("flexns_naks_total", "kind", "rnr_received", t.rnr_naks_received);
        ck("flexns_cnps_total", "direction", "sent", t.cnps_sent);
        ck("flexns_cnps_total", "direction", "received", t.cnps_received);
        c("flexns_duplicate_requests_total", t.duplicate_requests);
        c("flexns_duplicate_requests_refused_total", t.duplicate_requests_refused);
        ck("flexns_ghost_responses_total", "kind", "ack", t.ghost_acks);
        ck("flexns_ghost_responses_total", "kind", "nak", t.ghost_naks);
        ck("flexns_ghost_responses_total", "kind", "response", t.ghost_responses);
        // peer address validation (transport::rc::validation)
        ck("flexns_peer_challenges_total", "result", "sent", t.challenges_sent);
        ck(
            "flexns_peer_challenges_total",
            "result",
            "validated",
            t.routes_validated,
        );
        ck(
            "flexns_peer_challenges_total",
            "result",
            "bad_reply",
            t.bad_challenge_replies,
        );
        ck("flexns_unvalidated_packets_total", "action", "held", t.gated_packets);
        ck(
            "flexns_unvalidated_packets_total",
            "action",
            "dropped",
            t.refused_unvalidated,
        );
        // QPs that entered ERR, live ones and those already removed
        for cause in QpErrorCause::ALL {
            let i = cause as usize;
            ck(
                "flexns_qp_errors_total",
                "cause",
                cause.label(),
                t.qp_errors[i] + gone[i],
            );
        }
        c("flexns_out_of_order_packets_total", t.out_of_order_packets);
        c("flexns_cc_deferred_packets_total", t.cc_deferred);
        let up = paths.iter().filter(|p| p.up).count();
        gauge!("flexns_paths", "context" => ctx.clone(), "state" => "up").set(up as f64);
        gauge!("flexns_paths", "context" => ctx.clone(), "state" => "down").set((paths.len() - up) as f64);
        c("flexns_path_lost_packets_total", paths.iter().map(|p| p.lost).sum());
        c("flexns_path_downs_total", paths.iter().map(|p| p.downs as u64).sum());
        let rtts: Vec<f64> = paths
            .iter()
            .filter(|p| p.srtt_ns > 0)
            .map(|p| p.srtt_ns as f64 / 1e9)
            .collect();
        if !rtts.is_empty() {
            let (lo, hi) = rtts.iter().fold((f64::MAX, 0f64), |(l, h), &r| (l.min(r), h.max(r)));
            let mean = rtts.iter().sum::<f64>() / rtts.len() as f64;
            for (stat, v) in [("min", lo), ("mean", mean), ("max", hi)] {
                gauge!("flexns_path_srtt_seconds", "context" => ctx.clone(), "stat" => stat).set(v);
            }
        }

        // offloads and RedN chains
        let o = self.offload.stats();
        for (status, v) in [
            ("ok", o.ok),
            ("no_handler", o.no_handler),
            ("error", o.errors),
            ("panic", o.panics),
            ("timeout", o.timeouts),
            ("overloaded", o.overloaded),
        ] {
            ck("flexns_offload_requests_total", "status", status, v);
        }
        c("flexns_offload_dma_ops_total", o.dma_ops);
        c("flexns_offload_dma_bytes_total", o.dma_bytes);
        let r = self.engine.cores()[0].redn.stats();
        c("flexns_redn_chains_total", r.chains);
        c("flexns_redn_steps_total", r.steps);
        c("flexns_redn_aborts_total", r.aborts);
        c("flexns_redn_throttled_total", r.throttled);
    }
}

/// What the metrics read of one core's QPs.
#[derive(Default)]
struct CoreQps {
    qps: usize,
    stats: RcStats,
    paths: Vec<PathStats>,
    cqs: Vec<Arc<CqShared>>,
    cc: Vec<(&'static str, Option<u64>, Option<u64>)>,
}
