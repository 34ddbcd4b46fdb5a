//! A data core's receive side: batches from the link, the emulated propagation delay line,
//! hairpin packets, and dispatch of each datagram to its QP (or to the protocol that claims it).

use super::*;
use std::os::fd::RawFd;

/// A received datagram waiting out the emulated propagation delay.
pub(super) struct Delayed {
    pub(super) due: u64,
    data: Vec<u8>,
    src: SocketAddrV4,
    /// The address it was received on.
    local: SocketAddrV4,
    ce: bool,
}

/// The descriptors a wait reported readable (a thread's `ppoll`, or a driver task's reactor,
/// [`super::task`]) since the core last received on them: a pass receives only on those, not
/// on every port (a multipath client's paths are a socket each, and most are empty in any one
/// pass).
#[derive(Default)]
pub(super) struct ReadyFds {
    /// The descriptors the wait watched; a port whose descriptor is not among them is always
    /// received on.
    pub(super) watched: Fds,
    /// Those reported readable, and those whose last receive filled its batch (more may wait).
    pub(super) ready: Fds,
    /// Receive on every port in the next pass.
    pub(super) all: bool,
    /// Passes that received with it.
    pub(super) passes: u32,
}

impl ReadyFds {
    fn wants(&self, fd: Option<RawFd>) -> bool {
        self.all || fd.is_none_or(|fd| !self.watched.contains(&fd) || self.ready.contains(&fd))
    }
}

impl DataCore {
    /// Receives on the core's ports: all of them, or with `only` those it lists as ready
    /// (which it leaves listing the ports whose batch came back full).
    pub(super) fn receive(&mut self, now: u64, link: &dyn Link, mut only: Option<&mut ReadyFds>) -> bool {
        let all_ports = only.as_ref().is_none_or(|r| r.all);
        let mut any = false;
        let mut full = Fds::new();
        for i in 0..self.rx_ports.len() {
            let port = self.rx_ports[i];
            let fd = link.wait_fd(port);
            if only.as_ref().is_some_and(|r| !r.wants(fd)) {
                continue;
            }
            let n = self.receive_on(port, now, link);
            any |= n > 0;
            if n == self.rx.capacity() {
                full.extend(fd);
            }
        }
        let drained = full.is_empty();
        if let Some(r) = only.as_mut() {
            r.ready = full;
            r.all = false;
            r.passes += 1;
        }
        if let Some(ns) = self.late.end_receive(now, drained, all_ports) {
            self.set_host_delay(ns);
        }
        any
    }

    /// Hands the flows a new host-delay estimate (see [`super::lateness`]).
    fn set_host_delay(&mut self, ns: u64) {
        for s in self.qps.values_mut() {
            s.qp.set_host_delay(ns);
        }
        self.protocols.set_host_delay(ns);
    }

