//! The storage server's side of Solar: checks each block's CRC, drops stale and duplicate
//! writes, hands writes and reads to the driver (which owns the storage) and answers each block
//! on its own once the driver says it is durable or read.
//!
//! Write ordering: request ids increase per volume (the agent's), so a WRITE with an id below
//! the newest this server took for that block is an old retransmission that lost a race on
//! another path: it is dropped and answered `Stale`. The same id again is a duplicate: answered
//! `Ok` when it was applied, ignored while it is being applied.
//!
//! Fencing: a volume may be fenced at an epoch ([`SolarServer::fence`]); its WRITEs and
//! READ_REQs of a lower epoch are answered `WrongEpoch` before anything else looks at them, so
//! a writer whose attachment moved to another agent touches neither the blocks nor the
//! write ordering state.
//!
//! Address validation ([`SolarServer::require_validation`], see [`super::validation`]): a
//! server whose driver asks for it answers an address in full only once the agent there echoed
//! a challenge sent to it; until then it sends there at most three times what it received.

use super::validation::{Gate, NonceSource, ValidationConfig};
use super::wire::{self, flags, Header, Op, Status, WireError, BLOCK};
use super::{BlockRef, Transmit};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// A token the driver answers a [`Request`] with.
pub type Token = u64;

/// What the driver must do.
#[derive(Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// Make this block durable, then call [`SolarServer::write_done`].
    Write {
        /// What to answer it with.
        token: Token,
        /// The volume written.
        volume: u32,
        /// The block (the first, when `zero`).
        lba: u64,
        /// Empty when `zero`.
        data: &'a [u8],
        /// The block's CRC32C (checked against `data` already): store it beside the block.
        crc: u32,
        /// The agent asked for force unit access (every write is durable when answered).
        fua: bool,
        /// Zeros, to be deallocated (a WRITE with the ZERO flag), over `count` blocks from
        /// `lba`.
        zero: bool,
        /// Blocks: 1, or up to [`wire::MAX_ZERO_BLOCKS`] when `zero`.
        count: u32,
        /// The write's request id: the block's version (store it, and after a restart hand it
        /// back through [`SolarServer::note_version`]).
        rpc: u64,
    },
    /// Read `count` blocks from `lba` and answer each with [`SolarServer::read_block`] (or
    /// [`SolarServer::read_failed`]).
    Read {
        /// What to answer it with.
        token: Token,
        /// The volume read.
        volume: u32,
        /// The first block.
        lba: u64,
        /// Blocks to read.
        count: u16,
    },
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Write blocks handed to the driver.
    pub writes: u64,
    /// Blocks read.
    pub reads: u64,
    /// Write blocks whose data did not match their CRC (answered CRC_ERROR).
    pub crc_errors: u64,
    /// Writes older than the newest one taken for their block (answered `Stale`).
    pub stale_dropped: u64,
    /// Writes seen again (answered, not applied again).
    pub duplicates: u64,
    /// Packets dropped as malformed.
    pub malformed: u64,
    /// Requests refused because their volume is fenced at a higher epoch.
    pub wrong_epoch: u64,
    /// Challenges sent to addresses not validated yet.
    pub challenges_sent: u64,
    /// Addresses validated by the echo of their challenge.
    pub peers_validated: u64,
    /// Challenge replies with a nonce that is not the one sent to their address (or from an
    /// address that was sent none).
    pub bad_challenge_replies: u64,
    /// Answers that waited for an address's allowance or validation, and their bytes.
    pub held_packets: u64,
    /// Bytes of [`Self::held_packets`].
    pub held_bytes: u64,
    /// Answers to addresses not validated dropped (past the bounds on what may wait, or their
    /// address given up), and their bytes.
    pub dropped_unvalidated: u64,
    /// Bytes of [`Self::dropped_unvalidated`].
    pub dropped_unvalidated_bytes: u64,
    /// READ_REQs from an address not validated not served because none of their blocks could
    /// go or wait (what may wait for the address is full).
    pub unserved_reads: u64,
    /// Requests from a new address refused because too many addresses await validation.
    pub refused_peers: u64,
    /// Addresses awaiting validation given up to make room for a new one.
    pub evicted_peers: u64,
}

struct PendingWrite {
    reply: Header,
    peer: u64,
    volume: u32,
    lba: u64,
    rpc: u64,
}

