//! The storage agent's side of Solar toward one storage server.
//!
//! A write of n blocks becomes n WRITE packets; a read becomes READ_REQs of up to
//! `read_chunk` blocks, answered by one READ_DATA per block. Every block is tracked on its own:
//! acknowledged (or arrived) blocks are done, a block whose packet timed out (per-path RTO) or
//! was overtaken by three later packets of its path is resent alone, on another path when one
//! is healthy. A request completes when every block did; it fails on a status no resend can fix
//! or after `io_timeout_ns` (all paths down waits until then, it does not fail early).
//!
//! Paths are the transport's [`PathSet`], the one RC's multipath uses: it picks each packet's
//! path by the spray policy (by default `weighted`: the path expected to deliver it first),
//! keeps each path's RTT and loss rate, takes a path that stops delivering while others
//! deliver out of the rotation (a resend avoids a path already silent for its RTO), probes a
//! down path every `probe_interval_ns` and brings it back on the answer. The client keeps only
//! its per-path ledger of packets in flight by PSN, and backs a path's RTO off (doubling per
//! timeout, up to `max_rto_ns`) while it delivers nothing, so a server that is down gets a
//! resend per backed-off RTO, not a window's worth per RTO. One congestion-control algorithm
//! ([`crate::cc::CcAlgorithm`]) limits the bytes in flight toward the server across all paths
//! (so K paths are not K times as aggressive), fed by every acknowledgement's RTT.

use super::wire::{self, flags, Header, Op, Status, WireError, BLOCK};
use super::{BlockRef, Transmit};
use crate::cc::{CcAlgorithm, CcOutput, RxKind, RxMeta, StartInfo, TxMeta, Verdict};
use crate::path::{PathParams, PathSet, PathStats, SprayPolicy};
use crate::transport::ledger::{Flight, Leave, SendTime, Sent, SentLedger};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

/// A request handle.
pub type IoId = u64;

/// Where a request goes: blocks of a volume, under the epoch of the caller's attachment. A
/// server fenced at a higher epoch for the volume refuses the request (`WrongEpoch`), so a
/// writer whose attachment moved elsewhere can no longer change (or read) the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// The volume.
    pub volume: u32,
    /// The first block.
    pub lba: u64,
    /// The caller's attachment epoch of the volume.
    pub epoch: u32,
}

/// Settings of a client.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Paths toward the server (1..=64).
    pub paths: u16,
    /// Source ports the paths may leave from (the driver's; at most 255): path `p` starts on
    /// port `p`, and a path that looks cut moves to a spare one, a fresh ECMP hash (see
    /// [`PathSet::set_ports`]). At most `paths` (0 included): no spare, paths never move.
    pub source_ports: u16,
    /// How packets spread over the paths.
    pub policy: SprayPolicy,
    /// New blocks sent in a row on the path the policy picked before it picks again (a
    /// flowlet; at most a path's share of the window, so a small window still spreads over
    /// every path). A pass's blocks then leave in fewer system calls (one `sendmmsg` per path
    /// it uses) and the server answers them on fewer ports; 1 places every block on its own.
    /// Resent blocks are always placed one by one, away from the path they were lost on.
    pub burst_blocks: u32,
    /// The epoch requests carry unless the caller names one ([`Target::epoch`]).
    pub epoch: u32,
    /// First request id; ids increase from it. Seed it above any id this agent used before for
    /// these volumes (a clock in ns does), so a server orders writes across agent restarts.
    pub rpc_base: u64,
    /// A path's RTO before it has an RTT sample.
    pub initial_rto_ns: u64,
    /// The least RTO (RFC 6298's floor, here for a datacenter fabric).
    pub min_rto_ns: u64,
    /// The most RTO, backoff included.
    pub max_rto_ns: u64,
    /// RTOs a path may deliver nothing after a send, while another path delivers, before it
    /// is taken out of the rotation.
    pub down_after: u32,
    /// How often a path out of the rotation is probed.
    pub probe_interval_ns: u64,
    /// A request not complete after this fails (TimedOut).
    pub io_timeout_ns: u64,
    /// Resends of a block after retryable statuses (CRC error, busy) before its request fails.
    pub max_block_attempts: u32,
    /// Bytes in flight when the congestion control sets no window (or there is none).
    pub window_bytes: u64,
    /// Blocks per READ_REQ.
    pub read_chunk: u16,
    /// A write block the server accepted is sent again when its `Ok` does not come within
    /// the path's RTO plus four times the server's smoothed service time (the `Ok` was lost,
    /// or the server restarted and lost the block), at most this long.
    pub durable_timeout_ns: u64,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            paths: 4,
            source_ports: 0,
            policy: SprayPolicy::Weighted,
            burst_blocks: 8,
            epoch: 0,
            rpc_base: 1,
            initial_rto_ns: 5_000_000,
            min_rto_ns: 1_000_000,
            max_rto_ns: 200_000_000,
            down_after: 3,
            probe_interval_ns: 10_000_000,
            io_timeout_ns: 30_000_000_000,
            max_block_attempts: 16,
            window_bytes: 256 * BLOCK as u64,
            read_chunk: 32,
            durable_timeout_ns: 2_000_000_000,
        }
    }
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    /// The server answered block `.1` with a final error status.
    #[error("the server answered {0:?} for block {1}")]
    Status(Status, u16),
    /// The request did not complete within [`ClientConfig::io_timeout_ns`].
    #[error("not complete within the I/O timeout ({blocks_left} blocks outstanding, {paths_up} paths up)")]
    TimedOut {
        /// Blocks not yet done.
        blocks_left: u16,
        /// Paths in the rotation at the time.
        paths_up: u16,
    },
    /// Block `.0` failed its CRC check `.1` times (sent or received corrupt).
    #[error("block {0} failed its CRC check {1} times")]
    Crc(u16, u32),
}

/// Refused requests.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// A length that is not whole blocks.
    #[error("length {0} is not a positive multiple of 4096")]
    Length(usize),
    /// More blocks than one request carries.
    #[error("{0} blocks exceed 65535 per request")]
    TooLarge(usize),
    /// A range past the end of the block address space.
    #[error("lba {0} + {1} blocks overflows")]
    Range(u64, usize),
    /// A version that cannot be used (see [`SolarClient::write_versioned`]).
    #[error("write version {0} is 0, in the upper half, or already in flight")]
    Version(u64),
}

/// What the driver learns from the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// A request finished: all blocks written and durable / all blocks delivered, or failed.
    Done {
        /// The request.
        io: IoId,
        /// How it ended.
        result: Result<(), IoError>,
    },
}

