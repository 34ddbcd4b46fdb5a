//! Zero-copy checked view over a received RoCEv2 UDP payload, and the header buffer a sender builds.

use super::headers::*;
use super::icrc::{self, ICRC_LEN};
use super::opcode::Opcode;
use super::WireError;
use std::net::SocketAddrV4;

/// Largest congestion-control header after the BTH (16 words).
pub const MAX_CC_HDR_LEN: usize = 64;
/// Largest header stack this stack emits (BTH + CC header + RETH + ImmDt + SR extension).
pub const MAX_HDR_LEN: usize = 128;
/// Largest payload MTU (IBA path MTU 4096).
pub const MAX_MTU: usize = 4096;
/// Largest datagram accepted: headers, an MTU of payload (plus the SR extension), pad and ICRC.
pub const MAX_DATAGRAM: usize = MAX_HDR_LEN + MAX_MTU + 4 + ICRC_LEN;

/// The largest path MTU of the ones IBA defines (256, 512, 1024, 2048, 4096) whose packets, with this stack's largest headers, pad, ICRC, and the IPv4 and UDP headers, fit in
/// IP packets of `ip_mtu` bytes (256 when none does).
pub fn largest_mtu_within(ip_mtu: u32) -> u32 {
    let overhead = (20 + 8 + MAX_HDR_LEN + 4 + ICRC_LEN) as u32;
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| m + overhead <= ip_mtu)
        .unwrap_or(256)
}

/// A parsed packet whose header fields have been length-checked; `payload` borrows the datagram.
#[derive(Debug, Clone)]
pub struct PacketView<'a> {
    /// The base transport header.
    pub bth: Bth,
    /// Its opcode, known to this stack.
    pub opcode: Opcode,
    /// The congestion-control header after the BTH (empty unless the QP negotiated one).
    pub cc: &'a [u8],
    /// The RETH, when the opcode has one.
    pub reth: Option<Reth>,
    /// The AETH, when the opcode has one.
    pub aeth: Option<Aeth>,
    /// The AtomicETH of an atomic request.
    pub atomic: Option<AtomicEth>,
    /// The AtomicAckETH of an atomic acknowledge.
    pub atomic_ack: Option<AtomicAckEth>,
    /// Immediate data (as sent, network order read as big-endian).
    pub imm: Option<u32>,
    /// The rkey a SEND with invalidate invalidates.
    pub ieth: Option<u32>,
    /// Payload without pad and ICRC.
    pub payload: &'a [u8],
    /// Trailing bytes after the defined headers for opcodes without payload (e.g. the SACK
    /// extension of an ACK). Empty for opcodes that carry payload.
    pub trailer: &'a [u8],
    /// The ICRC as received (little-endian on the wire).
    pub icrc: u32,
}

