//! Engine counters: what came in, what was dropped and why, what went out.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};

/// A relaxed atomic counter.
#[derive(Default, Debug)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Counters of one engine.
#[derive(Default, Debug)]
pub(crate) struct EngineStats {
    pub rx_datagrams: Counter,
    pub rx_bytes: Counter,
    pub rx_truncated: Counter,
    pub rx_oversized: Counter,
    pub rx_unknown_opcode: Counter,
    pub rx_bad_version: Counter,
    pub rx_bad_pad: Counter,
    pub rx_bad_icrc: Counter,
    pub rx_unknown_qp: Counter,
    pub rx_wrong_source: Counter,
    /// Receives whose IP header carried ECN CE.
    pub rx_ce: Counter,
    pub tx_packets: Counter,
    pub tx_bytes: Counter,
    pub tx_errors: Counter,
    /// Packets a core sent to its own addresses, delivered in memory.
    pub hairpin_packets: Counter,
    /// sendmmsg messages (a GSO message carries several packets).
    pub tx_messages: Counter,
    /// Send calls to the link: `sendmmsg` system calls on UDP, ring pushes on shm.
    pub tx_calls: Counter,
    /// Receives into staging buffers (a GRO receive carries several datagrams).
    pub staging_fills: Counter,
    /// Payload bytes the transmit path copied: READ-response and small-payload snapshots taken
    /// before the ICRC, hairpin packets serialized in memory, INLINE payloads moved through the
    /// send queue. Larger SEND/WRITE payloads go out by reference and are not copied.
    pub tx_payload_copy_bytes: Counter,
    /// Payload bytes copied into registered memory on receive (from the staging buffers) and
    /// by loopback execution of RedN chains.
    pub rx_payload_copy_bytes: Counter,
    /// The part of `rx_payload_copy_bytes` copied in the same pass that verified the ICRC (the
    /// next expected packets of WRITEs in progress, placed straight into their checked range).
    pub rx_fused_copy_bytes: Counter,
    /// Payload bytes WRITEs and READs moved by one copy through a mapping of a same-host
    /// peer's memory (`crate::samehost`), no packets.
    pub same_host_copy_bytes: Counter,
    /// Payload bytes they moved by CMA (`process_vm_writev`/`readv`) into caller memory.
    pub same_host_cma_bytes: Counter,
    /// Requests the same-host path executed.
    pub same_host_ops: Counter,
    /// The receive staging memory allocated.
    pub staging_bytes: Counter,
    /// The most staging memory one receive batch filled.
    pub staging_bytes_peak: Counter,
    /// Loop passes that did work, run by an engine thread (a data core, or a run-to-completion
    /// context's backstop).
    pub engine_thread_passes: Counter,
    /// Loop passes that did work, run by an application thread inside a post, poll or wait
    /// (run to completion, or a lone request's send).
    pub application_passes: Counter,
    /// Loop passes that did work, run by a driver task on the application's runtime
    /// ([`crate::config::Drive::Runtime`]).
    pub task_passes: Counter,
    /// Error-state entries of the QPs this core removed (their handles were dropped), by
    /// cause: with the live QPs' counts, `flexns_qp_errors_total` never goes down.
    pub removed_qp_errors: [Counter; crate::transport::rc::QpErrorCause::COUNT],
}

/// A point-in-time copy of the counters.
#[derive(Debug, Clone, Copy, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Datagrams received.
    pub rx_datagrams: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Datagrams dropped as malformed (truncated, oversized, unknown opcode, bad version or
    /// pad).
    pub rx_malformed: u64,
    /// Datagrams dropped for a bad ICRC.
    pub rx_bad_icrc: u64,
    /// Datagrams for a QP this engine does not have.
    pub rx_unknown_qp: u64,
    /// Datagrams from an address that is not the QP's peer.
    pub rx_wrong_source: u64,
    /// Receives whose IP header carried ECN CE.
    pub rx_ce: u64,
    /// Packets sent.
    pub tx_packets: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Send errors.
    pub tx_errors: u64,
    /// Packets a core sent to its own addresses, delivered in memory.
    pub hairpin_packets: u64,
    /// sendmmsg messages (a GSO message carries several packets).
    pub tx_messages: u64,
    /// Send calls to the link: `sendmmsg` system calls on UDP, ring pushes on shm.
    pub tx_calls: u64,
    /// Receives into staging buffers.
    pub staging_fills: u64,
    /// Payload bytes the transmit path copied.
    pub tx_payload_copy_bytes: u64,
    /// Payload bytes copied into registered memory on receive.
    pub rx_payload_copy_bytes: u64,
    /// The part of those copied in the pass that verified the ICRC.
    pub rx_fused_copy_bytes: u64,
    /// Payload bytes moved by the same-host path through a mapping of the peer's memory.
    pub same_host_copy_bytes: u64,
    /// Payload bytes moved by the same-host path by CMA.
    pub same_host_cma_bytes: u64,
    /// Requests the same-host path executed.
    pub same_host_ops: u64,
    /// The receive staging memory allocated.
    pub staging_bytes: u64,
    /// The most staging memory one receive batch filled.
    pub staging_bytes_peak: u64,
    /// Loop passes that did work on an engine thread.
    pub engine_thread_passes: u64,
    /// Loop passes that did work on an application thread (run to completion).
    pub application_passes: u64,
    /// Loop passes that did work in a driver task on the application's runtime.
    pub task_passes: u64,
    /// Messages (datagrams or GSO messages) sent through shared-memory rings (`link = "shm"`).
    pub shm_tx_messages: u64,
    /// Messages received from shared-memory rings.
    pub shm_rx_messages: u64,
    /// Peers sent to through a ring now.
    pub shm_peers: u64,
    /// Doorbells sent to wake a peer that slept with an empty ring.
    pub shm_doorbells: u64,
}