struct PendingRead {
    reply: Header,
    peer: u64,
    first_idx: u16,
    lba: u64,
    count: u16,
}

/// The server side of one storage server.
pub struct SolarServer {
    /// The lowest epoch each fenced volume accepts.
    fences: HashMap<u32, u32>,
    /// Newest request id taken per (volume, block).
    newest: HashMap<(u32, u64), u64>,
    /// Applied request ids per (volume, block) (for answering duplicates).
    applied: HashMap<(u32, u64), u64>,
    /// Writes being made durable, by (volume, request id, block index).
    in_progress: HashMap<(u32, u64, u16), Token>,
    writes: HashMap<Token, PendingWrite>,
    reads: HashMap<Token, PendingRead>,
    next_token: Token,
    out: VecDeque<Transmit>,
    stats: ServerStats,
    /// Address validation (None: every address is trusted).
    gate: Option<Gate>,
    /// The latest time the driver handed in.
    now: u64,
}

impl Default for SolarServer {
    fn default() -> Self {
        Self::new()
    }
}

impl SolarServer {
    /// A server with no volume fenced.
    pub fn new() -> SolarServer {
        SolarServer {
            fences: HashMap::new(),
            newest: HashMap::new(),
            applied: HashMap::new(),
            in_progress: HashMap::new(),
            writes: HashMap::new(),
            reads: HashMap::new(),
            next_token: 1,
            out: VecDeque::new(),
            stats: ServerStats::default(),
            gate: None,
            now: 0,
        }
    }

    /// Serves each address in full only once the agent there has proven it receives there
    /// (see [`super::validation`]); `nonces` gives an unpredictable 64-bit nonce per address
    /// (the driver's randomness). A server without this call trusts every source address (the
    /// simulator, tests). Refuses a config with a zero bound, naming the field.
    pub fn require_validation(&mut self, cfg: ValidationConfig, nonces: NonceSource) -> Result<(), String> {
        cfg.check()?;
        self.gate = Some(Gate::new(cfg, nonces));
        Ok(())
    }

    /// Whether the server validates addresses.
    pub fn validating(&self) -> bool {
        self.gate.is_some()
    }

    /// Addresses validated, and awaiting validation, now ((0, 0) without validation).
    pub fn validation_sizes(&self) -> (usize, usize) {
        self.gate.as_ref().map_or((0, 0), |g| g.sizes())
    }

    /// Bytes of answers waiting for their address's validation now.
    pub fn held_bytes(&self) -> u64 {
        self.gate.as_ref().map_or(0, |g| g.held_bytes())
    }

    /// The counters.
    pub fn stats(&self) -> ServerStats {
        self.stats
    }

    /// Refuses requests to `volume` of an epoch below `epoch` from now on (a fence only
    /// rises: a lower `epoch` changes nothing). Returns the fence in effect.
    pub fn fence(&mut self, volume: u32, epoch: u32) -> u32 {
        let f = self.fences.entry(volume).or_insert(epoch);
        *f = (*f).max(epoch);
        *f
    }

    /// Seeds the newest request id of a block (from the store after a restart), so stale
    /// retransmissions from before the restart are still dropped.
    pub fn note_version(&mut self, volume: u32, lba: u64, rpc: u64) {
        let e = self.newest.entry((volume, lba)).or_insert(rpc);
        *e = (*e).max(rpc);
        let a = self.applied.entry((volume, lba)).or_insert(rpc);
        *a = (*a).max(rpc);
    }

    fn answer(&mut self, peer: u64, h: &Header, op: Op, status: Status) {
        let mut r = *h;
        r.op = op;
        r.status = status as u16;
        r.flags &= flags::ECN_ECHO | flags::RETX;
        r.crc = 0;
        if op == Op::Nack || op == Op::WriteAck {
            r.blk_cnt = r.blk_cnt.max(r.blk_idx + 1);
        }
        self.push(peer, &r, None);
    }

    fn push(&mut self, peer: u64, h: &Header, block: Option<BlockRef>) {
        let mut header = [0u8; wire::HDR];
        h.encode(&mut header);
        let t = Transmit {
            path: h.path,
            port: 0,
            peer,
            header,
            block,
        };
        match &mut self.gate {
            Some(g) => g.send(t, &mut self.out, &mut self.stats),
            None => self.out.push_back(t),
        }
    }

