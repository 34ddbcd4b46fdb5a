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

    /// The ICRC of everything fed in.
    pub fn finish(self) -> u32 {
        self.h.finalize()
    }
}

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