impl StatsSnapshot {
    /// Adds another core's counters (staging bytes add up too: each core has its own set).
    pub fn add(&mut self, o: &StatsSnapshot) {
        self.rx_datagrams += o.rx_datagrams;
        self.rx_bytes += o.rx_bytes;
        self.rx_malformed += o.rx_malformed;
        self.rx_bad_icrc += o.rx_bad_icrc;
        self.rx_unknown_qp += o.rx_unknown_qp;
        self.rx_wrong_source += o.rx_wrong_source;
        self.rx_ce += o.rx_ce;
        self.tx_packets += o.tx_packets;
        self.tx_bytes += o.tx_bytes;
        self.tx_errors += o.tx_errors;
        self.hairpin_packets += o.hairpin_packets;
        self.tx_messages += o.tx_messages;
        self.tx_calls += o.tx_calls;
        self.staging_fills += o.staging_fills;
        self.tx_payload_copy_bytes += o.tx_payload_copy_bytes;
        self.shm_tx_messages += o.shm_tx_messages;
        self.shm_rx_messages += o.shm_rx_messages;
        self.shm_peers += o.shm_peers;
        self.shm_doorbells += o.shm_doorbells;
        self.rx_payload_copy_bytes += o.rx_payload_copy_bytes;
        self.rx_fused_copy_bytes += o.rx_fused_copy_bytes;
        self.same_host_copy_bytes += o.same_host_copy_bytes;
        self.same_host_cma_bytes += o.same_host_cma_bytes;
        self.same_host_ops += o.same_host_ops;
        self.staging_bytes += o.staging_bytes;
        self.staging_bytes_peak += o.staging_bytes_peak;
        self.engine_thread_passes += o.engine_thread_passes;
        self.application_passes += o.application_passes;
        self.task_passes += o.task_passes;
    }
}

impl EngineStats {
    /// Counts a malformed datagram by the kind of its [`crate::wire::WireError`].
    pub(crate) fn rx_malformed(&self, kind: &str) {
        match kind {
            "truncated" => &self.rx_truncated,
            "oversized" => &self.rx_oversized,
            "unknown_opcode" => &self.rx_unknown_opcode,
            "bad_version" => &self.rx_bad_version,
            "bad_pad" => &self.rx_bad_pad,
            _ => &self.rx_bad_icrc,
        }
        .inc()
    }

    pub(crate) fn set_staging_bytes(&self, n: u64) {
        self.staging_bytes.0.store(n, Ordering::Relaxed);
    }

    /// Notes how much staging one receive batch filled.
    pub(crate) fn note_staged(&self, n: u64) {
        self.staging_bytes_peak.0.fetch_max(n, Ordering::Relaxed);
    }

    /// The counters, with those the core's link keeps itself.
    pub(crate) fn snapshot(&self, link: crate::link::LinkStats) -> StatsSnapshot {
        StatsSnapshot {
            rx_datagrams: self.rx_datagrams.get(),
            rx_bytes: self.rx_bytes.get(),
            rx_malformed: self.rx_truncated.get()
                + self.rx_oversized.get()
                + self.rx_unknown_opcode.get()
                + self.rx_bad_version.get()
                + self.rx_bad_pad.get(),
            rx_bad_icrc: self.rx_bad_icrc.get(),
            rx_unknown_qp: self.rx_unknown_qp.get(),
            rx_wrong_source: self.rx_wrong_source.get(),
            rx_ce: self.rx_ce.get(),
            tx_packets: self.tx_packets.get(),
            tx_bytes: self.tx_bytes.get(),
            tx_errors: self.tx_errors.get(),
            hairpin_packets: self.hairpin_packets.get(),
            tx_messages: self.tx_messages.get(),
            tx_calls: self.tx_calls.get(),
            staging_fills: self.staging_fills.get(),
            tx_payload_copy_bytes: self.tx_payload_copy_bytes.get(),
            rx_payload_copy_bytes: self.rx_payload_copy_bytes.get(),
            rx_fused_copy_bytes: self.rx_fused_copy_bytes.get(),
            same_host_copy_bytes: self.same_host_copy_bytes.get(),
            same_host_cma_bytes: self.same_host_cma_bytes.get(),
            same_host_ops: self.same_host_ops.get(),
            staging_bytes: self.staging_bytes.get(),
            staging_bytes_peak: self.staging_bytes_peak.get(),
            engine_thread_passes: self.engine_thread_passes.get(),
            application_passes: self.application_passes.get(),
            task_passes: self.task_passes.get(),
            shm_tx_messages: link.ring_tx_messages,
            shm_rx_messages: link.ring_rx_messages,
            shm_peers: link.ring_peers,
            shm_doorbells: link.ring_doorbells,
        }
    }
}
