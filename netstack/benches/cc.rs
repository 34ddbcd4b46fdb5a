//! Cost of congestion-control events: one TX event plus one RX event per algorithm (DCQCN:
//! CE-marked data at the notification point, or a CNP at the reaction point; HPCC: an ACK with
//! one INT hop; Swift: an ACK with an RTT sample; Homa: a data packet at the receiver).

use criterion::{criterion_group, criterion_main, Criterion};
use netstack::cc::header::{IntHop, IntStack, INT_STACK_LEN};
use netstack::cc::{CcAlgorithm, CcEnv, CcKind, CcOutput, RxKind, RxMeta, StartInfo, TxMeta};
use std::hint::black_box;

const TX: TxMeta = TxMeta {
    opcode: 0x07,
    bytes: 4112,
    payload: 4096,
    first: false,
    msg_bytes: 1 << 20,
    msg_remaining: 1 << 19,
    retransmit: false,
};

fn start(kind: CcKind) -> Box<dyn CcAlgorithm> {
    let mut a = kind.build(&CcEnv::default_env()).expect("an algorithm");
    a.on_start(0, &StartInfo { mtu: 4096 }, &mut CcOutput::default());
    a
}

fn events(c: &mut Criterion) {
    let mut now = 0u64;
    let mut d = start(CcKind::Dcqcn);
    c.bench_function("dcqcn_tx_plus_rx_data_event", |b| {
        b.iter(|| {
            now += 100;
            let mut out = CcOutput::default();
            d.on_tx(now, black_box(&TX), &mut out);
            let m = RxMeta {
                ce: now.is_multiple_of(7),
                ..RxMeta::plain(RxKind::Data, 4112)
            };
            d.on_rx(now, black_box(&m), &mut out);
            black_box(out)
        })
    });
    c.bench_function("dcqcn_tx_plus_cnp_event", |b| {
        b.iter(|| {
            now += 100;
            let mut out = CcOutput::default();
            d.on_tx(now, black_box(&TX), &mut out);
            d.on_rx(now, black_box(&RxMeta::plain(RxKind::Cnp, 32)), &mut out);
            black_box(out)
        })
    });
    let mut h = start(CcKind::Hpcc);
    let mut int = [0u8; INT_STACK_LEN];
    c.bench_function("hpcc_tx_plus_int_ack_event", |b| {
        b.iter(|| {
            now += 100;
            int[0] = 0;
            let hop = IntHop {
                qlen: (now % 50_000) as u32,
                tx_bytes: (now * 12) as u32,
                ts_ns: now as u32,
                rate_mbps: 100_000,
            };
            IntStack::push_hop(&mut int, &hop);
            let mut out = CcOutput::default();
            h.on_tx(now, black_box(&TX), &mut out);
            let m = RxMeta {
                cc: &int,
                ..RxMeta::plain(RxKind::Ack, 64)
            };
            h.on_rx(now, black_box(&m), &mut out);
            black_box(out)
        })
    });
    let mut s = start(CcKind::Swift);
    c.bench_function("swift_tx_plus_ack_event", |b| {
        b.iter(|| {
            now += 100;
            let mut out = CcOutput::default();
            s.on_tx(now, black_box(&TX), &mut out);
            let m = RxMeta {
                rtt_ns: Some(20_000 + now % 20_000),
                payload: 4096,
                ..RxMeta::plain(RxKind::Ack, 64)
            };
            s.on_rx(now, black_box(&m), &mut out);
            black_box(out)
        })
    });
}

criterion_group!(benches, events);
criterion_main!(benches);