impl<'a> PacketView<'a> {
    /// Parses a UDP payload. Never panics: every malformed input is a [`WireError`].
    pub fn parse(d: &'a [u8]) -> Result<PacketView<'a>, WireError> {
        if d.len() > MAX_DATAGRAM {
            return Err(WireError::Oversized { len: d.len() });
        }
        if d.len() < Bth::LEN + ICRC_LEN {
            return Err(WireError::Truncated {
                need: Bth::LEN + ICRC_LEN,
                have: d.len(),
            });
        }
        let bth = Bth::parse(d);
        if bth.tver != 0 {
            return Err(WireError::BadVersion(bth.tver));
        }
        let opcode = Opcode::from_u8(bth.opcode).ok_or(WireError::UnknownOpcode(bth.opcode))?;
        let hs = opcode.headers();
        if bth.cc_words as usize * 4 > MAX_CC_HDR_LEN {
            return Err(WireError::BadCcHeader { words: bth.cc_words });
        }
        let cc_len = bth.cc_words as usize * 4;
        let mut need = Bth::LEN + cc_len;
        need += if hs.reth { Reth::LEN } else { 0 };
        need += if hs.aeth { Aeth::LEN } else { 0 };
        need += if hs.atomic_eth { AtomicEth::LEN } else { 0 };
        need += if hs.atomic_ack_eth { AtomicAckEth::LEN } else { 0 };
        need += if hs.imm { IMM_LEN } else { 0 };
        need += if hs.ieth { IETH_LEN } else { 0 };
        if d.len() < need + ICRC_LEN {
            return Err(WireError::Truncated {
                need: need + ICRC_LEN,
                have: d.len(),
            });
        }
        let cc = &d[Bth::LEN..Bth::LEN + cc_len];
        let mut off = Bth::LEN + cc_len;
        let mut take = |n: usize| {
            let s = &d[off..off + n];
            off += n;
            s
        };
        let reth = hs.reth.then(|| Reth::parse(take(Reth::LEN)));
        let aeth = hs.aeth.then(|| Aeth::parse(take(Aeth::LEN)));
        let atomic = hs.atomic_eth.then(|| AtomicEth::parse(take(AtomicEth::LEN)));
        let atomic_ack = hs.atomic_ack_eth.then(|| AtomicAckEth::parse(take(AtomicAckEth::LEN)));
        let imm = hs
            .imm
            .then(|| u32::from_be_bytes(take(4).try_into().unwrap_or_default()));
        let ieth = hs
            .ieth
            .then(|| u32::from_be_bytes(take(4).try_into().unwrap_or_default()));
        let end = d.len() - ICRC_LEN;
        let rest = &d[off..end];
        let icrc = u32::from_le_bytes([d[end], d[end + 1], d[end + 2], d[end + 3]]);
        let (payload, trailer) = if hs.payload {
            let pad = bth.pad as usize;
            if pad > rest.len() {
                return Err(WireError::BadPad {
                    pad: bth.pad,
                    len: rest.len(),
                });
            }
            (&rest[..rest.len() - pad], &rest[..0])
        } else {
            (&rest[..0], rest)
        };
        Ok(PacketView {
            bth,
            opcode,
            cc,
            reth,
            aeth,
            atomic,
            atomic_ack,
            imm,
            ieth,
            payload,
            trailer,
            icrc,
        })
    }

    /// Checks the ICRC of `datagram` (the bytes this view was parsed from) as sent from `src` to `dst`.
    pub fn verify_icrc(datagram: &[u8], src: SocketAddrV4, dst: SocketAddrV4) -> Result<(), WireError> {
        if datagram.len() < ICRC_LEN {
            return Err(WireError::Truncated {
                need: ICRC_LEN,
                have: datagram.len(),
            });
        }
        let end = datagram.len() - ICRC_LEN;
        let got = u32::from_le_bytes([datagram[end], datagram[end + 1], datagram[end + 2], datagram[end + 3]]);
        let want = icrc::compute(src, dst, &[&datagram[..end]]);
        if got == want {
            Ok(())
        } else {
            Err(WireError::BadIcrc { want, got })
        }
    }

    /// [`PacketView::verify_icrc`] fused with the copy of the payload: `place` gets the payload
    /// in pieces of at most [`PLACE_PIECE`] bytes (each piece's offset in the payload, its bytes)
    /// right after the CRC read them, so the copy reads bytes the CRC just brought into the
    /// cache and the payload makes one trip from memory, not two. Every piece is placed whatever
    /// the verdict: the caller places only where a corrupt packet's bytes may land (an
    /// incomplete message's checked range, whose content is undefined until it completes).
    /// `datagram` must be the bytes this view was parsed from; for others the payload is
    /// verified first and placed after, only when intact.
    pub fn verify_icrc_placing(
        &self,
        datagram: &[u8],
        src: SocketAddrV4,
        dst: SocketAddrV4,
        mut place: impl FnMut(usize, &[u8]),
    ) -> Result<(), WireError> {
        let end = datagram.len().saturating_sub(ICRC_LEN);
        // where the payload starts in the datagram (address arithmetic only, no access)
        let start = (self.payload.as_ptr() as usize).wrapping_sub(datagram.as_ptr() as usize);
        if datagram.len() < ICRC_LEN || start > end || self.payload.len() > end - start {
            Self::verify_icrc(datagram, src, dst)?;
            for (i, p) in self.payload.chunks(PLACE_PIECE).enumerate() {
                place(i * PLACE_PIECE, p);
            }
            return Ok(());
        }
        // (the view was parsed from `datagram`: its ICRC is the trailer's)
        let got = self.icrc;
        let mut c = icrc::Icrc::new(src, dst, end);
        c.update(&datagram[..start]);
        c.update_copying(self.payload, &mut place);
        c.update(&datagram[start + self.payload.len()..end]);
        let want = c.finish();
        if got == want {
            Ok(())
        } else {
            Err(WireError::BadIcrc { want, got })
        }
    }
}

/// The piece [`PacketView::verify_icrc_placing`] hands over at a time: that of the fused copy
/// and CRC, [`icrc::FOLD_CHUNK`] (it stays in the L1 cache between the CRC's read and the
/// copy's; a 4 KiB MTU's payload is one piece).
pub const PLACE_PIECE: usize = icrc::FOLD_CHUNK;

/// Headers of one outgoing packet, built in a small fixed buffer (header-only TX: the payload
/// travels as its own scatter-gather element and is never copied in here).
#[derive(Clone, Copy)]
pub struct HeaderBuf {
    bytes: [u8; MAX_HDR_LEN],
    len: u8,
}

impl Default for HeaderBuf {
    fn default() -> Self {
        HeaderBuf {
            bytes: [0; MAX_HDR_LEN],
            len: 0,
        }
    }
}

impl std::fmt::Debug for HeaderBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HeaderBuf({:02x?})", self.as_bytes())
    }
}