/// A checked READ_DATA block to place at `idx * 4096` of request `io`'s buffer.
#[derive(Debug, PartialEq, Eq)]
pub struct Placement<'a> {
    /// The read it belongs to.
    pub io: IoId,
    /// The block's index in the read.
    pub idx: u16,
    /// The block (CRC checked), in the received packet.
    pub data: &'a [u8],
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Packets sent (requests and probes).
    pub packets_sent: u64,
    /// Blocks sent, resends included.
    pub blocks_sent: u64,
    /// Blocks sent again (lost, refused as retryable, or not made durable in time).
    pub blocks_resent: u64,
    /// Packets given up on at their RTO.
    pub timeouts: u64,
    /// Packets resent because later ones on their path were answered first.
    pub fast_resends: u64,
    /// Blocks that failed a CRC check (server's answer, or a read block here).
    pub crc_errors: u64,
    /// Write blocks the server had a newer write for (done, nothing to resend).
    pub stale_acks: u64,
    /// Answers for blocks already done or requests already finished.
    pub duplicates: u64,
    /// Packets dropped as malformed.
    pub malformed: u64,
    /// Probes sent to paths out of the rotation.
    pub probes: u64,
    /// Times a path left the rotation.
    pub path_downs: u64,
    /// Times a path came back.
    pub path_ups: u64,
    /// Times a path moved to another source port (see [`ClientConfig::source_ports`]).
    pub repaths: u64,
    /// Accepted write blocks sent again because their `Ok` did not come in time.
    pub durable_resends: u64,
    /// Of those, the ones sent again early: the `Ok` of a block accepted well after them came
    /// first (the server makes writes durable in about the order it accepts them).
    pub durable_resends_by_order: u64,
    /// The server's address-validation challenges echoed.
    pub challenges_answered: u64,
}

/// One path's packets, by PSN (health and timing are the [`PathSet`]'s). The wire carries a
/// PSN's low 32 bits ([`SolarClient::seq_of`] extends an answer's).
#[derive(Debug, Clone)]
struct PathLedger {
    /// The units sent on this path; a unit is in flight while its record is
    /// [`Flight::On`] (answered, lost and retired ones are taken off and acknowledged).
    sent: SentLedger<Unit>,
    /// PSNs presumed lost whose answer may still come (a late answer takes the loss back);
    /// the newest [`LOST_MEMORY`].
    lost: BTreeSet<u64>,
    /// Timeouts on this path since it last delivered: each doubles its RTO.
    backoff: u32,
}

/// Presumed-lost PSNs remembered per path.
const LOST_MEMORY: usize = 1024;
/// Set in the request id of every read: the lower half is for write versions, which callers
/// may choose ([`SolarClient::write_versioned`]).
const READ_RPC: u64 = 1 << 63;

/// Most doublings of a path's RTO while it delivers nothing.
const MAX_BACKOFF: u32 = 8;

/// Challenges waiting to be echoed at most (one per path is what a server sends at a time).
const MAX_ECHOES: usize = 64;

/// How a packet left its path's ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Answered.
    Delivered,
    /// Presumed lost (timeout, overtaken, its path went down).
    Lost,
    /// No longer wanted (its block is done through another packet, or its request ended).
    Retired,
}

/// A unit waiting to be sent.
#[derive(Debug, Clone, Copy)]
struct Queued {
    io: IoId,
    /// First block and how many.
    idx: u16,
    n: u16,
    /// A resend (after a loss or a retryable status).
    retx: bool,
    /// The path it was lost on, to avoid.
    avoid: Option<u16>,
}

impl Queued {
    fn new(io: IoId, idx: u16, n: u16) -> Queued {
        Queued {
            io,
            idx,
            n,
            retx: false,
            avoid: None,
        }
    }

    /// Block `idx` of `io` again, away from `avoid`.
    fn resend(io: IoId, idx: u16, avoid: Option<u16>) -> Queued {
        Queued {
            io,
            idx,
            n: 1,
            retx: true,
            avoid,
        }
    }
}

/// What a packet in flight carries: one WRITE block, or a READ_REQ for blocks `idx..idx+n`
/// (its send time, and whether it is a resend, are its ledger record's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Unit {
    io: IoId,
    idx: u16,
    n: u16,
    /// Blocks of the unit still expected (a READ_REQ's blocks arrive one by one).
    left: u16,
    deadline: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write,
    Read,
}

struct Io {
    kind: Kind,
    volume: u32,
    lba: u64,
    epoch: u32,
    blocks: u16,
    rpc: u64,
    data: Option<Arc<[u8]>>,
    fua: bool,
    /// A zero write: the blocks it zeroes; its "blocks" are then units of up to
    /// `wire::MAX_ZERO_BLOCKS` blocks, one packet each. 0 otherwise.
    zero_blocks: u64,
    /// Done bit per block.
    done: Vec<bool>,
    left: u16,
    /// Resends per block after retryable statuses.
    attempts: Vec<u32>,
    /// Where each outstanding block's packet is.
    at: BTreeMap<u16, Carrier>,
    /// Write blocks the server accepted, waiting to be durable: resent after the deadline.
    accepted: BTreeMap<u16, Accepted>,
    deadline: u64,
}

/// A write block the server accepted: when its `Accepted` came, and when it is sent again if
/// its `Ok` has not come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Accepted {
    at: u64,
    deadline: u64,
    /// Sent again once already because a later block's `Ok` overtook it: from then on only
    /// its deadline sends it again (a block the disk is slow with is not resent at every
    /// `Ok` that overtakes it).
    reordered: bool,
}

/// The packet that carries a block: its path and its PSN there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Carrier {
    path: u16,
    psn: u64,
}

/// The client toward one storage server.
pub struct SolarClient {
    cfg: ClientConfig,
    paths: PathSet,
    ledgers: Vec<PathLedger>,
    /// In submission order (ids increase): timers visit them in one order every run.
    ios: BTreeMap<IoId, Io>,
    /// Requests by (volume, request id): ids are unique per volume (a caller's versions are
    /// one sequence per volume; two volumes may use the same numbers).
    by_rpc: HashMap<(u32, u64), IoId>,
    next_io: IoId,
    next_rpc: u64,
    /// Units to send, resends first.
    queue: VecDeque<Queued>,
    events: VecDeque<ClientEvent>,
    probes: VecDeque<u16>,
    /// Challenges to echo: (path, nonce).
    echoes: VecDeque<(u16, u64)>,
    inflight_bytes: u64,
    cc: Option<Box<dyn CcAlgorithm>>,
    cc_window: Option<u64>,
    cc_rate: Option<u64>,
    cc_timer: Option<u64>,
    cc_hold: bool,
    next_send_at: u64,
    /// The latest time the driver handed in.
    last_now: u64,
    /// When the timers last ran ([`SolarClient::on_timer`]).
    last_timer: u64,
    /// Smoothed time the server takes to make a write durable (from its `Ok` answers).
    service_ns: u64,
    /// When packets last expired (0: never).
    last_timeout: u64,
    /// Accepted write blocks by when their `Accepted` came: (time, request, block). An entry
    /// whose block is no longer waiting (done, resent, its request gone) is skipped and
    /// dropped when reached.
    accept_order: BTreeSet<(u64, IoId, u16)>,
    stats: ClientStats,
}