    /// [`Self::on_packet_at`] at the latest time the driver handed in (for a server without
    /// validation, which needs no clock).
    pub fn on_packet<'a>(&mut self, peer: u64, pkt: &'a [u8], ce: bool) -> Result<Option<Request<'a>>, WireError> {
        self.on_packet_at(self.now, peer, pkt, ce)
    }

    /// Handles a packet from `peer` (the driver's token for the agent's address) at `now`
    /// (ns, the driver's clock). Returns what the driver must do, if anything; malformed
    /// packets are counted and dropped. `ce` says the packet arrived ECN-marked (echoed to the
    /// sender's congestion control). With validation, a request from an address not validated
    /// yet draws a challenge and its answers wait for the echo beyond three times its bytes.
    pub fn on_packet_at<'a>(
        &mut self,
        now: u64,
        peer: u64,
        pkt: &'a [u8],
        ce: bool,
    ) -> Result<Option<Request<'a>>, WireError> {
        self.now = self.now.max(now);
        let now = self.now;
        let (mut h, payload) = match Header::decode(pkt) {
            Ok(x) => x,
            Err(e) => {
                self.stats.malformed += 1;
                return Err(e);
            }
        };
        if h.op == Op::ChallengeReply {
            match &mut self.gate {
                Some(g) => g.on_reply(now, peer, h.rpc, &mut self.out, &mut self.stats),
                None => self.stats.bad_challenge_replies += 1,
            }
            return Ok(None);
        }
        if let (Some(g), Op::Write | Op::ReadReq | Op::Probe) = (&mut self.gate, h.op) {
            if !g.on_request(now, peer, pkt.len(), &h, &mut self.out, &mut self.stats) {
                return Ok(None);
            }
        }
        if ce {
            h.flags |= flags::ECN_ECHO;
        }
        let fenced =
            matches!(h.op, Op::Write | Op::ReadReq) && self.fences.get(&h.volume).is_some_and(|&f| h.epoch < f);
        if fenced {
            self.stats.wrong_epoch += 1;
            let op = if h.op == Op::ReadReq { Op::Nack } else { Op::WriteAck };
            self.answer(peer, &h, op, Status::WrongEpoch);
            return Ok(None);
        }
        match h.op {
            Op::Probe => {
                self.answer(peer, &h, Op::ProbeAck, Status::Ok);
                Ok(None)
            }
            Op::Write => {
                let zero = h.flags & flags::ZERO != 0;
                if !zero && wire::block_crc(payload) != h.crc {
                    self.stats.crc_errors += 1;
                    self.answer(peer, &h, Op::WriteAck, Status::CrcError);
                    return Ok(None);
                }
                let count = if zero { h.count.max(1) } else { 1 };
                if h.lba.checked_add(count as u64).is_none() {
                    self.stats.malformed += 1;
                    return Err(WireError::Count(h.count));
                }
                let key = (h.volume, h.lba);
                // a zero run is stale when a newer write reached any of its blocks (the agent
                // holds the range until every replica answered, so that only happens to a
                // copy given up on, whose range the agent rewrites anyway)
                let newest = (0..count as u64)
                    .filter_map(|b| self.newest.get(&(h.volume, h.lba + b)).copied())
                    .max()
                    .unwrap_or(0);
                if h.rpc < newest {
                    self.stats.stale_dropped += 1;
                    self.answer(peer, &h, Op::WriteAck, Status::Stale);
                    return Ok(None);
                }
                if h.rpc == newest {
                    if self.applied.get(&key) == Some(&h.rpc) {
                        self.stats.duplicates += 1;
                        self.answer(peer, &h, Op::WriteAck, Status::Ok);
                        return Ok(None);
                    }
                    if self.in_progress.contains_key(&(h.volume, h.rpc, h.blk_idx)) {
                        self.stats.duplicates += 1;
                        // its `Ok` comes when it is durable; say again that it arrived
                        self.answer(peer, &h, Op::WriteAck, Status::Accepted);
                        return Ok(None);
                    }
                }
                for b in 0..count as u64 {
                    self.newest.insert((h.volume, h.lba + b), h.rpc);
                }
                let token = self.next_token;
                self.next_token += 1;
                self.in_progress.insert((h.volume, h.rpc, h.blk_idx), token);
                self.writes.insert(
                    token,
                    PendingWrite {
                        reply: h,
                        peer,
                        volume: h.volume,
                        lba: h.lba,
                        rpc: h.rpc,
                    },
                );
                self.stats.writes += 1;
                self.answer(peer, &h, Op::WriteAck, Status::Accepted);
                Ok(Some(Request::Write {
                    token,
                    volume: h.volume,
                    lba: h.lba,
                    data: payload,
                    crc: h.crc,
                    fua: h.flags & flags::FUA != 0,
                    zero,
                    count,
                    rpc: h.rpc,
                }))
            }
            Op::ReadReq => {
                let count = h.blk_cnt.saturating_sub(h.blk_idx);
                if count == 0 || h.lba.checked_add(count as u64).is_none() {
                    self.stats.malformed += 1;
                    return Err(WireError::Index(h.blk_idx, h.blk_cnt));
                }
                let token = self.next_token;
                self.next_token += 1;
                self.reads.insert(
                    token,
                    PendingRead {
                        reply: h,
                        peer,
                        first_idx: h.blk_idx,
                        lba: h.lba,
                        count,
                    },
                );
                self.stats.reads += count as u64;
                Ok(Some(Request::Read {
                    token,
                    volume: h.volume,
                    lba: h.lba,
                    count,
                }))
            }
            Op::WriteAck | Op::ReadData | Op::Nack | Op::ProbeAck | Op::Challenge | Op::ChallengeReply => {
                self.stats.malformed += 1;
                Err(WireError::Opcode(h.op as u8))
            }
        }
    }

    /// The driver finished a write: `Ok` once the block is durable.
    pub fn write_done(&mut self, token: Token, status: Status) {
        self.write_done_after(token, status, 0);
    }

    /// [`Self::write_done`], saying how long the block waited and took to become durable
    /// (echoed to the agent, whose congestion control leaves it out of the network delay).
    pub fn write_done_after(&mut self, token: Token, status: Status, service_ns: u64) {
        let Some(mut w) = self.writes.remove(&token) else {
            return;
        };
        w.reply.service_us = (service_ns / 1000).min(u32::MAX as u64) as u32;
        self.in_progress.remove(&(w.volume, w.rpc, w.reply.blk_idx));
        if status == Status::Ok {
            let a = self.applied.entry((w.volume, w.lba)).or_insert(w.rpc);
            *a = (*a).max(w.rpc);
        }
        self.answer(w.peer, &w.reply, Op::WriteAck, status);
    }

    /// Block `k` (0-based within the read) with the CRC stored beside it, so the agent checks
    /// it end to end (disk, memory, wire). `data` holds it at `off`.
    pub fn read_block(&mut self, token: Token, k: u16, data: Arc<[u8]>, off: usize, stored_crc: u32) {
        let Some(r) = self.reads.get(&token) else { return };
        if k >= r.count || off + BLOCK > data.len() {
            return;
        }
        let mut h = r.reply;
        h.op = Op::ReadData;
        h.status = Status::Ok as u16;
        h.blk_idx = r.first_idx + k;
        h.blk_cnt = r.first_idx + r.count;
        h.lba = r.lba + k as u64;
        h.crc = stored_crc;
        h.flags &= flags::ECN_ECHO | flags::RETX;
        if k + 1 == r.count {
            h.flags |= flags::LAST;
        }
        let peer = r.peer;
        self.push(peer, &h, Some(BlockRef { data, off }));
    }

    /// Block `k` of a read could not be read (I/O error, a stored CRC mismatch): answered with
    /// `status` instead of data.
    pub fn read_failed(&mut self, token: Token, k: u16, status: Status) {
        let Some(r) = self.reads.get(&token) else { return };
        let mut h = r.reply;
        h.op = Op::ReadData;
        h.status = status as u16;
        h.blk_idx = r.first_idx + k;
        h.blk_cnt = r.first_idx + r.count;
        h.lba = r.lba + k as u64;
        let peer = r.peer;
        // a failed block travels as a READ_DATA with a zero block (one layout for both)
        static ZERO: std::sync::OnceLock<Arc<[u8]>> = std::sync::OnceLock::new();
        let zero = ZERO.get_or_init(|| Arc::from(vec![0u8; BLOCK]));
        h.crc = wire::block_crc(zero);
        self.push(
            peer,
            &h,
            Some(BlockRef {
                data: zero.clone(),
                off: 0,
            }),
        );
    }

    /// The driver answered every block of a read.
    pub fn read_finished(&mut self, token: Token) {
        self.reads.remove(&token);
    }

    /// The next packet to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out.pop_front()
    }
}
