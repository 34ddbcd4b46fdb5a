//! A context's collector: the engine's, its QPs' and its offloading engine's counters copied
//! into the metrics registry once a second (see [`crate::telemetry`]). Every series carries
//! `context` = the context's data-path address.

use super::CtxInner;
use crate::path::PathStats;
use crate::transport::rc::RcStats;
use metrics::{counter, gauge};

impl crate::telemetry::Collect for CtxInner {
    fn collect(&self) {
        let ctx = self.engine.cores()[0].local_addr().to_string();
        let c = |name: &'static str, v: u64| counter!(name, "context" => ctx.clone()).absolute(v);
        let ck = |name: &'static str, key: &'static str, val: &'static str, v: u64| {
            counter!(name, "context" => ctx.clone(), key => val).absolute(v)
        };

        // the engine: packets, bytes, drops by cause, copies, staging memory
        let mut staging = (0, 0);
        let mut e = [0u64; 16];
        for core in self.engine.cores() {
            let s = &core.stats;
            for (i, v) in [
                s.rx_datagrams.get(),
                s.rx_bytes.get(),
                s.tx_packets.get(),
                s.tx_bytes.get(),
                s.tx_errors.get(),
                s.rx_truncated.get(),
                s.rx_oversized.get(),
                s.rx_unknown_opcode.get(),
                s.rx_bad_version.get(),
                s.rx_bad_pad.get(),
                s.rx_bad_icrc.get(),
                s.rx_unknown_qp.get(),
                s.rx_wrong_source.get(),
                s.rx_ce.get(),
                s.tx_payload_copy_bytes.get(),
                s.rx_payload_copy_bytes.get(),
            ]
            .into_iter()
            .enumerate()
            {
                e[i] += v;
            }
            staging.0 += s.staging_bytes.get();
            staging.1 = staging.1.max(s.staging_bytes_peak.get());
        }
        c("flexns_rx_packets_total", e[0]);
        c("flexns_rx_bytes_total", e[1]);
        c("flexns_tx_packets_total", e[2]);
        c("flexns_tx_bytes_total", e[3]);
        c("flexns_tx_errors_total", e[4]);
        for (kind, v) in [
            ("truncated", e[5]),
            ("oversized", e[6]),
            ("unknown_opcode", e[7]),
            ("bad_version", e[8]),
            ("bad_pad", e[9]),
            ("bad_icrc", e[10]),
            ("unknown_qp", e[11]),
            ("wrong_source", e[12]),
        ] {
            ck("flexns_rx_malformed_packets_total", "kind", kind, v);
        }
        c("flexns_rx_ecn_ce_packets_total", e[13]);
        ck("flexns_payload_copy_bytes_total", "direction", "tx", e[14]);
        ck("flexns_payload_copy_bytes_total", "direction", "rx", e[15]);
        gauge!("flexns_staging_bytes", "context" => ctx.clone()).set(staging.0 as f64);
        gauge!("flexns_staging_peak_bytes", "context" => ctx.clone()).set(staging.1 as f64);

        // the QPs, summed, and their paths
        let mut t = RcStats::default();
        let mut qps = 0usize;
        let mut paths: Vec<PathStats> = Vec::new();
        for core in self.engine.cores() {
            let slots: Vec<_> = core.qps.read().values().cloned().collect();
            for slot in slots {
                let s = slot.lock();
                qps += 1;
                add(&mut t, &s.qp.stats());
                paths.extend(s.qp.path_stats());
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

fn add(t: &mut RcStats, s: &RcStats) {
    t.retransmitted_packets += s.retransmitted_packets;
    t.spurious_retransmissions += s.spurious_retransmissions;
    t.timeouts += s.timeouts;
    t.seq_naks_sent += s.seq_naks_sent;
    t.rnr_naks_sent += s.rnr_naks_sent;
    t.rnr_naks_received += s.rnr_naks_received;
    t.cnps_sent += s.cnps_sent;
    t.cnps_received += s.cnps_received;
    t.duplicate_requests += s.duplicate_requests;
    t.out_of_order_packets += s.out_of_order_packets;
    t.cc_deferred += s.cc_deferred;
}
