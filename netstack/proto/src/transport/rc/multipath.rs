//! The RC QP's side of multipath ([`crate::path`]): choosing the paths, taking a path that went
//! silent out of the rotation (its packets are resent on the others), and probing it with
//! PROBE packets the peer's QP answers with PROBE_REPLY until it works again.

use super::{QpState, RcQp, Recovery};
use crate::memory::SharedRegion;
use crate::path::{PathParams, PathSet, PathStats, SprayPolicy, MAX_PATHS};
use crate::transport::TxPacket;
use crate::wire::{Bth, HeaderBuf, Opcode, PacketView};
use smallvec::SmallVec;

/// A received probe to answer: its PSN field, and for a challenge its nonce and path.
type ProbeToEcho = (u32, Option<(u64, u8)>);

/// Probes to send and probes to answer.
#[derive(Debug, Default)]
pub(super) struct ProbeSlot {
    /// Down paths whose probe is due.
    due: SmallVec<[u8; 4]>,
    /// PSN fields of received probes, with their challenge nonce and path if they carried
    /// one, to echo.
    replies: SmallVec<[ProbeToEcho; 4]>,
}

/// Most unanswered probes a QP keeps (more are dropped: the peer probes again).
const MAX_REPLIES: usize = 16;

impl<R: SharedRegion> RcQp<R> {
    /// Uses `n` paths with `policy`. Spraying (any policy but `single` with more than one
    /// path) reorders packets, so it needs selective repeat; go-back-N would resend on every
    /// overtaken packet.
    pub fn set_paths(&mut self, n: usize, policy: SprayPolicy, params: PathParams) -> Result<(), String> {
        if n == 0 || n > MAX_PATHS {
            return Err(format!("paths: {n} is not in 1..={MAX_PATHS}"));
        }
        if n > 1 && policy.sprays() && self.cfg.recovery != Recovery::SelectiveRepeat {
            return Err(format!(
                "spray policy {policy} reorders packets and needs recovery = \"selective-repeat\""
            ));
        }
        if self.req.outstanding() > 0 {
            return Err("paths: set them before posting work requests".into());
        }
        let host_delay = self.req.paths.host_delay();
        self.req.paths = PathSet::new(n, policy, params);
        self.req.paths.set_ports(self.req.source_ports);
        // the host's delay is the driver's to say, not the paths': it stays
        self.req.paths.set_host_delay(host_delay);
        Ok(())
    }

    /// The driver has `total` routes (source ports, address pairs) this QP's paths may take:
    /// path `k` starts on route `k`, and one that looks cut moves to a route no other path
    /// takes (see [`PathSet::set_ports`]); the driver sends each packet on its path's route
    /// ([`PathSet::port`]). Kept across [`RcQp::set_paths`].
    pub fn set_source_ports(&mut self, total: usize) {
        self.req.source_ports = total;
        self.req.paths.set_ports(total);
    }

    /// The QP's paths: how many, the policy, and what each did.
    pub fn paths(&self) -> &PathSet {
        &self.req.paths
    }

    /// Per-path counters.
    pub fn path_stats(&self) -> Vec<PathStats> {
        self.req.paths.stats()
    }

    /// Takes silent paths out of the rotation (resending what they had in flight) and notes
    /// the probes that are due.
    pub(super) fn check_paths(&mut self, now: u64) {
        if self.req.paths.len() < 2 {
            return;
        }
        let cfg = self.cfg;
        for p in self.req.paths.check(now) {
            self.stats.path_downs += 1;
            tracing::debug!(
                "QP {:#x}: path {p} delivered nothing for 3 RTOs: out of the rotation",
                self.qpn
            );
            self.req.path_down(p, &cfg);
        }
        while let Some(p) = self.req.paths.probe_due(now) {
            if !self.probe.due.contains(&p) {
                self.probe.due.push(p);
            }
        }
    }

    /// Handles PROBE and PROBE_REPLY; false for other packets.
    pub(super) fn handle_probe(&mut self, now: u64, pkt: &PacketView<'_>) -> bool {
        match pkt.opcode {
            Opcode::Probe => {
                self.stats.probes_received += 1;
                if self.probe.replies.len() < MAX_REPLIES {
                    // a challenge's nonce is echoed (super::validation)
                    let nonce = (pkt.trailer.len() == super::validation::NONCE_LEN).then(|| {
                        (
                            u64::from_be_bytes(pkt.trailer.try_into().unwrap_or_default()),
                            pkt.bth.path,
                        )
                    });
                    self.probe.replies.push((pkt.bth.psn, nonce));
                }
                true
            }
            Opcode::ProbeReply if pkt.bth.psn & super::validation::CHALLENGE != 0 => {
                self.handle_challenge_reply(pkt);
                true
            }
            Opcode::ProbeReply => {
                if self.state == QpState::Rts {
                    let path = (pkt.bth.psn & 0xFF) as u8;
                    if path as usize >= self.req.paths.len() {
                        self.stats.dropped_packets += 1;
                    } else {
                        if !self.req.paths.is_up(path) {
                            tracing::debug!("QP {:#x}: path {path} answered a probe: back in the rotation", self.qpn);
                        }
                        self.req.paths.on_probe_reply(path, now);
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// Whether a probe or a probe reply waits to be sent.
    pub(super) fn probe_pending(&self) -> bool {
        !self.probe.due.is_empty() || !self.probe.replies.is_empty()
    }

    /// The answer to a challenge the peer sent ([`super::validation`]), if one waits.
    pub(super) fn poll_challenge_reply(&mut self) -> Option<TxPacket<R>> {
        let i = self.probe.replies.iter().position(|r| r.1.is_some())?;
        let (psn, challenge) = self.probe.replies.remove(i);
        let (nonce, path) = challenge?;
        self.stats.tx_packets += 1;
        let mut hdr = HeaderBuf::with_bth(&Bth::new(Opcode::ProbeReply as u8, self.dest_qpn, psn));
        hdr.push_u32((nonce >> 32) as u32).push_u32(nonce as u32);
        Some(TxPacket {
            hdr,
            payload: Default::default(),
            path,
        })
    }

    /// Whether the answer to a challenge waits to be sent.
    pub(super) fn challenge_reply_pending(&self) -> bool {
        self.probe.replies.iter().any(|r| r.1.is_some())
    }

    /// A probe reply (on the path of the latest request) or a probe (on the down path it tests).
    pub(super) fn poll_probe(&mut self) -> Option<TxPacket<R>> {
        let (op, psn, path, nonce) = if let Some((psn, challenge)) = self.probe.replies.pop() {
            // a challenge is answered on its own path, which the driver maps to the socket it
            // came from; a path probe on the path of the latest request
            let path = challenge.map_or(self.rx_path, |(_, p)| p);
            (Opcode::ProbeReply, psn, path, challenge.map(|(n, _)| n))
        } else {
            let p = self.probe.due.pop()?;
            self.stats.probes_sent += 1;
            (Opcode::Probe, p as u32, p, None)
        };
        self.stats.tx_packets += 1;
        let mut hdr = HeaderBuf::with_bth(&Bth::new(op as u8, self.dest_qpn, psn));
        if let Some(n) = nonce {
            hdr.push_u32((n >> 32) as u32).push_u32(n as u32);
        }
        Some(TxPacket {
            hdr,
            payload: Default::default(),
            path,
        })
    }
}
