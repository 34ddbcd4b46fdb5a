//! Per-packet cost of building RoCEv2 headers and computing the ICRC over header and payload;
//! on receive, the ICRC check and the payload's copy as two passes and as one; copy and CRC
//! folded in pieces into and out of registered memory.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netstack::wire::*;
use std::hint::black_box;
use std::net::SocketAddrV4;

fn header_and_icrc(c: &mut Criterion) {
    let src: SocketAddrV4 = "10.0.0.1:49152".parse().unwrap();
    let dst: SocketAddrV4 = "10.0.0.2:4791".parse().unwrap();
    let mut g = c.benchmark_group("tx_packet");
    for len in [64usize, 1024, 4096] {
        let payload = vec![0xA5u8; len];
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(format!("write_middle_{len}B"), |b| {
            let mut psn = 0u32;
            b.iter(|| {
                psn = psn.wrapping_add(1);
                let mut h = HeaderBuf::with_bth(&Bth::new(Opcode::WriteMiddle as u8, 0x1234, psn));
                let pad = h.set_pad_for(payload.len());
                let mut c = icrc::Icrc::new(src, dst, h.len() + payload.len() + pad);
                c.update(h.as_bytes());
                c.update(black_box(&payload));
                c.update(&PAD_ZEROS[..pad]);
                black_box((h, c.finish()))
            })
        });
    }
    g.bench_function("parse_and_verify_4096B", |b| {
        let mut h = HeaderBuf::with_bth(&Bth::new(Opcode::WriteMiddle as u8, 0x1234, 7));
        h.set_pad_for(4096);
        let mut pkt = Vec::new();
        encode_into(&mut pkt, &h, &[&[0x5Au8; 4096]], src, dst);
        b.iter(|| {
            let v = PacketView::parse(black_box(&pkt)).unwrap();
            PacketView::verify_icrc(&pkt, src, dst).unwrap();
            black_box(v.bth.psn)
        })
    });
    g.finish();
}

/// Receive: a staging set of 4 KiB WRITE-middle packets (2 MiB, as the engine's default, so
/// each packet comes from beyond the L2 cache as after a `recvmmsg`), each checked and its
/// payload copied to a 2 MiB destination: the ICRC pass then the copy, or both in one pass
/// (`verify_icrc_placing`).
fn verify_and_place(c: &mut Criterion) {
    let src: SocketAddrV4 = "10.0.0.1:49152".parse().unwrap();
    let dst: SocketAddrV4 = "10.0.0.2:4791".parse().unwrap();
    const N: usize = 512;
    let pkts: Vec<Vec<u8>> = (0..N)
        .map(|i| {
            let mut h = HeaderBuf::with_bth(&Bth::new(Opcode::WriteMiddle as u8, 0x1234, i as u32));
            h.set_pad_for(4096);
            let mut pkt = Vec::new();
            encode_into(&mut pkt, &h, &[&[i as u8; 4096]], src, dst);
            pkt
        })
        .collect();
    let mut dest = vec![0u8; N * 4096];
    let mut g = c.benchmark_group("rx_packet");
    g.throughput(Throughput::Bytes(4096));
    g.bench_function("verify_then_copy_4096B", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % N;
            let d = &pkts[i];
            let v = PacketView::parse(black_box(d)).unwrap();
            PacketView::verify_icrc(d, src, dst).unwrap();
            dest[i * 4096..(i + 1) * 4096].copy_from_slice(v.payload);
        })
    });
    g.bench_function("verify_placing_4096B", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % N;
            let d = &pkts[i];
            let v = PacketView::parse(black_box(d)).unwrap();
            let at = &mut dest[i * 4096..(i + 1) * 4096];
            v.verify_icrc_placing(d, src, dst, |o, p| at[o..o + p.len()].copy_from_slice(p))
                .unwrap();
        })
    });
    g.finish();
}

/// Copy and CRC as two passes and as one, with registered memory on the other side as in
/// the engine (byte-wise atomic copies through `mem::Region`), 4 KiB (one MTU) per packet
/// from 2 MiB of sources, so each comes from beyond the L2 cache:
/// - `rx_*`: a received payload (private staging memory) checksummed and placed into a
///   region: the whole CRC then the whole copy, or folded and copied in pieces of 1 KiB or of
///   `FOLD_CHUNK` (`Icrc::update_copying`);
/// - `tx_snapshot_*`: a READ response's payload snapshotted out of a region with its ICRC:
///   through a private chunk then into the snapshot (`chunks` + `write`: two copies), or
///   straight into the snapshot, checksummed there while hot (`copy_folding`: one copy).
fn fold_copy(c: &mut Criterion) {
    use netstack::mem::Region;
    let src: SocketAddrV4 = "10.0.0.1:49152".parse().unwrap();
    let dst: SocketAddrV4 = "10.0.0.2:4791".parse().unwrap();
    const N: usize = 512;
    const P: usize = 4096;
    let staged: Vec<u8> = (0..N * P).map(|i| (i * 7 + i / 4096) as u8).collect();
    let dest = Region::alloc(N * P);
    let mut g = c.benchmark_group("fold_copy");
    g.throughput(Throughput::Bytes(P as u64));
    g.bench_function("rx_crc_then_copy_4096B", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % N;
            let p = &staged[i * P..(i + 1) * P];
            let mut c = icrc::Icrc::new(src, dst, P);
            c.update(black_box(p));
            dest.write(i * P, p);
            black_box(c.finish())
        })
    });
    for piece in [1024usize, icrc::FOLD_CHUNK] {
        g.bench_function(format!("rx_folded_{piece}B_pieces_4096B"), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % N;
                let p = &staged[i * P..(i + 1) * P];
                let mut c = icrc::Icrc::new(src, dst, P);
                if piece == icrc::FOLD_CHUNK {
                    c.update_copying(black_box(p), |o, q| dest.write(i * P + o, q));
                } else {
                    for (k, q) in black_box(p).chunks(piece).enumerate() {
                        c.update(q);
                        dest.write(i * P + k * piece, q);
                    }
                }
                black_box(c.finish())
            })
        });
    }
    let source = Region::alloc(N * P);
    source.write(0, &staged);
    let snap = Region::alloc(P);
    g.bench_function("tx_snapshot_chunk_then_write_4096B", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % N;
            let mut c = icrc::Icrc::new(src, dst, P);
            source.chunks(i * P, P, |k, q| {
                c.update(q);
                snap.write(k, q);
            });
            black_box(c.finish())
        })
    });
    g.bench_function("tx_snapshot_copy_folding_4096B", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % N;
            let mut c = icrc::Icrc::new(src, dst, P);
            // SAFETY: `snap` is this benchmark's own, reached by nothing else.
            unsafe { source.copy_folding(i * P, P, &snap, 0, |_, q| c.update(q)) };
            black_box(c.finish())
        })
    });
    g.finish();
}

criterion_group!(benches, header_and_icrc, verify_and_place, fold_copy);
criterion_main!(benches);
