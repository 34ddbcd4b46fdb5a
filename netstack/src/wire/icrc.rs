//! The RoCEv2 invariant CRC (ICRC): CRC-32 (IEEE 802.3, the zlib polynomial, *not* CRC-32C)
//! over 8 bytes of 0xFF standing for the masked LRH, the IPv4 header with TOS, TTL and header
//! checksum masked to ones, the UDP header with its checksum masked to ones, the BTH with byte 4
//! (FECN/BECN/reserved) masked to ones, then the remaining headers, payload and pad. It is
//! appended little-endian. The IPv4 identification is covered, so senders use DF with an
//! unconnected socket, which makes Linux send IP ID 0 (see `link::udp`).

use std::net::SocketAddrV4;

/// Length of the ICRC trailer.
pub const ICRC_LEN: usize = 4;

/// Computes the ICRC of a RoCEv2 packet sent from `src` to `dst`. `parts` concatenated are the
/// UDP payload up to (not including) the ICRC, starting with the BTH; splitting it lets a sender
/// checksum a header buffer and an application payload without copying them together.
pub fn compute(src: SocketAddrV4, dst: SocketAddrV4, parts: &[&[u8]]) -> u32 {
    let body: usize = parts.iter().map(|p| p.len()).sum();
    let udp_len = (8 + body + ICRC_LEN) as u16;
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
    let mut first = true;
    for p in parts {
        if first && p.len() >= 5 {
            // mask BTH byte 4 without copying the rest of the part
            h.update(&p[..4]);
            h.update(&[0xFF]);
            h.update(&p[5..]);
        } else {
            h.update(p);
        }
        first = false;
    }
    h.finalize()
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
        let body: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        let whole = compute(src, dst, &[&body]);
        assert_eq!(
            whole,
            compute(src, dst, &[&body[..12], &body[12..100], &body[100..]])
        );
        // byte 4 of the BTH is masked: FECN/BECN changes in flight do not change the ICRC
        let mut b2 = body.clone();
        b2[4] = 0x80;
        assert_eq!(whole, compute(src, dst, &[&b2]));
        b2[5] ^= 1;
        assert_ne!(whole, compute(src, dst, &[&b2]));
    }
}
