//! A data core's transmit side: polling the active QPs for packets, hairpin (packets to
//! the core itself), and batched sends over the link, with GSO grouping and READ-response
//! snapshots.

use super::*;

impl DataCore {
    /// Polls the active QPs for packets; sends them when `flush` (or the batch is full).
    pub(super) fn transmit(&mut self, now: u64, flush: bool, link: &dyn Link) -> bool {
        let mut sent_any = false;
        let active: Vec<u32> = self.active.iter().copied().collect();
        for qpn in active {
            let Some(s) = self.qps.get_mut(&qpn) else {
                self.active.remove(&qpn);
                continue;
            };
            if s.remote.is_none() {
                self.active.remove(&qpn);
                continue;
            }
            let with_icrc = !s.no_icrc();
            while self.out.len() < TX_BATCH {
                match s.qp.poll_transmit(now) {
                    Some(pkt) => {
                        let Some((port, dst)) = s.route_of(&pkt) else { break };
                        if !s.may_send(&pkt, (port, dst)) {
                            // dropped: that route's peer address is not validated and the
                            // allowance is spent; the QP's next packet waits for the next pass
                            // (a long READ answered that way costs a packet per pass, not a loop
                            // over the whole READ)
                            break;
                        }
                        let src = link.local_addr(port);
                        if self.local_addrs.contains(&dst) {
                            let (spare, hairpin) = (&mut self.spare, &mut self.hairpin);
                            loop_back(&self.shared.stats, spare, hairpin, &pkt, (src, dst), with_icrc);
                            sent_any = true;
                            continue;
                        }
                        let stats = &self.shared.stats;
                        self.out.push(Outgoing::new(pkt, port, (src, dst), stats, with_icrc));
                    }
                    None => break,
                }
            }
            if !s.deliver_completions(self.index) {
                self.stuck.insert(qpn);
            }
            if !s.qp.wants_transmit(now) {
                self.active.remove(&qpn);
            }
            if let Some(t) = s.qp.poll_timeout() {
                self.deadlines.arm(qpn, t);
            }
            if self.out.len() >= TX_BATCH {
                sent_any |= self.flush(link);
            }
        }
        if flush {
            sent_any |= self.flush(link);
        }
        sent_any
    }

    /// Sends the batch of RC packets (see [`send_batch`]).
    pub(super) fn flush(&mut self, link: &dyn Link) -> bool {
        send_batch(
            &mut self.out,
            self.gso,
            link,
            &self.shared.stats,
            &mut self.tx_msgs,
            &mut self.tx_per_msg,
            &mut self.tx_hdrs,
        )
    }

    /// Sends what the other protocols gathered (see [`send_batch`]).
    pub(super) fn flush_protocols(&mut self, link: &dyn Link) -> bool {
        let mut tx = super::protocol::Transmitter {
            gso: self.gso,
            link,
            stats: &self.shared.stats,
            msgs: &mut self.tx_msgs,
            per_msg: &mut self.tx_per_msg,
            scratch: &mut self.tx_hdrs,
        };
        self.protocols.flush(&mut tx)
    }
}

/// One outgoing datagram being assembled: the packet (holding its payload regions alive), the
/// destination, and the pad + ICRC trailer.
pub(super) struct Outgoing {
    pkt: TxPacket,
    /// Index of the port it leaves from (`EngineShared::link`).
    link: usize,
    dst: SocketAddrV4,
    trailer: [u8; 8],
    trailer_len: usize,
}

/// A packet a core sends: the socket it leaves from, where it goes, and its bytes as spans.
pub(crate) trait Datagram {
    /// Index of the port it leaves from (`EngineShared::link`).
    fn link(&self) -> usize;
    fn dst(&self) -> SocketAddrV4;
    /// Bytes on the wire (the UDP payload).
    fn wire_len(&self) -> usize;
    /// Spans [`Datagram::push_spans`] adds.
    fn spans(&self) -> usize;
    /// Adds this packet's spans to `m`.
    ///
    /// # Safety
    /// `self` must stay alive and unmoved until `m` has been sent (or is never sent): the
    /// spans point into it and into the buffers it keeps alive.
    unsafe fn push_spans(&self, m: &mut OutMsg);
}

