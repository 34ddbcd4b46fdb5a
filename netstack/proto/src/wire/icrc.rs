//! The RoCEv2 invariant CRC (ICRC): CRC-32 (IEEE 802.3, the zlib polynomial, *not* CRC-32C)
//! over 8 bytes of 0xFF standing for the masked LRH, the IPv4 header with TOS, TTL and header
//! checksum masked to ones, the UDP header with its checksum masked to ones, the BTH with byte 4
//! (FECN/BECN/reserved) masked to ones, then the remaining headers, payload and pad. The
//! congestion-control header after the BTH (flexns' extension, length in byte 4) is masked to
//! ones too: switches rewrite it in flight (HPCC's INT records), like the other variant fields. It is
//! appended little-endian. The IPv4 identification is covered, so senders use DF with an
//! unconnected socket, which makes Linux send IP ID 0 (see `link::udp`).

use std::net::SocketAddrV4;

/// Length of the ICRC trailer.
pub const ICRC_LEN: usize = 4;

/// Incremental ICRC: seed it with the addresses and the UDP payload length, feed the bytes
/// (the BTH first) in any number of pieces, then finish.
pub struct Icrc {
    h: crc32fast::Hasher,
    /// Bytes fed so far (to find BTH byte 4 and the CC header across pieces).
    fed: usize,
    /// End of the CC header (known once BTH byte 4 was fed; masked bytes end there).
    cc_end: usize,
}

/// Ones fed in place of masked bytes (a CC length field can claim up to 31 words).
const ONES: [u8; 128] = [0xFF; 128];

impl Icrc {
    /// `body_len` is the UDP payload length without the ICRC (headers, payload and pad).
    pub fn new(src: SocketAddrV4, dst: SocketAddrV4, body_len: usize) -> Icrc {
        let udp_len = (8 + body_len + ICRC_LEN) as u16;
        let ip_len = 20 + udp_len;
        let mut pseudo = [0u8; 8 + 20 + 8];
        pseudo[..8].fill(0xFF);
        let ip = &mut pseudo[8..28];
        ip[0] = 0x45;
        ip[1] = 0xFF; // TOS masked
        ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
        // identification 0, flags DF, fragment offset 0
        ip[6] = 0x40;
        ip[8] = 0xFF; // TTL masked
        ip[9] = 17; // UDP
        ip[10] = 0xFF; // header checksum masked
        ip[11] = 0xFF;
        ip[12..16].copy_from_slice(&src.ip().octets());
        ip[16..20].copy_from_slice(&dst.ip().octets());
        let udp = &mut pseudo[28..36];
        udp[0..2].copy_from_slice(&src.port().to_be_bytes());
        udp[2..4].copy_from_slice(&dst.port().to_be_bytes());
        udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
        udp[6] = 0xFF; // UDP checksum masked
        udp[7] = 0xFF;
        let mut h = crc32fast::Hasher::new();
        h.update(&pseudo);
        Icrc { h, fed: 0, cc_end: 12 }
    }

    /// Feeds the next bytes of the UDP payload.
    pub fn update(&mut self, mut b: &[u8]) {
        while !b.is_empty() {
            let f = self.fed;
            if f >= self.cc_end {
                self.h.update(b);
                self.fed += b.len();
                return;
            }
            // regions before the payload: [0,4) plain, 4 masked (FECN/BECN/CC length),
            // [5,12) plain, [12, cc_end) the masked CC header
            let (end, masked) = match f {
                0..4 => (4, false),
                4 => {
                    self.cc_end = 12 + (b[0] & 0x1F) as usize * 4;
                    (5, true)
                }
                5..12 => (12, false),
                _ => (self.cc_end, true),
            };
            let n = (end - f).min(b.len());
            if masked {
                self.h.update(&ONES[..n]);
            } else {
                self.h.update(&b[..n]);
            }
            self.fed += n;
            b = &b[n..];
        }
    }

    /// Feeds `src` (the next bytes of the UDP payload) and hands the same bytes to `copy` in
    /// pieces of at most [`FOLD_CHUNK`] bytes, each right after the CRC read it, so the copy
    /// reads bytes still in the L1 cache and the bytes come from memory once: copy and CRC in
    /// one pass over memory (the software form of zlib-ng's `crc32_fold_copy` and Linux's
    /// `skb_copy_and_crc32c_datagram_iter`). `copy` gets each piece's offset in `src` and its
    /// bytes; it is where the destination is written, through raw pointers when that is
    /// registered memory (this crate holds no `unsafe`: netstack's `mem::Region::write`).
    /// Masked header bytes reach `copy` as they are, only the CRC sees them as ones.
    pub fn update_copying(&mut self, src: &[u8], mut copy: impl FnMut(usize, &[u8])) {
        for (i, piece) in src.chunks(FOLD_CHUNK).enumerate() {
            self.update(piece);
            copy(i * FOLD_CHUNK, piece);
        }
    }

    /// The ICRC of everything fed in.
    pub fn finish(self) -> u32 {
        self.h.finalize()
    }
}

/// The piece [`Icrc::update_copying`] folds then copies at a time: small enough that the
/// copy finds it in the L1 cache (48 KiB of data cache on this project's machines) after
/// the CRC read it, large enough that crc32fast's folding (VPCLMULQDQ from 2 KiB) runs at
/// full speed and each piece's bounds check is amortized (`cargo bench -p netstack --bench
/// header -- fold_copy`, 2-core VM, a 4 KiB payload from beyond L2 into registered memory:
/// 331 ns in 4 KiB pieces, 408 ns in 1 KiB pieces, 343 ns as a whole CRC then a whole copy).
pub const FOLD_CHUNK: usize = 4096;