    /// Receives one batch on `port`; returns how many receive buffers it filled.
    pub(super) fn receive_on(&mut self, port: usize, now: u64, link: &dyn Link) -> usize {
        let n = match link.recv(port, &mut self.rx) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("receive failed: {e}");
                return 0;
            }
        };
        let local = link.local_addr(port);
        let mut staged = 0u64;
        for i in 0..n {
            let (d, src, seg) = self.rx.get(i);
            staged += d.map_or(0, |d| d.len() as u64);
            let Some(d) = d else {
                self.shared.stats.rx_datagrams.inc();
                self.shared.stats.rx_malformed("oversized");
                continue;
            };
            self.shared.stats.staging_fills.inc();
            // GRO coalesces only datagrams with identical IP headers, so one TOS covers all
            let ce = self.rx.tos(i) & 3 == 3;
            // when the kernel took it in: the wait since is this host's delay, not the network's
            let arrived = self.rx.arrived(i).unwrap_or(now);
            self.late.arrival(now, arrived);
            if ce {
                self.shared.stats.rx_ce.inc();
            }
            for dgram in sys::segments(d, seg) {
                if self.rx_delay > 0 {
                    let mut data = self.spare.pop().unwrap_or_default();
                    data.clear();
                    data.extend_from_slice(dgram);
                    self.delayed.push_back(Delayed {
                        due: now + self.rx_delay,
                        data,
                        src,
                        local,
                        ce,
                    });
                    continue;
                }
                if let Some(p) = self.protocols.claiming(dgram) {
                    self.shared.stats.rx_datagrams.inc();
                    self.shared.stats.rx_bytes.add(dgram.len() as u64);
                    p.on_packet(&self.shared, now, dgram, src, ce);
                    continue;
                }
                if let Some((qpn, delivered)) = Self::dispatch(
                    &self.shared,
                    &mut self.qps,
                    self.index,
                    (now, arrived),
                    dgram,
                    src,
                    local,
                    ce,
                ) {
                    self.active.insert(qpn);
                    if !delivered {
                        self.stuck.insert(qpn);
                    }
                }
            }
        }
        self.shared.stats.note_staged(staged);
        n
    }

    /// Processes the packets this core sent to itself.
    pub(super) fn receive_hairpin(&mut self, now: u64) -> bool {
        let mut any = false;
        while let Some((data, src, dst)) = self.hairpin.pop_front() {
            any = true;
            if let Some((qpn, delivered)) = Self::dispatch(
                &self.shared,
                &mut self.qps,
                self.index,
                (now, now),
                &data,
                src,
                dst,
                false,
            ) {
                self.active.insert(qpn);
                if !delivered {
                    self.stuck.insert(qpn);
                }
            }
            self.spare.push(data);
        }
        any
    }

    /// Processes the delayed datagrams whose delay has passed.
    pub(super) fn release_delayed(&mut self, now: u64) -> bool {
        let mut any = false;
        while self.delayed.front().is_some_and(|d| d.due <= now) {
            let Some(d) = self.delayed.pop_front() else { break };
            any = true;
            if let Some(p) = self.protocols.claiming(&d.data) {
                self.shared.stats.rx_datagrams.inc();
                self.shared.stats.rx_bytes.add(d.data.len() as u64);
                p.on_packet(&self.shared, now, &d.data, d.src, d.ce);
                self.spare.push(d.data);
                continue;
            }
            if let Some((qpn, delivered)) = Self::dispatch(
                &self.shared,
                &mut self.qps,
                self.index,
                // the emulated propagation delay ends when the packet is due
                (now, d.due),
                &d.data,
                d.src,
                d.local,
                d.ce,
            ) {
                self.active.insert(qpn);
                if !delivered {
                    self.stuck.insert(qpn);
                }
            }
            self.spare.push(d.data);
        }
        any
    }

    /// Checks one datagram, which arrived at the host at `arrived`, and hands it to its QP at
    /// `now`; returns the QPN it went to and whether its completions all fit in their CQs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dispatch(
        shared: &EngineShared,
        qps: &mut HashMap<u32, QpSlot, Ordered>,
        core: usize,
        (now, arrived): (u64, u64),
        d: &[u8],
        src: SocketAddrV4,
        local: SocketAddrV4,
        ce: bool,
    ) -> Option<(u32, bool)> {
        let stats = &shared.stats;
        stats.rx_datagrams.inc();
        stats.rx_bytes.add(d.len() as u64);
        let v = match PacketView::parse(d) {
            Ok(v) => v,
            Err(e) => {
                stats.rx_malformed(e.kind());
                return None;
            }
        };
        let qpn = v.bth.dest_qp;
        // the next expected packet of a WRITE in progress is copied into its checked range in the
        // pass that verifies its ICRC; every other packet is verified before anything reads it.
        // A QP whose connection runs without ICRC (both ends chose it, the UDP checksum covers
        // the bytes) ignores the field: nothing is verified, and the transport places the
        // payload after its checks, as it does any packet not placed here (one copy)
        let slot = qps.get_mut(&qpn);
        let no_icrc = slot.as_ref().is_some_and(|s| s.no_icrc());
        let placement = slot
            .as_ref()
            .filter(|s| !no_icrc && s.accepts(src))
            .and_then(|s| s.qp.write_placement(&v, &*shared.mrs));
        let verdict = match &placement {
            _ if no_icrc => Ok(()),
            Some((region, off)) => v.verify_icrc_placing(d, src, local, |o, b| region.write(off + o, b)),
            None => PacketView::verify_icrc(d, src, local),
        };
        if let Err(e) = verdict {
            stats.rx_malformed(e.kind());
            return None;
        }
        let Some(s) = slot else {
            stats.rx_unknown_qp.inc();
            return None;
        };
        if !s.accepts(src) {
            stats.rx_wrong_source.inc();
            return None;
        }
        // what the peer sent counts towards what may be sent to it before it is validated
        s.qp.credit_received(now, d.len());
        let challenge = v.bth.opcode == Opcode::Probe as u8 && v.bth.psn & CHALLENGE != 0;
        if challenge || Opcode::from_u8(v.bth.opcode).is_some_and(Opcode::is_request) {
            s.note_request_source(v.bth.path, src);
        }
        let copied = s.qp.payload_copy_bytes();
        s.qp.handle_received(now, arrived, &v, ce, &*shared.mrs, placement.is_some());
        if placement.is_some() {
            stats.rx_fused_copy_bytes.add(v.payload.len() as u64);
        }
        stats.rx_payload_copy_bytes.add(s.qp.payload_copy_bytes() - copied);
        Some((qpn, s.deliver_completions(core)))
    }
}