/// Queues a packet from `src` for the core itself (hairpin, at `dst`): serialized with its
/// ICRC (0 `without` one, a QP whose connection runs [`crate::transport::rc::IcrcMode::None`])
/// into a buffer from `spare`, no system call.
fn loop_back(
    stats: &EngineStats,
    spare: &mut Vec<Vec<u8>>,
    hairpin: &mut VecDeque<(Vec<u8>, SocketAddrV4, SocketAddrV4)>,
    pkt: &TxPacket,
    (src, dst): (SocketAddrV4, SocketAddrV4),
    with_icrc: bool,
) {
    let mut d = spare.pop().unwrap_or_default();
    d.clear();
    d.extend_from_slice(pkt.hdr.as_bytes());
    for p in &pkt.payload {
        p.region.append_to(p.off, p.len, &mut d);
    }
    // a hairpin packet is serialized: its payload is copied once
    stats.tx_payload_copy_bytes.add(pkt.payload_len() as u64);
    d.extend_from_slice(&PAD_ZEROS[..pkt.hdr.bth().pad as usize]);
    let c = if with_icrc {
        icrc::compute(src, dst, &[d.as_slice()])
    } else {
        0
    };
    d.extend_from_slice(&c.to_le_bytes());
    stats.tx_packets.inc();
    stats.tx_bytes.add(d.len() as u64);
    stats.hairpin_packets.inc();
    hairpin.push_back((d, src, dst));
}

/// Sends `out` from `link`'s ports and removes what the kernel took; what it did not take
/// (a socket buffer full) is kept for the next round. With GSO, runs of packets to one
/// destination with the same length (the last of a run may be shorter) go out as one message
/// the kernel segments. The message buffers are reused: no allocation per batch.
pub(super) fn send_batch<T: Datagram>(
    out: &mut Vec<T>,
    gso: bool,
    link: &dyn Link,
    stats: &EngineStats,
    msgs: &mut Vec<OutMsg>,
    per_msg: &mut Vec<usize>,
    hdrs: &mut SendScratch,
) -> bool {
    if out.is_empty() {
        return false;
    }
    // sprayed packets leave from several sockets: each run of packets from one socket is a
    // sendmmsg (sprayed in bursts, so runs are whole GSO messages), in order, so the
    // receiver of a loopback or single-link path sees no reordering
    msgs.clear();
    per_msg.clear();
    let mut i = 0;
    while i < out.len() {
        let o = &out[i];
        let seg = o.wire_len();
        let mut m = OutMsg::new(&o.dst());
        // SAFETY: `out` is neither changed nor moved until the batch is sent below; `msgs` is
        // cleared before the next batch is built.
        unsafe { o.push_spans(&mut m) };
        let mut n = 1;
        if gso {
            let max = sys::MAX_GSO_SEGMENTS.min(sys::MAX_GSO_BYTES / seg);
            while n < max {
                let Some(p) = out.get(i + n) else { break };
                let l = p.wire_len();
                if p.dst() != o.dst() || p.link() != o.link() || l > seg || m.room() < p.spans() {
                    break;
                }
                // SAFETY: as for the first packet of the message, above.
                unsafe { p.push_spans(&mut m) };
                n += 1;
                if l < seg {
                    break; // only the last segment may be shorter
                }
            }
            if n > 1 {
                m.gso = seg as u16;
            }
        }
        msgs.push(m);
        per_msg.push(n);
        i += n;
    }
    // one sendmmsg per socket run; a socket that takes less stops the batch there
    let mut sent_msgs = 0;
    let mut pkt = 0;
    while sent_msgs < msgs.len() {
        let port = out[pkt].link();
        let mut k = 0;
        let mut pk = pkt;
        while sent_msgs + k < msgs.len() && out[pk].link() == port {
            pk += per_msg[sent_msgs + k];
            k += 1;
        }
        let run = &mut msgs[sent_msgs..sent_msgs + k];
        stats.tx_calls.inc();
        let took = match link.send(port, run, hdrs) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("send failed: {e}");
                stats.tx_errors.inc();
                k // drop the run; the transport retransmits
            }
        };
        pkt += per_msg[sent_msgs..sent_msgs + took].iter().sum::<usize>();
        sent_msgs += took;
        if took < k {
            break;
        }
    }
    let n = pkt;
    for o in &out[..n] {
        stats.tx_packets.inc();
        stats.tx_bytes.add(o.wire_len() as u64);
    }
    stats.tx_messages.add(sent_msgs as u64);
    out.drain(..n);
    // the spans pointed into the packets just removed
    msgs.clear();
    n > 0
}