impl SolarClient {
    /// A client; `cc` limits the bytes in flight (None: `window_bytes`).
    pub fn new(cfg: ClientConfig, cc: Option<Box<dyn CcAlgorithm>>, now: u64) -> SolarClient {
        let n = (cfg.paths as usize).clamp(1, crate::path::MAX_PATHS);
        let params = PathParams {
            min_rto_ns: cfg.min_rto_ns,
            initial_rto_ns: cfg.initial_rto_ns,
            down_after_rtos: cfg.down_after.max(1),
            probe_interval_ns: cfg.probe_interval_ns,
            burst_packets: cfg.burst_blocks.max(1),
            ..PathParams::default()
        };
        let ledger = PathLedger {
            sent: SentLedger::new(1),
            lost: BTreeSet::new(),
            backoff: 0,
        };
        let mut paths = PathSet::new(n, cfg.policy, params);
        paths.set_ports(cfg.source_ports as usize);
        let mut c = SolarClient {
            next_rpc: cfg.rpc_base.max(1),
            paths,
            ledgers: vec![ledger; n],
            cfg,
            ios: BTreeMap::new(),
            by_rpc: HashMap::new(),
            next_io: 1,
            queue: VecDeque::new(),
            events: VecDeque::new(),
            probes: VecDeque::new(),
            echoes: VecDeque::new(),
            inflight_bytes: 0,
            cc,
            cc_window: None,
            cc_rate: None,
            cc_timer: None,
            cc_hold: false,
            next_send_at: 0,
            last_now: now,
            last_timer: now,
            service_ns: 0,
            last_timeout: 0,
            accept_order: BTreeSet::new(),
            stats: ClientStats::default(),
        };
        if let Some(cc) = c.cc.as_mut() {
            let mut out = CcOutput::default();
            cc.on_start(
                now,
                &StartInfo {
                    mtu: (wire::HDR + BLOCK) as u32,
                },
                &mut out,
            );
            c.apply(out);
        }
        c
    }

    /// The counters.
    pub fn stats(&self) -> ClientStats {
        ClientStats {
            repaths: self.paths.repaths(),
            ..self.stats
        }
    }

    /// The paths toward the server: how many, the policy, which are up.
    pub fn paths(&self) -> &PathSet {
        &self.paths
    }

    /// What each path sent, delivered and lost, its RTT and whether it is up.
    pub fn path_stats(&self) -> Vec<PathStats> {
        self.paths.stats()
    }

    /// Paths in the rotation.
    pub fn paths_up(&self) -> u16 {
        self.paths.up_count() as u16
    }

    /// How long this host has lately kept packets waiting (the driver measures it: datagrams
    /// that sat in a socket, timers that fired late), added to every path's RTO and to the
    /// margin by which an `Ok` overtakes a block: a block is resent because the server did
    /// not answer, not because a thread here or there waited for a core (see
    /// [`crate::path::PathSet::set_host_delay`]). Deadlines already armed keep theirs.
    pub fn set_host_delay(&mut self, ns: u64) {
        self.paths.set_host_delay(ns);
    }

    /// Path `i`'s retransmission timeout, backed off while it delivers nothing.
    fn rto(&self, i: u16) -> u64 {
        let backoff = self.ledgers[i as usize].backoff.min(MAX_BACKOFF);
        (self.paths.rto(i as u8).min(self.cfg.max_rto_ns) << backoff).min(self.cfg.max_rto_ns)
    }

    /// The epoch requests carry when the caller names none ([`ClientConfig::epoch`]).
    pub fn epoch(&self) -> u32 {
        self.cfg.epoch
    }

    /// Requests not yet finished.
    pub fn outstanding(&self) -> usize {
        self.ios.len()
    }

    /// The window in effect (bytes in flight allowed).
    pub fn window(&self) -> u64 {
        self.cc_window.unwrap_or(self.cfg.window_bytes).max(BLOCK as u64)
    }

    fn apply(&mut self, out: CcOutput) {
        if let Some(w) = out.window {
            self.cc_window = w;
        }
        if let Some(r) = out.rate {
            self.cc_rate = r;
        }
        if let Some(t) = out.timer {
            self.cc_timer = Some(t);
        }
        if out.rate.is_some() || out.window.is_some() || out.timer.is_some() {
            self.cc_hold = false;
        }
    }

    fn check_len(lba: u64, len: usize) -> Result<u16, SubmitError> {
        if len == 0 || !len.is_multiple_of(BLOCK) {
            return Err(SubmitError::Length(len));
        }
        let n = len / BLOCK;
        if n > u16::MAX as usize {
            return Err(SubmitError::TooLarge(n));
        }
        if lba.checked_add(n as u64).is_none() {
            return Err(SubmitError::Range(lba, n));
        }
        Ok(n as u16)
    }

    fn add(&mut self, now: u64, kind: Kind, target: Target, n: u16, data: Option<Arc<[u8]>>, fua: bool) -> IoId {
        let rpc = self.next_rpc | if kind == Kind::Read { READ_RPC } else { 0 };
        self.next_rpc += 1;
        self.add_as(now, kind, target, n, data, fua, rpc)
    }

    #[allow(clippy::too_many_arguments)]
    fn add_as(
        &mut self,
        now: u64,
        kind: Kind,
        target: Target,
        n: u16,
        data: Option<Arc<[u8]>>,
        fua: bool,
        rpc: u64,
    ) -> IoId {
        let Target { volume, lba, epoch } = target;
        let id = self.next_io;
        self.next_io += 1;
        self.ios.insert(
            id,
            Io {
                kind,
                volume,
                lba,
                epoch,
                blocks: n,
                rpc,
                data,
                fua,
                zero_blocks: 0,
                done: vec![false; n as usize],
                left: n,
                attempts: vec![0; n as usize],
                at: BTreeMap::new(),
                accepted: BTreeMap::new(),
                deadline: now + self.cfg.io_timeout_ns,
            },
        );
        self.by_rpc.insert((volume, rpc), id);
        match kind {
            Kind::Write => self.queue.extend((0..n).map(|i| Queued::new(id, i, 1))),
            Kind::Read => {
                let c = self.cfg.read_chunk.max(1);
                let mut i = 0u16;
                while i < n {
                    let k = c.min(n - i);
                    self.queue.push_back(Queued::new(id, i, k));
                    i += k;
                }
            }
        }
        id
    }

    /// Writes `data` (a positive multiple of 4 KiB) at block `lba` of `volume`.
    pub fn write(&mut self, now: u64, volume: u32, lba: u64, data: Arc<[u8]>, fua: bool) -> Result<IoId, SubmitError> {
        let n = Self::check_len(lba, data.len())?;
        let epoch = self.cfg.epoch;
        Ok(self.add(now, Kind::Write, Target { volume, lba, epoch }, n, Some(data), fua))
    }

    /// Writes `data` (a positive multiple of 4 KiB), or zeros over `blocks` blocks when `data`
    /// is None (deallocated: one header-only packet per run of blocks, with the ZERO flag), at
    /// `target`, as `version`: the request id the server orders writes to a block by
    /// and stores with it. A caller that writes one volume through several clients (replicas)
    /// gives each copy the same version, from one increasing sequence; versions must be unique
    /// per volume in this client and below 2^63 (reads use the upper half).
    pub fn write_versioned(
        &mut self,
        now: u64,
        target: Target,
        data: Option<Arc<[u8]>>,
        blocks: u16,
        fua: bool,
        version: u64,
    ) -> Result<IoId, SubmitError> {
        let n = match &data {
            Some(d) => Self::check_len(target.lba, d.len())?,
            None => Self::check_len(target.lba, blocks as usize * BLOCK)?,
        };
        if version & READ_RPC != 0 || version == 0 || self.by_rpc.contains_key(&(target.volume, version)) {
            return Err(SubmitError::Version(version));
        }
        if data.is_some() {
            return Ok(self.add_as(now, Kind::Write, target, n, data, fua, version));
        }
        // zeros: one packet per run of up to MAX_ZERO_BLOCKS blocks
        let units = (n as u32).div_ceil(wire::MAX_ZERO_BLOCKS) as u16;
        let io = self.add_as(now, Kind::Write, target, units, None, fua, version);
        self.ios.get_mut(&io).expect("just added").zero_blocks = n as u64;
        Ok(io)
    }

