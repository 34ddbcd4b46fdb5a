//! Cost of congestion-control events: one DCQCN TX event plus one RX event (CE-marked data at
//! the notification point, or a CNP at the reaction point).

use criterion::{criterion_group, criterion_main, Criterion};
use netstack::cc::dcqcn::{Dcqcn, DcqcnParams};
use netstack::cc::{CcAlgorithm, CcOutput, RxKind, RxMeta};
use std::hint::black_box;
use std::sync::Arc;

fn dcqcn_events(c: &mut Criterion) {
    let mut d = Dcqcn::new(Arc::new(DcqcnParams::default()));
    d.on_start(0, &mut CcOutput::default());
    let mut now = 0u64;
    c.bench_function("dcqcn_tx_plus_rx_data_event", |b| {
        b.iter(|| {
            now += 100;
            let mut out = CcOutput::default();
            d.on_tx(now, black_box(4112), &mut out);
            d.on_rx(
                now,
                black_box(&RxMeta {
                    kind: RxKind::Data,
                    bytes: 4112,
                    ce: now.is_multiple_of(7),
                    rtt_ns: None,
                }),
                &mut out,
            );
            black_box(out)
        })
    });
    c.bench_function("dcqcn_tx_plus_cnp_event", |b| {
        b.iter(|| {
            now += 100;
            let mut out = CcOutput::default();
            d.on_tx(now, black_box(4112), &mut out);
            d.on_rx(
                now,
                black_box(&RxMeta {
                    kind: RxKind::Cnp,
                    bytes: 32,
                    ce: false,
                    rtt_ns: None,
                }),
                &mut out,
            );
            black_box(out)
        })
    });
}

criterion_group!(benches, dcqcn_events);
criterion_main!(benches);
