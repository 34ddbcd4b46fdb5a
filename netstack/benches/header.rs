//! Per-packet cost of building RoCEv2 headers and computing the ICRC over header and payload.

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

criterion_group!(benches, header_and_icrc);
criterion_main!(benches);