impl HeaderBuf {
    /// Starts a header stack with a BTH.
    pub fn with_bth(bth: &Bth) -> HeaderBuf {
        let mut h = HeaderBuf::default();
        bth.emit(&mut h.bytes[..Bth::LEN]);
        h.len = Bth::LEN as u8;
        h
    }
    fn grow(&mut self, n: usize) -> &mut [u8] {
        let s = self.len as usize;
        self.len += n as u8;
        &mut self.bytes[s..s + n]
    }
    /// Appends a RETH.
    pub fn push_reth(&mut self, r: &Reth) -> &mut Self {
        r.emit(self.grow(Reth::LEN));
        self
    }
    /// Appends an AETH.
    pub fn push_aeth(&mut self, a: &Aeth) -> &mut Self {
        a.emit(self.grow(Aeth::LEN));
        self
    }
    /// Appends an AtomicETH.
    pub fn push_atomic(&mut self, a: &AtomicEth) -> &mut Self {
        a.emit(self.grow(AtomicEth::LEN));
        self
    }
    /// Appends an AtomicAckETH.
    pub fn push_atomic_ack(&mut self, a: &AtomicAckEth) -> &mut Self {
        a.emit(self.grow(AtomicAckEth::LEN));
        self
    }
    /// Appends 4 bytes in network order (immediate data, an IETH, a result word).
    pub fn push_u32(&mut self, v: u32) -> &mut Self {
        self.grow(4).copy_from_slice(&v.to_be_bytes());
        self
    }
    /// Appends a selective-repeat extension.
    pub fn push_sr(&mut self, s: &SrExt) -> &mut Self {
        s.emit(self.grow(SrExt::LEN));
        self
    }
    /// Appends `n` zero bytes (reserved fields, e.g. the 16 of a CNP).
    pub fn push_zeros(&mut self, n: usize) -> &mut Self {
        self.grow(n).fill(0);
        self
    }
    /// Inserts a congestion-control header right after the BTH (shifting the headers already
    /// pushed) and records its length in the BTH. `cc` is at most [`MAX_CC_HDR_LEN`] bytes and
    /// a multiple of 4; a QP that carries none never calls this.
    pub fn insert_cc(&mut self, cc: &[u8]) -> &mut Self {
        debug_assert!(cc.len() <= MAX_CC_HDR_LEN && cc.len().is_multiple_of(4));
        debug_assert_eq!(self.bytes[4] & 0x1F, 0, "CC header inserted twice");
        let n = cc.len().min(MAX_CC_HDR_LEN) & !3;
        let end = self.len as usize;
        self.bytes.copy_within(Bth::LEN..end, Bth::LEN + n);
        self.bytes[Bth::LEN..Bth::LEN + n].copy_from_slice(&cc[..n]);
        self.bytes[4] = (self.bytes[4] & !0x1F) | (n / 4) as u8;
        self.len += n as u8;
        self
    }
    /// Records the multipath path in the BTH ([`Bth::path`]).
    pub fn set_path(&mut self, path: u8) -> &mut Self {
        self.bytes[8] = (self.bytes[8] & 0x80) | (path & 0x7F);
        self
    }
    /// Appends a selective ACK extension (after the AETH).
    pub fn push_sack(&mut self, s: &SackExt) -> &mut Self {
        s.emit(self.grow(SackExt::LEN));
        self
    }
    /// Sets the BTH pad count so that `payload_len` bytes after these headers end on a 4-byte boundary.
    pub fn set_pad_for(&mut self, payload_len: usize) -> usize {
        let pad = (4 - payload_len % 4) % 4;
        self.bytes[1] = (self.bytes[1] & !0x30) | ((pad as u8) << 4);
        pad
    }
    /// The BTH as pushed so far.
    pub fn bth(&self) -> Bth {
        Bth::parse(&self.bytes)
    }
    /// The headers' bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
    /// Bytes of headers.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Zero bytes for the pad of a payload.
pub const PAD_ZEROS: [u8; 3] = [0; 3];

/// Serializes a whole packet into `out` (used by the simulator and tests; the engine sends the
/// same parts as an iovec list instead).
pub fn encode_into(out: &mut Vec<u8>, hdr: &HeaderBuf, payload: &[&[u8]], src: SocketAddrV4, dst: SocketAddrV4) {
    out.clear();
    out.extend_from_slice(hdr.as_bytes());
    for p in payload {
        out.extend_from_slice(p);
    }
    let pad = hdr.bth().pad as usize;
    out.extend_from_slice(&PAD_ZEROS[..pad]);
    let c = icrc::compute(src, dst, &[out.as_slice()]);
    out.extend_from_slice(&c.to_le_bytes());
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_mtu_fits_the_route() {
        use super::largest_mtu_within;
        assert_eq!(largest_mtu_within(1500), 1024, "Ethernet");
        assert_eq!(largest_mtu_within(9000), 4096, "jumbo frames");
        assert_eq!(largest_mtu_within(65536), 4096, "loopback");
        assert_eq!(largest_mtu_within(2400), 2048);
        assert_eq!(largest_mtu_within(576), 256, "nothing fits: the smallest");
    }

    use super::*;

    fn addrs() -> (SocketAddrV4, SocketAddrV4) {
        ("127.0.0.1:5000".parse().unwrap(), "127.0.0.2:4791".parse().unwrap())
    }

    #[test]
    fn write_first_round_trip() {
        let (s, d) = addrs();
        let mut h = HeaderBuf::with_bth(&Bth::new(Opcode::WriteFirst as u8, 17, 100));
        h.push_reth(&Reth {
            va: 0x1000,
            rkey: 0x55,
            dma_len: 8193,
        });
        let payload = vec![7u8; 4095];
        h.set_pad_for(payload.len());
        let mut out = Vec::new();
        encode_into(&mut out, &h, &[&payload], s, d);
        assert_eq!(out.len() % 4, 0);
        let v = PacketView::parse(&out).unwrap();
        assert_eq!(v.opcode, Opcode::WriteFirst);
        assert_eq!(v.reth.unwrap().dma_len, 8193);
        assert_eq!(v.payload, &payload[..]);
        PacketView::verify_icrc(&out, s, d).unwrap();
        assert!(PacketView::verify_icrc(&out, d, s).is_err());
    }

    #[test]
    fn placing_verify_places_every_byte_and_judges_as_verify_does() {
        let (s, d) = addrs();
        // a CC header (masked in the ICRC) and a pad, around a payload of several pieces (or
        // the largest one a packet carries, when a piece is an MTU)
        let mut bth = Bth::new(Opcode::WriteMiddle as u8, 9, 77);
        bth.cc_words = 2;
        let mut h = HeaderBuf::with_bth(&bth);
        h.push_zeros(8);
        let len = (PLACE_PIECE * 3 + 5).min(MAX_MTU - 3);
        let payload: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
        h.set_pad_for(payload.len());
        let mut out = Vec::new();
        encode_into(&mut out, &h, &[&payload], s, d);
        let place_all = |dgram: &[u8], view: &PacketView<'_>| {
            let mut got = vec![0u8; view.payload.len()];
            let verdict = view.verify_icrc_placing(dgram, s, d, |o, b| got[o..o + b.len()].copy_from_slice(b));
            (verdict, got)
        };
        let v = PacketView::parse(&out).unwrap();
        let (verdict, got) = place_all(&out, &v);
        assert!(verdict.is_ok());
        assert_eq!(got, payload);
        // a bit flipped anywhere the ICRC covers: the same verdict as the unfused check
        for at in [
            0usize,
            13,
            20,
            (30 + PLACE_PIECE).min(out.len() - 10),
            out.len() - 6,
            out.len() - 1,
        ] {
            let mut bad = out.clone();
            bad[at] ^= 0x10;
            let Ok(v) = PacketView::parse(&bad) else { continue };
            let (verdict, _) = place_all(&bad, &v);
            assert_eq!(
                verdict.is_ok(),
                PacketView::verify_icrc(&bad, s, d).is_ok(),
                "flip at {at}"
            );
        }
        let mut bad = out.clone();
        bad[40] ^= 1;
        let v = PacketView::parse(&bad).unwrap();
        assert!(matches!(place_all(&bad, &v).0, Err(WireError::BadIcrc { .. })));
        // a view checked against bytes it was not parsed from: verified first, placed only if intact
        let copy = out.clone();
        let v = PacketView::parse(&copy).unwrap();
        let (verdict, got) = place_all(&out, &v);
        assert!(verdict.is_ok());
        assert_eq!(got, payload);
    }