/// A READ response carries memory that the responder's own application may be writing at this
/// moment (a key-value store rewriting an entry that clients READ). Checksummed in place and
/// copied by the kernel later, such a packet could carry bytes other than those its ICRC
/// covers: the requester drops it as corrupt, and again on every retransmission while the
/// writes go on, until the READ fails with RETRY_EXC_ERR. Like a NIC, which DMA-reads the
/// payload once and checksums what it read, the engine copies a READ response's payload first,
/// so the READ completes with whatever the memory held (torn data is the reader's to detect).
/// Small payloads of any opcode are copied too (cheaper than the system call they ride in):
/// a RedN chain's response WRITE sources memory the store's writer owns. Larger SEND and WRITE
/// payloads stay zero-copy: their memory is the poster's, not to be modified while the request
/// is outstanding (the verbs rule).
///
/// The payload is copied once, straight into the snapshot ([`crate::mem::Region::copy_folding`]),
/// and each piece is checksummed into `crc` (which has seen the header) from the snapshot
/// right after it landed, while in the L1 cache: one copy and the ICRC in one pass
/// (fold-and-copy). Returns false (and touches neither) when the payload is sent from its
/// memory instead.
fn snapshot_read_payload(pkt: &mut TxPacket, stats: &EngineStats, crc: &mut icrc::Icrc) -> bool {
    /// Payloads up to this many bytes are always copied.
    const SNAPSHOT_SMALL_PAYLOAD: usize = 512;
    let read_resp = matches!(
        Opcode::from_u8(pkt.hdr.bth().opcode),
        Some(
            Opcode::ReadResponseFirst
                | Opcode::ReadResponseMiddle
                | Opcode::ReadResponseLast
                | Opcode::ReadResponseOnly
        )
    );
    let len = pkt.payload_len();
    if len == 0 || !read_resp && len > SNAPSHOT_SMALL_PAYLOAD {
        return false;
    }
    stats.tx_payload_copy_bytes.add(len as u64);
    let snap = snapshot_buffer(len);
    let mut at = 0;
    for p in &pkt.payload {
        // SAFETY: `snapshot_buffer` hands out a buffer no packet holds (a fresh one, or a
        // pooled one whose only reference is the pool's): the send that last read it returned
        // before its packet was dropped, and this thread is the only one that reaches the pool,
        // so `snap` is private until the packet built here is sent.
        unsafe { p.region.copy_folding(p.off, p.len, &snap, at, |_, c| crc.update(c)) };
        at += p.len;
    }
    pkt.payload.clear();
    pkt.payload.push(crate::transport::PayloadPart {
        region: snap,
        off: 0,
        len,
    });
    true
}

/// A buffer of at least `len` bytes that no packet is using.
fn snapshot_buffer(len: usize) -> Arc<crate::mem::Region> {
    /// Buffers kept per thread (a window of packets in flight between copy and send).
    const POOL: usize = 512;
    /// Pooled buffers hold a full packet's payload.
    const SIZE: usize = 4096;
    if len > SIZE {
        return Arc::new(crate::mem::Region::alloc(len));
    }
    SNAPSHOTS.with(|p| {
        let (pool, next) = &mut *p.borrow_mut();
        // look from where the last search ended: buffers are freed roughly in the order they
        // were taken (packets leave in order)
        for k in 0..pool.len() {
            let i = (*next + k) % pool.len();
            if Arc::strong_count(&pool[i]) == 1 {
                *next = i + 1;
                return pool[i].clone();
            }
        }
        let r = Arc::new(crate::mem::Region::alloc(SIZE));
        if pool.len() < POOL {
            pool.push(r.clone());
        }
        r
    })
}

impl Outgoing {
    /// Computes pad and ICRC over the header buffer and the payload, which the kernel then
    /// sends from its memory (the ICRC reads it through private chunks, see
    /// [`crate::mem::Region::chunks`]); READ responses and small payloads are snapshotted in
    /// the same pass (see [`snapshot_read_payload`]).
    ///
    /// Not `with_icrc` (a QP whose connection runs [`crate::transport::rc::IcrcMode::None`]),
    /// the ICRC field is 0 and nothing reads the payload: the kernel's copy into the datagram
    /// is the only pass over it, and the UDP checksum it computes covers what it copied, so
    /// no snapshot is needed for a READ response's bytes to match their checksum either.
    fn new(
        mut pkt: TxPacket,
        link: usize,
        (src, dst): (SocketAddrV4, SocketAddrV4),
        stats: &EngineStats,
        with_icrc: bool,
    ) -> Outgoing {
        let pad = pkt.hdr.bth().pad as usize;
        let mut trailer = [0u8; 8];
        if with_icrc {
            let body = pkt.hdr.len() + pkt.payload_len() + pad;
            let mut c = icrc::Icrc::new(src, dst, body);
            c.update(pkt.hdr.as_bytes());
            if !snapshot_read_payload(&mut pkt, stats, &mut c) {
                for p in &pkt.payload {
                    p.region.chunks(p.off, p.len, |_, s| c.update(s));
                }
            }
            c.update(&PAD_ZEROS[..pad]);
            trailer[pad..pad + 4].copy_from_slice(&c.finish().to_le_bytes());
        }
        Outgoing {
            pkt,
            link,
            dst,
            trailer,
            trailer_len: pad + 4,
        }
    }
}