/// Computes the ICRC of a RoCEv2 packet sent from `src` to `dst`. `parts` concatenated are the
/// UDP payload up to (not including) the ICRC, starting with the BTH.
pub fn compute(src: SocketAddrV4, dst: SocketAddrV4, parts: &[&[u8]]) -> u32 {
    let mut c = Icrc::new(src, dst, parts.iter().map(|p| p.len()).sum());
    for p in parts {
        c.update(p);
    }
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_ieee_not_castagnoli() {
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn split_parts_equal_one_part() {
        let src: SocketAddrV4 = "127.0.0.1:49152".parse().unwrap();
        let dst: SocketAddrV4 = "127.0.0.2:4791".parse().unwrap();
        let mut body: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        body[4] = 0; // no CC header
        let whole = compute(src, dst, &[&body]);
        assert_eq!(whole, compute(src, dst, &[&body[..12], &body[12..100], &body[100..]]));
        // byte 4 of the BTH is masked: FECN/BECN changes in flight do not change the ICRC
        let mut b2 = body.clone();
        b2[4] = 0x80;
        assert_eq!(whole, compute(src, dst, &[&b2]));
        b2[5] ^= 1;
        assert_ne!(whole, compute(src, dst, &[&b2]));
    }

    /// Feeds `body` as `head` plain bytes then the rest through [`Icrc::update_copying`], whose
    /// pieces land in `out` from `at`; returns the ICRC.
    fn fold_copy_into(
        src: SocketAddrV4,
        dst: SocketAddrV4,
        body: &[u8],
        head: usize,
        out: &mut [u8],
        at: usize,
    ) -> u32 {
        let mut c = Icrc::new(src, dst, body.len());
        c.update(&body[..head]);
        let mut next = 0;
        c.update_copying(&body[head..], |o, piece| {
            assert_eq!(o, next, "pieces come in order, without gaps");
            assert!(piece.len() <= FOLD_CHUNK && !piece.is_empty());
            next += piece.len();
            out[at + o..at + o + piece.len()].copy_from_slice(piece);
        });
        assert_eq!(next, body.len() - head, "every byte is copied");
        c.finish()
    }

    #[test]
    fn fold_copy_equals_copy_then_crc_at_chunk_edges() {
        let src: SocketAddrV4 = "10.0.0.1:49152".parse().unwrap();
        let dst: SocketAddrV4 = "10.0.0.2:4791".parse().unwrap();
        for len in [
            0usize,
            1,
            7,
            12,
            13,
            FOLD_CHUNK - 1,
            FOLD_CHUNK,
            FOLD_CHUNK + 1,
            3 * FOLD_CHUNK + 5,
        ] {
            let mut body: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            if len > 4 {
                body[4] = 1; // a 4-byte CC header: masked for the CRC, copied as it is
            }
            for at in [0usize, 1, 3, 8] {
                let mut out = vec![0xEEu8; len + 16];
                let got = fold_copy_into(src, dst, &body, 0, &mut out, at);
                assert_eq!(got, compute(src, dst, &[&body]), "len {len} at {at}");
                assert_eq!(&out[at..at + len], &body[..], "len {len} at {at}");
                assert!(
                    out[..at].iter().chain(&out[at + len..]).all(|&b| b == 0xEE),
                    "nothing outside"
                );
            }
        }
    }

    proptest::proptest! {
        /// Any length, any split between plain and copying updates, any destination offset:
        /// the destination holds the source and the ICRC is that of the separate copy + CRC.
        #[test]
        fn fold_copy_equals_separate_copy_and_crc(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3 * FOLD_CHUNK + 100),
            head_pick in proptest::prelude::any::<usize>(),
            at in 0usize..64,
            cc in 0u8..4,
        ) {
            let src: SocketAddrV4 = "192.168.1.1:50000".parse().unwrap();
            let dst: SocketAddrV4 = "192.168.1.2:4791".parse().unwrap();
            let mut body = body;
            if body.len() > 4 {
                body[4] = cc;
            }
            let head = head_pick % (body.len() + 1);
            let mut out = vec![0u8; body.len() + at];
            let got = fold_copy_into(src, dst, &body, head, &mut out, at);
            // the separate passes: a copy, then crc32fast over the datagram
            let mut copied = vec![0u8; body.len()];
            copied.copy_from_slice(&body);
            proptest::prop_assert_eq!(got, compute(src, dst, &[&copied]));
            // the copying updates placed the bytes after `head` at `at`, nothing else
            proptest::prop_assert_eq!(&out[at..at + body.len() - head], &copied[head..]);
            proptest::prop_assert!(out[..at].iter().chain(&out[at + body.len() - head..]).all(|&b| b == 0));
        }
    }

    #[test]
    fn cc_header_is_masked_in_any_split() {
        let src: SocketAddrV4 = "10.0.0.1:49152".parse().unwrap();
        let dst: SocketAddrV4 = "10.0.0.2:4791".parse().unwrap();
        let mut body: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
        body[4] = 2; // 8-byte CC header at 12..20
        let whole = compute(src, dst, &[&body]);
        for split in 0..body.len() {
            assert_eq!(
                whole,
                compute(src, dst, &[&body[..split], &body[split..]]),
                "split {split}"
            );
        }
        let mut b2 = body.clone();
        b2[12..20].fill(0x5A); // a switch rewrote the CC header
        assert_eq!(whole, compute(src, dst, &[&b2]));
        b2[20] ^= 1; // but the bytes after it are covered
        assert_ne!(whole, compute(src, dst, &[&b2]));
    }
}