    #[test]
    fn cnp_round_trip() {
        let (s, d) = addrs();
        let mut bth = Bth::new(Opcode::Cnp as u8, 0x42, 0);
        bth.becn = true;
        let mut h = HeaderBuf::with_bth(&bth);
        h.push_zeros(16);
        let mut out = Vec::new();
        encode_into(&mut out, &h, &[], s, d);
        assert_eq!(out.len(), 12 + 16 + 4);
        let v = PacketView::parse(&out).unwrap();
        assert_eq!((v.opcode, v.bth.dest_qp, v.trailer.len()), (Opcode::Cnp, 0x42, 16));
        assert!(!v.opcode.is_request());
        PacketView::verify_icrc(&out, s, d).unwrap();
    }

    #[test]
    fn errors_not_panics() {
        assert!(matches!(PacketView::parse(&[]), Err(WireError::Truncated { .. })));
        let mut b = [0u8; 16];
        b[0] = 0x18;
        assert!(matches!(PacketView::parse(&b), Err(WireError::UnknownOpcode(0x18))));
        b[0] = Opcode::ReadRequest as u8;
        assert!(matches!(PacketView::parse(&b), Err(WireError::Truncated { .. })));
        b[0] = Opcode::SendOnly as u8;
        b[1] = 0x30; // pad 3 with no payload
        assert!(matches!(PacketView::parse(&b), Err(WireError::BadPad { .. })));
        assert!(matches!(
            PacketView::parse(&vec![0u8; MAX_DATAGRAM + 1]),
            Err(WireError::Oversized { .. })
        ));
    }
}
