//! Cross-thread cost of one pipe slot (producer and consumer on two threads).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netstack::pipe::pipe;

#[derive(Clone, Copy)]
struct Wqe([u64; 7]);

fn cross_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("pipe");
    const N: u64 = 100_000;
    g.throughput(Throughput::Elements(N));
    g.bench_function("cross_thread_56B_slots", |b| {
        b.iter_custom(|iters| {
            let total = iters * N;
            let (mut p, mut cons) = pipe::<Wqe>(1024, 64).unwrap();
            let t = std::thread::spawn(move || {
                let mut got = 0;
                while got < total {
                    if let Some(w) = cons.pop() {
                        std::hint::black_box(w.0);
                        got += 1;
                    } else {
                        std::hint::spin_loop();
                    }
                }
            });
            let start = std::time::Instant::now();
            for i in 0..total {
                while p.try_push(Wqe([i; 7])).is_err() {
                    std::hint::spin_loop();
                }
            }
            t.join().unwrap();
            start.elapsed()
        })
    });
    g.finish();
}

criterion_group!(benches, cross_thread);
criterion_main!(benches);