impl Datagram for Outgoing {
    fn link(&self) -> usize {
        self.link
    }
    fn dst(&self) -> SocketAddrV4 {
        self.dst
    }
    fn wire_len(&self) -> usize {
        self.pkt.hdr.len() + self.pkt.payload_len() + self.trailer_len
    }
    fn spans(&self) -> usize {
        2 + self.pkt.payload.len()
    }
    /// Adds this packet's header, payload spans and trailer to `m`.
    unsafe fn push_spans(&self, m: &mut OutMsg) {
        // SAFETY: the header, trailer and payload regions live in `self`, which the caller
        // keeps alive and in place until `m` is sent; `ptr_at` bounds-checks each payload span.
        unsafe {
            m.push(self.pkt.hdr.as_bytes().as_ptr(), self.pkt.hdr.len());
            for p in &self.pkt.payload {
                m.push(p.region.ptr_at(p.off, p.len), p.len);
            }
            m.push(self.trailer.as_ptr(), self.trailer_len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A READ response's payload, in two parts at odd offsets of two regions, larger and
    /// smaller than a pooled snapshot: it leaves from a snapshot holding exactly its bytes,
    /// whose ICRC (folded while copying) is that of the bytes on the wire, and later writes to
    /// the source change nothing that is sent. Counted as copied.
    #[test]
    fn read_response_snapshot_is_copied_once_with_its_icrc() {
        use crate::mem::Region;
        use crate::wire::{Bth, HeaderBuf};
        let (src, dst): (SocketAddrV4, SocketAddrV4) =
            ("10.0.0.1:49152".parse().unwrap(), "10.0.0.2:4791".parse().unwrap());
        for (a_len, b_len) in [(1000usize, 3001usize), (5000, 4099), (3, 0)] {
            let a = Arc::new(Region::alloc(a_len + 11));
            let b = Arc::new(Region::alloc(b_len + 5));
            let bytes: Vec<u8> = (0..a_len + b_len).map(|i| (i * 13 + 1) as u8).collect();
            a.write(7, &bytes[..a_len]);
            b.write(5, &bytes[a_len..]);
            let mut hdr = HeaderBuf::with_bth(&Bth::new(Opcode::ReadResponseMiddle as u8, 0x77, 3));
            hdr.set_pad_for(bytes.len());
            let mut pkt = TxPacket {
                hdr,
                payload: Default::default(),
                path: 0,
            };
            for (region, off, len) in [(&a, 7, a_len), (&b, 5, b_len)] {
                pkt.payload.push(crate::transport::PayloadPart {
                    region: region.clone(),
                    off,
                    len,
                });
            }
            let stats = EngineStats::default();
            let o = Outgoing::new(pkt, 0, (src, dst), &stats, true);
            assert_eq!(stats.tx_payload_copy_bytes.get(), bytes.len() as u64);
            assert_eq!(o.pkt.payload.len(), 1, "one snapshot");
            let snap = &o.pkt.payload[0];
            assert!(!Arc::ptr_eq(&snap.region, &a) && !Arc::ptr_eq(&snap.region, &b));
            a.fill(7, a_len, 0xEE); // the application rewrites the source: not sent
            let mut wire = o.pkt.hdr.as_bytes().to_vec();
            wire.extend(snap.region.to_vec(snap.off, snap.len));
            wire.extend_from_slice(&o.trailer[..o.trailer_len]);
            assert_eq!(&wire[o.pkt.hdr.len()..o.pkt.hdr.len() + bytes.len()], &bytes[..]);
            PacketView::verify_icrc(&wire, src, dst).expect("the folded ICRC is the packet's");
        }
    }

    #[test]
    fn snapshot_buffers_are_reused_once_no_packet_holds_them() {
        let a = snapshot_buffer(100);
        let a_addr = a.addr();
        let b = snapshot_buffer(4096);
        assert_ne!(b.addr(), a_addr, "a buffer in use is not handed out again");
        drop(a);
        let c = snapshot_buffer(2000);
        assert_eq!(c.addr(), a_addr, "a freed buffer is reused");
        let big = snapshot_buffer(10_000);
        assert!(big.len() >= 10_000, "larger payloads get a buffer of their own");
        drop((b, c, big));
    }
}