    /// Reads `blocks` blocks at `lba` of `volume`; they arrive through [`Self::on_packet`].
    pub fn read(&mut self, now: u64, volume: u32, lba: u64, blocks: u16) -> Result<IoId, SubmitError> {
        let epoch = self.cfg.epoch;
        self.read_at(now, Target { volume, lba, epoch }, blocks)
    }

    /// Reads `blocks` blocks at `target` (under its epoch); see [`Self::read`].
    pub fn read_at(&mut self, now: u64, target: Target, blocks: u16) -> Result<IoId, SubmitError> {
        let n = Self::check_len(target.lba, blocks as usize * BLOCK)?;
        Ok(self.add(now, Kind::Read, target, n, None, false))
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    fn pick_path(&mut self, avoid: Option<u16>) -> u16 {
        let avoid = avoid.and_then(|p| u8::try_from(p).ok());
        self.paths
            .set_window_hint((self.window() / BLOCK as u64).min(u32::MAX as u64) as u32);
        self.paths.pick(avoid) as u16
    }

    /// The next packet to send now, if the window, pacing and paths allow one.
    pub fn poll_transmit(&mut self, now: u64) -> Option<Transmit> {
        self.last_now = self.last_now.max(now);
        if let Some((path, nonce)) = self.echoes.pop_front() {
            // from the path's port, where the challenged requests came from
            self.stats.challenges_answered += 1;
            let mut h = Header::new(Op::ChallengeReply);
            h.path = path;
            h.rpc = nonce;
            h.ts = now;
            return Some(self.tx(path, &h, None));
        }
        if let Some(path) = self.probes.pop_front() {
            self.stats.probes += 1;
            let mut h = Header::new(Op::Probe);
            h.path = path;
            h.ts = now;
            h.epoch = self.cfg.epoch;
            return Some(self.tx(path, &h, None));
        }
        loop {
            let Queued {
                io,
                idx,
                n,
                retx,
                avoid,
            } = *self.queue.front()?;
            let Some(s) = self.ios.get(&io) else {
                self.queue.pop_front();
                continue;
            };
            // skip units already done (a resend raced with a late acknowledgement)
            if (idx..idx + n).all(|i| s.done[i as usize]) {
                self.queue.pop_front();
                continue;
            }
            let bytes = n as u64 * BLOCK as u64;
            if self.inflight_bytes > 0 && self.inflight_bytes + bytes > self.window() {
                return None;
            }
            if self.cc_hold || now < self.next_send_at {
                return None;
            }
            let path = self.pick_path(avoid);
            if let Some(cc) = self.cc.as_mut() {
                if cc.traced().tx_data {
                    let mut out = CcOutput::default();
                    let v = cc.on_tx(
                        now,
                        &TxMeta {
                            opcode: 0x0A,
                            bytes: (wire::HDR + BLOCK) as u32,
                            payload: BLOCK as u32,
                            first: true,
                            msg_bytes: bytes,
                            msg_remaining: 0,
                            retransmit: retx,
                        },
                        &mut out,
                    );
                    self.apply(out);
                    match v {
                        Verdict::Send => {}
                        Verdict::DeferUntil(t) => {
                            self.next_send_at = t;
                            return None;
                        }
                        Verdict::Hold => {
                            self.cc_hold = true;
                            return None;
                        }
                    }
                }
            }
            self.queue.pop_front();
            return Some(self.send_unit(now, io, idx, n, retx, path));
        }
    }

    fn send_unit(&mut self, now: u64, io: IoId, idx: u16, n: u16, retx: bool, path: u16) -> Transmit {
        let rto = self.rto(path);
        let p = &mut self.ledgers[path as usize];
        // a read's blocks come back one after another: give the whole chunk time to arrive
        let deadline = now + rto + n as u64 * 2_000;
        let psn = p.sent.push(Unit {
            io,
            idx,
            n,
            left: n,
            deadline,
        });
        p.sent.put_on(psn, path as u8, now, retx, &mut self.paths);
        let bytes = n as u64 * BLOCK as u64;
        self.inflight_bytes += bytes;
        if let Some(r) = self.cc_rate.filter(|&r| r > 0) {
            self.next_send_at = now.max(self.next_send_at) + bytes * 1_000_000_000 / r;
        }
        self.stats.blocks_sent += n as u64;
        if retx {
            self.stats.blocks_resent += n as u64;
        }
        let s = self.ios.get_mut(&io).expect("queued units belong to live requests");
        for i in idx..idx + n {
            s.at.insert(i, Carrier { path, psn });
        }
        let mut h = Header::new(if s.kind == Kind::Write { Op::Write } else { Op::ReadReq });
        h.flags = if retx { flags::RETX } else { 0 } | if s.fua { flags::FUA } else { 0 };
        if idx + n == s.blocks {
            h.flags |= flags::LAST;
        }
        h.path = path;
        h.volume = s.volume;
        h.rpc = s.rpc;
        h.blk_idx = idx;
        h.blk_cnt = if s.kind == Kind::Write { s.blocks } else { idx + n };
        h.lba = s.lba + idx as u64;
        h.epoch = s.epoch;
        h.psn = psn as u32;
        h.ts = now;
        let block = match (&s.data, s.kind) {
            (Some(d), Kind::Write) => {
                let off = idx as usize * BLOCK;
                h.crc = wire::block_crc(&d[off..off + BLOCK]);
                Some(BlockRef { data: d.clone(), off })
            }
            // a write without data: zeros, a run per unit
            (None, Kind::Write) => {
                let per = wire::MAX_ZERO_BLOCKS as u64;
                h.flags |= flags::ZERO;
                h.lba = s.lba + idx as u64 * per;
                h.count = per.min(s.zero_blocks.saturating_sub(idx as u64 * per)).max(1) as u32;
                None
            }
            _ => None,
        };
        self.tx(path, &h, block)
    }

    fn tx(&mut self, path: u16, h: &Header, block: Option<BlockRef>) -> Transmit {
        self.stats.packets_sent += 1;
        let mut header = [0u8; wire::HDR];
        h.encode(&mut header);
        Transmit {
            path,
            port: self.paths.port(path as u8) as u16,
            peer: 0,
            header,
            block,
        }
    }

    /// The ledger PSN of an answer's 32-bit PSN on `path`: the newest one sent with those low
    /// bits (`u64::MAX`, which no unit has, for one never sent).
    fn seq_of(&self, path: u16, psn: u32) -> u64 {
        let Some(l) = self.ledgers.get(path as usize) else {
            return u64::MAX;
        };
        let end = l.sent.end();
        let back = (end as u32).wrapping_sub(psn) as u64;
        if back == 0 {
            return u64::MAX;
        }
        end.checked_sub(back).unwrap_or(u64::MAX)
    }

    /// The unit in flight on `path` with PSN `psn`.
    fn in_flight(&self, path: u16, psn: u64) -> Option<&Sent<Unit>> {
        self.ledgers
            .get(path as usize)?
            .sent
            .get(psn)
            .filter(|s| matches!(s.flight, Flight::On(_)))
    }

    /// Takes a unit off its path's ledger, telling the path set how it left; returns it and
    /// its send time.
    fn unsend(&mut self, path: u16, psn: u64, how: Outcome) -> Option<(Unit, SendTime)> {
        let l = self.ledgers.get_mut(path as usize)?;
        let leave = match how {
            Outcome::Delivered => Leave::Delivered(self.last_now),
            Outcome::Lost => Leave::Lost,
            Outcome::Retired => Leave::Forgotten,
        };
        if !l.sent.take_off(psn, leave, &mut self.paths) {
            return None;
        }
        l.sent.set_acked(psn);
        let rec = l.sent.get(psn).map(|s| (s.data, s.time))?;
        l.sent.pop_acked();
        match how {
            Outcome::Delivered => l.backoff = 0,
            Outcome::Lost => {
                if l.lost.len() >= LOST_MEMORY {
                    l.lost.pop_first();
                }
                l.lost.insert(psn);
            }
            Outcome::Retired => {}
        }
        self.inflight_bytes = self.inflight_bytes.saturating_sub(rec.0.left as u64 * BLOCK as u64);
        Some(rec)
    }

    /// An answer on `path` to `psn`, a packet no longer in the ledger: if it was presumed
    /// lost, the loss is taken back and the path counts as delivering.
    fn late_answer(&mut self, now: u64, path: u16, psn: u64) {
        let l = &mut self.ledgers[path as usize];
        if l.lost.remove(&psn) {
            l.backoff = 0;
            self.paths.on_late_delivery(path as u8, now);
        }
    }

    fn cc_rx(&mut self, now: u64, kind: RxKind, rtt: Option<u64>, ce: bool) {
        if let Some(cc) = self.cc.as_mut() {
            let t = cc.traced();
            let wanted = match kind {
                RxKind::Timeout => t.timeout,
                _ => t.rx_ack,
            };
            if wanted {
                let mut out = CcOutput::default();
                cc.on_rx(
                    now,
                    &RxMeta {
                        kind,
                        bytes: wire::HDR as u32,
                        payload: 0,
                        ce,
                        rtt_ns: rtt,
                        host_delay_ns: None,
                        cc: &[],
                    },
                    &mut out,
                );
                self.apply(out);
            }
        }
    }

    /// Block `idx` of `io` is done; a write's packet still in flight for it (a resend) is
    /// retired. Returns false for a duplicate.
    fn block_done(&mut self, io: IoId, idx: u16) -> bool {
        let Some(s) = self.ios.get_mut(&io) else { return false };
        if s.done[idx as usize] {
            self.stats.duplicates += 1;
            return false;
        }
        s.done[idx as usize] = true;
        if let Some(a) = s.accepted.remove(&idx) {
            self.accept_order.remove(&(a.at, io, idx));
        }
        let carrier = s.at.remove(&idx);
        let write = s.kind == Kind::Write;
        if let (true, Some(c)) = (write, carrier) {
            self.unsend(c.path, c.psn, Outcome::Retired);
        }
        let Some(s) = self.ios.get_mut(&io) else { return false };
        s.left -= 1;
        if s.left == 0 {
            self.finish(io, Ok(()));
        }
        true
    }

    fn finish(&mut self, io: IoId, result: Result<(), IoError>) {
        let Some(s) = self.ios.remove(&io) else { return };
        self.by_rpc.remove(&(s.volume, s.rpc));
        // its packets still in flight no longer count
        for c in s.at.into_values() {
            self.unsend(c.path, c.psn, Outcome::Retired); // None for a unit already retired
        }
        self.events.push_back(ClientEvent::Done { io, result });
    }

    /// Handles a packet from the server. A checked READ_DATA block is returned for the driver
    /// to place; malformed packets are counted and dropped.
    pub fn on_packet<'a>(&mut self, now: u64, pkt: &'a [u8]) -> Result<Option<Placement<'a>>, WireError> {
        let (h, payload) = match Header::decode(pkt) {
            Ok(x) => x,
            Err(e) => {
                self.stats.malformed += 1;
                return Err(e);
            }
        };
        let path = h.path;
        self.last_now = self.last_now.max(now);
        if path as usize >= self.paths.len() {
            self.stats.malformed += 1;
            return Err(WireError::Index(path, self.paths.len() as u16));
        }
        match h.op {
            Op::ProbeAck => {
                if !self.paths.is_up(path as u8) {
                    self.stats.path_ups += 1;
                    tracing::debug!("solar: path {path} answered a probe: back in the rotation");
                }
                self.paths.on_probe_reply(path as u8, now);
                Ok(None)
            }
            Op::Challenge => {
                // the server asks this path's address to prove it receives: echo the nonce
                // (a few at a time; a server asks again if one is lost)
                if self.echoes.len() < MAX_ECHOES && !self.echoes.contains(&(path, h.rpc)) {
                    self.echoes.push_back((path, h.rpc));
                }
                Ok(None)
            }
            Op::WriteAck | Op::Nack => {
                let psn = self.seq_of(path, h.psn);
                let unit = self.unsend(path, psn, Outcome::Delivered);
                if unit.is_none() {
                    self.late_answer(now, path, psn);
                }
                let rtt = unit
                    .and_then(|(_, t)| t.once())
                    .filter(|&t| t == h.ts)
                    .map(|t| now.saturating_sub(t));
                if let Some(r) = rtt {
                    self.paths.on_rtt(path as u8, r, now);
                }
                // the congestion control sees the network's delay: the server's time on the
                // block (making it durable) is taken out
                let net_rtt = rtt.map(|r| r.saturating_sub(h.service_us as u64 * 1000).max(1));
                self.cc_rx(now, RxKind::Ack, net_rtt, h.flags & flags::ECN_ECHO != 0);
                self.fast_resend(path, psn);
                let Some(&io) = self.by_rpc.get(&(h.volume, h.rpc)) else {
                    self.stats.duplicates += 1;
                    return Ok(None);
                };
                let idx = h.blk_idx;
                if self.ios[&io].done.get(idx as usize).is_none() {
                    self.stats.malformed += 1;
                    return Err(WireError::Index(idx, self.ios[&io].blocks));
                }
                if h.status == Status::Ok as u16 {
                    let svc = h.service_us as u64 * 1000;
                    self.service_ns = (7 * self.service_ns + svc) / 8;
                }
                match Status::from_u16(h.status) {
                    Some(Status::Accepted) => {
                        // arrived; durable later. Its packet left the window above; from
                        // now on only a lost server (no `Ok` in time) makes it go again
                        let timeout = (self.rto(path) + 4 * self.service_ns).min(self.cfg.durable_timeout_ns);
                        let s = self.ios.get_mut(&io).expect("looked up above");
                        if !s.done[idx as usize] && s.at.get(&idx) == Some(&Carrier { path, psn }) {
                            s.at.remove(&idx);
                            let reordered = s.accepted.get(&idx).is_some_and(|a| a.reordered);
                            let a = Accepted {
                                at: now,
                                deadline: now + timeout,
                                reordered,
                            };
                            if let Some(old) = s.accepted.insert(idx, a) {
                                self.accept_order.remove(&(old.at, io, idx));
                            }
                            if !reordered {
                                self.accept_order.insert((now, io, idx));
                            }
                        }
                    }
                    Some(Status::Ok) => {
                        let at = self.ios[&io].accepted.get(&idx).map(|a| a.at);
                        if self.block_done(io, idx) {
                            if let Some(at) = at {
                                self.oks_overtaken(now, at);
                            }
                        }
                    }
                    Some(Status::Stale) => {
                        // a newer write to the block is already there: nothing to resend
                        self.stats.stale_acks += 1;
                        self.block_done(io, idx);
                    }
                    Some(s) if s.retryable() => {
                        if s == Status::CrcError {
                            self.stats.crc_errors += 1;
                        }
                        self.resend_or_fail(io, idx, s);
                    }
                    Some(s) => self.finish(io, Err(IoError::Status(s, idx))),
                    None => self.finish(io, Err(IoError::Status(Status::IoError, idx))),
                }
                Ok(None)
            }
            Op::ReadData => {
                let psn = self.seq_of(path, h.psn);
                if self.in_flight(path, psn).is_none() {
                    self.late_answer(now, path, psn);
                }
                let Some(&io) = self.by_rpc.get(&(h.volume, h.rpc)) else {
                    self.stats.duplicates += 1;
                    return Ok(None);
                };
                let s = &self.ios[&io];
                let idx = h.blk_idx;
                if s.kind != Kind::Read || idx >= s.blocks || h.lba != s.lba + idx as u64 {
                    self.stats.malformed += 1;
                    return Err(WireError::Index(idx, s.blocks));
                }
                // the READ_REQ it answers (the header echoes its path and psn); a duplicate, or
                // a block another request already brought, changes nothing there
                let fresh = !s.done[idx as usize] && s.at.get(&idx) == Some(&Carrier { path, psn });
                let unit = self
                    .in_flight(path, psn)
                    .map(|s| (s.data, s.time))
                    .filter(|(u, _)| fresh && u.io == io && u.idx <= idx && idx < u.idx + u.n);
                if let Some((u, time)) = unit {
                    if let Some(t) = time.once().filter(|&t| u.left == u.n && t == h.ts) {
                        let rtt = now.saturating_sub(t);
                        self.paths.on_rtt(path as u8, rtt, now);
                        self.cc_rx(now, RxKind::Ack, Some(rtt), h.flags & flags::ECN_ECHO != 0);
                    }
                    self.inflight_bytes = self.inflight_bytes.saturating_sub(BLOCK as u64);
                    let e = self.ledgers[path as usize].sent.get_mut(psn).expect("found above");
                    e.data.left -= 1;
                    if e.data.left == 0 {
                        // nothing left of it counts in flight
                        self.unsend(path, psn, Outcome::Delivered);
                        self.fast_resend(path, psn);
                    }
                }
                if h.status != Status::Ok as u16 {
                    let st = Status::from_u16(h.status).unwrap_or(Status::IoError);
                    if st.retryable() {
                        self.resend_or_fail(io, idx, st);
                    } else {
                        self.finish(io, Err(IoError::Status(st, idx)));
                    }
                    return Ok(None);
                }
                if wire::block_crc(payload) != h.crc {
                    self.stats.crc_errors += 1;
                    if !self.ios[&io].done[idx as usize] {
                        self.resend_or_fail(io, idx, Status::CrcError);
                    }
                    return Ok(None);
                }
                if self.block_done(io, idx) {
                    return Ok(Some(Placement { io, idx, data: payload }));
                }
                Ok(None)
            }
            Op::Write | Op::ReadReq | Op::Probe | Op::ChallengeReply => {
                self.stats.malformed += 1;
                Err(WireError::Opcode(h.op as u8))
            }
        }
    }

    /// Packets of `path` sent three or more before `psn` and still unanswered are lost (a path
    /// keeps order): resend their blocks.
    fn fast_resend(&mut self, path: u16, psn: u64) {
        let Some(l) = self.ledgers.get(path as usize) else {
            return;
        };
        let lost: Vec<u64> = l
            .sent
            .in_flight()
            .take_while(|&(p, _)| p < psn.saturating_sub(2))
            .map(|(p, _)| p)
            .collect();
        for p in lost {
            if let Some((u, _)) = self.unsend(path, p, Outcome::Lost) {
                self.stats.fast_resends += 1;
                self.requeue(u, path);
            }
        }
    }

    /// Queues a lost unit's unfinished blocks again, one per packet (a READ_REQ per missing
    /// block), away from `path`.
    fn requeue(&mut self, u: Unit, path: u16) {
        let Some(s) = self.ios.get_mut(&u.io) else { return };
        for i in (u.idx..u.idx + u.n).rev() {
            if !s.done[i as usize] {
                s.at.remove(&i);
                self.queue.push_front(Queued::resend(u.io, i, Some(path)));
            }
        }
    }

    /// Block `idx` must be sent again (the server answered a retryable status, or its data
    /// failed the CRC): queued alone, unless it has used up its attempts.
    fn resend_or_fail(&mut self, io: IoId, idx: u16, why: Status) {
        let Some(s) = self.ios.get_mut(&io) else { return };
        s.attempts[idx as usize] += 1;
        let a = s.attempts[idx as usize];
        let avoid = s.at.remove(&idx).map(|c| c.path);
        if a >= self.cfg.max_block_attempts {
            let e = if why == Status::CrcError {
                IoError::Crc(idx, a)
            } else {
                IoError::Status(why, idx)
            };
            self.finish(io, Err(e));
        } else {
            self.queue.push_front(Queued::resend(io, idx, avoid));
        }
    }

    /// The `Ok` of a block accepted at `at` came: a block accepted well before it that is
    /// still waiting lost its `Ok` (or the server lost the block) and is sent again now rather
    /// than at its deadline. The server makes writes durable in about the order it accepts
    /// them (its writers share group commits), and an `Accepted` and the `Ok` after it cross
    /// the same path, so "well before" is one smoothed service time plus half the least RTO
    /// (blocks of one group commit, answered in any order, and the paths' jitter). A block
    /// sent again that is still being applied is answered `Accepted` once more; its deadline
    /// starts again from now.
    fn oks_overtaken(&mut self, now: u64, at: u64) {
        let margin = self.service_ns + self.cfg.min_rto_ns / 2 + self.paths.host_delay();
        let Some(before) = at.checked_sub(margin) else { return };
        while let Some(&(t, io, idx)) = self.accept_order.first() {
            if t >= before {
                break;
            }
            self.accept_order.pop_first();
            let Some(s) = self.ios.get_mut(&io) else { continue };
            if let Some(a) = s.accepted.get_mut(&idx).filter(|a| a.at == t) {
                a.deadline = now + (a.deadline - a.at);
                a.reordered = true;
                self.stats.durable_resends += 1;
                self.stats.durable_resends_by_order += 1;
                self.queue.push_front(Queued::resend(io, idx, None));
            }
        }
    }

    /// The earliest time [`Self::on_timer`] has work.
    pub fn next_timeout(&self) -> Option<u64> {
        let rto = self
            .ledgers
            .iter()
            .flat_map(|p| p.sent.in_flight().map(|(_, s)| s.data.deadline))
            .min();
        // a path's health deadline already passed stays unchanged until another path
        // delivers: looked at again one minimum RTO after the timers last ran, not in a spin
        // (counted from the last packet instead, it never came while packets kept flowing:
        // a down path went unprobed under load)
        let paths = self
            .paths
            .next_deadline()
            .map(|t| t.max(self.last_timer + self.cfg.min_rto_ns.max(1)));
        let io = self
            .ios
            .values()
            .flat_map(|s| s.accepted.values().map(|a| a.deadline).chain([s.deadline]))
            .min();
        let pace = (self.next_send_at > self.last_now && !self.queue.is_empty()).then_some(self.next_send_at);
        [rto, paths, io, self.cc_timer, pace].into_iter().flatten().min()
    }

    /// Timers: per-packet RTOs (resend elsewhere), path health (a path that stopped
    /// delivering leaves the rotation; probes of down paths), congestion control's timer,
    /// request timeouts.
    pub fn on_timer(&mut self, now: u64) {
        self.last_now = self.last_now.max(now);
        self.last_timer = self.last_timer.max(now);
        if self.cc_timer.is_some_and(|t| t <= now) {
            self.cc_timer = None;
            if let Some(cc) = self.cc.as_mut() {
                let mut out = CcOutput::default();
                cc.on_timer(now, &mut out);
                self.apply(out);
            }
        }
        let mut timeouts = 0;
        for i in 0..self.ledgers.len() {
            let expired: Vec<u64> = self.ledgers[i]
                .sent
                .in_flight()
                .filter(|(_, s)| s.data.deadline <= now)
                .map(|(p, _)| p)
                .collect();
            if expired.is_empty() {
                continue;
            }
            timeouts += expired.len();
            self.ledgers[i].backoff += 1;
            // a timeout on the path's current source port: it may hash onto a cut link
            let sent = expired
                .iter()
                .filter_map(|&p| self.ledgers[i].sent.get(p).and_then(|s| s.time.last()))
                .max();
            if let Some(t) = sent {
                self.paths.on_timeout(i as u8, t, now);
            }
            for psn in expired {
                if let Some((u, _)) = self.unsend(i as u16, psn, Outcome::Lost) {
                    self.requeue(u, i as u16);
                }
            }
        }
        if timeouts > 0 {
            self.stats.timeouts += timeouts as u64;
            // the congestion control hears of a timeout only when nothing was delivered since
            // the last one: packets that expire while others keep arriving were lost (random
            // loss, a cut path the detector takes out), not queued, and the delay signal
            // speaks for the queues. Feeding each expiry made Swift reset its window to the
            // minimum at 5 % loss and pace one block per ~100 RTTs: stalls of 100-200 ms.
            if self.paths.last_delivery() <= self.last_timeout {
                self.cc_rx(now, RxKind::Timeout, None, false);
            }
            self.last_timeout = now;
        }
        // what a path that went down had in flight is lost
        for i in self.paths.check(now) {
            self.stats.path_downs += 1;
            tracing::debug!(
                "solar: path {i} delivered nothing for {} RTOs: out of the rotation",
                self.cfg.down_after
            );
            let gone: Vec<u64> = self.ledgers[i as usize].sent.in_flight().map(|(p, _)| p).collect();
            for psn in gone {
                if let Some((u, _)) = self.unsend(i as u16, psn, Outcome::Lost) {
                    self.requeue(u, i as u16);
                }
            }
        }
        while let Some(i) = self.paths.probe_due(now) {
            if !self.probes.contains(&(i as u16)) {
                self.probes.push_back(i as u16);
            }
        }
        // accepted write blocks that never became durable: sent again
        let mut again = Vec::new();
        for (&io, s) in self.ios.iter_mut() {
            s.accepted.retain(|&idx, a| {
                if a.deadline <= now {
                    again.push((io, idx, a.at));
                }
                a.deadline > now
            });
        }
        for (io, idx, at) in again {
            self.accept_order.remove(&(at, io, idx));
            self.stats.durable_resends += 1;
            self.queue.push_front(Queued::resend(io, idx, None));
        }
        let late: Vec<IoId> = self
            .ios
            .iter()
            .filter(|(_, s)| s.deadline <= now)
            .map(|(&i, _)| i)
            .collect();
        for io in late {
            let left = self.ios[&io].left;
            let up = self.paths_up();
            self.finish(
                io,
                Err(IoError::TimedOut {
                    blocks_left: left,
                    paths_up: up,
                }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::solar::server::{Request, SolarServer, Token};

    /// The wire carries a PSN's low 32 bits: answers to packets whose PSNs cross 2^32 on every
    /// path are matched to their packets (each block sent once, no timeout).
    #[test]
    fn answers_are_matched_to_their_packets_across_the_32_bit_psn_wrap() {
        let cfg = ClientConfig {
            paths: 2,
            ..Default::default()
        };
        let mut c = SolarClient::new(cfg, None, 1_000);
        for l in &mut c.ledgers {
            l.sent = SentLedger::new(u32::MAX as u64 - 3);
        }
        let mut s = SolarServer::new();
        let mut now = 1_000;
        for k in 0..16u64 {
            c.write(now, 1, k, Arc::from(vec![k as u8; BLOCK]), false).unwrap();
        }
        let mut done = 0;
        for _ in 0..1_000 {
            now += 1_000;
            while let Some(t) = c.poll_transmit(now) {
                if let Ok(Some(Request::Write { token, .. })) = s.on_packet(0, &t.to_vec(), false) {
                    s.write_done(token, Status::Ok);
                }
            }
            while let Some(t) = s.poll_transmit() {
                c.on_packet(now, &t.to_vec()).unwrap();
            }
            c.on_timer(now);
            while let Some(ClientEvent::Done { result, .. }) = c.poll_event() {
                result.unwrap();
                done += 1;
            }
            if done == 16 {
                break;
            }
        }
        assert_eq!(done, 16);
        let st = c.stats();
        assert_eq!((st.blocks_sent, st.blocks_resent, st.timeouts), (16, 0, 0));
        assert!(
            c.ledgers.iter().all(|l| l.sent.end() > u32::MAX as u64 + 1),
            "every path's PSNs went past 2^32"
        );
        assert!(c.ledgers.iter().all(|l| l.sent.is_empty()), "nothing left in flight");
    }

    /// A driver that runs the timers only when [`SolarClient::next_timeout`] says (the engine's
    /// data core) probes a down path while the other path carries a steady load: the path's
    /// probe deadline comes due although packets flow all the time.
    #[test]
    fn a_down_path_is_probed_under_load_by_a_driver_that_runs_timers_when_due() {
        let cfg = ClientConfig {
            paths: 2,
            burst_blocks: 1,
            ..Default::default()
        };
        let mut c = SolarClient::new(cfg, None, 1_000);
        let mut s = SolarServer::new();
        let mut now = 1_000u64;
        let mut lba = 0u64;
        // 200 ms, a step every 10 us: path 1's packets vanish, path 0's are answered
        for _ in 0..20_000 {
            now += 10_000;
            while c.outstanding() < 8 {
                c.write(now, 1, lba % 64, Arc::from(vec![1u8; BLOCK]), false).unwrap();
                lba += 1;
            }
            while let Some(t) = c.poll_transmit(now) {
                if t.path == 1 {
                    continue;
                }
                if let Ok(Some(Request::Write { token, .. })) = s.on_packet(0, &t.to_vec(), false) {
                    s.write_done(token, Status::Ok);
                }
            }
            while let Some(t) = s.poll_transmit() {
                c.on_packet(now, &t.to_vec()).unwrap();
            }
            if c.next_timeout().is_some_and(|t| t <= now) {
                c.on_timer(now);
            }
            while c.poll_event().is_some() {}
        }
        let p = &c.path_stats()[1];
        assert!(!p.up, "the silent path went down: {p:?}");
        // down for ~190 ms with a 10 ms probe interval
        assert!(p.probes_sent >= 10, "the down path was probed: {p:?}");
    }

    /// A server whose host answers late (its threads wait for a core) is not a lossy fabric
    /// once the client knows how late hosts are: quiet for 2 ms (answers in 20 us, the RTO at
    /// its 1 ms floor), then every answer takes 6 ms. Told a host delay of 8 ms, the client
    /// sends each block once; told nothing, it times out blocks that were never lost.
    #[test]
    fn a_late_host_is_no_lost_packet_once_the_client_knows_its_delay() {
        let run = |host_delay: u64| {
            let cfg = ClientConfig {
                paths: 2,
                ..Default::default()
            };
            let mut c = SolarClient::new(cfg, None, 1_000);
            c.set_host_delay(host_delay);
            let mut s = SolarServer::new();
            let mut wire: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
            let (mut now, mut done, mut written) = (1_000u64, 0, 0u64);
            while done < 64 && now < 1_000_000_000 {
                now += 10_000;
                // 32 blocks while the host is quiet, 32 once it is late
                let due = if now < 2_000_000 { 32 } else { 64 };
                while written < due {
                    c.write(now, 1, written, Arc::from(vec![written as u8; BLOCK]), false)
                        .unwrap();
                    written += 1;
                }
                while let Some(t) = c.poll_transmit(now) {
                    if let Ok(Some(Request::Write { token, .. })) = s.on_packet(0, &t.to_vec(), false) {
                        s.write_done(token, Status::Ok);
                    }
                }
                let lag = if now < 2_000_000 { 20_000 } else { 6_000_000 };
                while let Some(t) = s.poll_transmit() {
                    wire.push_back((now + lag, t.to_vec()));
                }
                while wire.front().is_some_and(|(t, _)| *t <= now) {
                    let (_, p) = wire.pop_front().unwrap();
                    c.on_packet(now, &p).unwrap();
                }
                c.on_timer(now);
                while let Some(ClientEvent::Done { result, .. }) = c.poll_event() {
                    result.unwrap();
                    done += 1;
                }
            }
            assert_eq!(done, 64, "every write completes");
            c.stats()
        };
        let told = run(8_000_000);
        assert_eq!(
            (told.blocks_sent, told.blocks_resent, told.timeouts),
            (64, 0, 0),
            "{told:?}"
        );
        let untold = run(0);
        assert!(
            untold.timeouts > 0,
            "the late answers time out without the host delay: {untold:?}"
        );
    }

    /// Sends the client's next packet to the server; returns the token of the write the
    /// server hands its driver (None for a duplicate it answers itself).
    fn deliver_write(c: &mut SolarClient, s: &mut SolarServer, now: u64) -> Option<Token> {
        let t = c.poll_transmit(now).expect("a packet to send");
        match s.on_packet(0, &t.to_vec(), false).unwrap() {
            Some(Request::Write { token, .. }) => Some(token),
            None => None,
            Some(other) => panic!("{other:?}"),
        }
    }

    /// The server's answers reach the client (`keep` false: they are lost).
    fn answers(c: &mut SolarClient, s: &mut SolarServer, now: u64, keep: bool) {
        while let Some(t) = s.poll_transmit() {
            if keep {
                c.on_packet(now, &t.to_vec()).unwrap();
            }
        }
    }

    /// The `Ok` of a block accepted well after another comes first: the other's `Ok` was lost,
    /// and that block goes again at once, not at its deadline (no timer runs here); the
    /// server answers the duplicate `Ok`. A block the disk is only slow with goes again once,
    /// however many later `Ok`s overtake it.
    #[test]
    fn a_lost_ok_is_asked_again_when_a_later_blocks_ok_overtakes_it() {
        let cfg = ClientConfig {
            paths: 1,
            ..Default::default()
        };
        let mut c = SolarClient::new(cfg, None, 1_000);
        let mut s = SolarServer::new();
        let block = |b: u8| Arc::from(vec![b; BLOCK]);
        let mut now = 1_000_000;
        let a = c.write(now, 1, 1, block(1), false).unwrap();
        let ta = deliver_write(&mut c, &mut s, now).unwrap();
        // Accepted
        answers(&mut c, &mut s, now, true);
        // past the margin (half the least RTO, the server's service time being 0 here)
        now += 2_000_000;
        let b = c.write(now, 1, 2, block(2), false).unwrap();
        let tb = deliver_write(&mut c, &mut s, now).unwrap();
        answers(&mut c, &mut s, now, true);
        s.write_done(ta, Status::Ok);
        answers(&mut c, &mut s, now, false); // a's Ok is lost
        s.write_done(tb, Status::Ok);
        answers(&mut c, &mut s, now, true);
        assert_eq!(c.poll_event(), Some(ClientEvent::Done { io: b, result: Ok(()) }));
        assert_eq!(c.stats().durable_resends_by_order, 1);
        // a goes again now, and the server says again that it is durable
        assert_eq!(
            deliver_write(&mut c, &mut s, now),
            None,
            "a duplicate, not applied twice"
        );
        answers(&mut c, &mut s, now, true);
        assert_eq!(c.poll_event(), Some(ClientEvent::Done { io: a, result: Ok(()) }));
        assert!(c.accept_order.is_empty());

        // the disk is slow with block 10: the Oks of 11 and 12, accepted later, come first
        now += 2_000_000;
        let slow = c.write(now, 1, 10, block(10), false).unwrap();
        let t10 = deliver_write(&mut c, &mut s, now).unwrap();
        answers(&mut c, &mut s, now, true);
        for lba in [11, 12] {
            now += 2_000_000;
            let io = c.write(now, 1, lba, block(lba as u8), false).unwrap();
            let t = deliver_write(&mut c, &mut s, now).unwrap();
            s.write_done(t, Status::Ok);
            answers(&mut c, &mut s, now, true);
            assert_eq!(c.poll_event(), Some(ClientEvent::Done { io, result: Ok(()) }));
            if lba == 11 {
                // 10 goes again; the server is still applying it and says so
                assert_eq!(deliver_write(&mut c, &mut s, now), None);
                answers(&mut c, &mut s, now, true);
            }
            assert!(c.poll_transmit(now).is_none(), "10 goes again once, after 11's Ok only");
        }
        assert_eq!(c.stats().durable_resends_by_order, 2);
        s.write_done(t10, Status::Ok);
        answers(&mut c, &mut s, now, true);
        assert_eq!(
            c.poll_event(),
            Some(ClientEvent::Done {
                io: slow,
                result: Ok(())
            })
        );
        assert_eq!(s.stats().writes, 5, "every block applied once");
    }
}
