//! Seeded cross-thread stress of the notification pipe: small rings wrap hundreds of thousands
//! of times while the producer bursts and the consumer sleeps on the eventfd; every slot must
//! arrive exactly once, in order, intact. `PIPE_SEED=N` replays one configuration
//! (`cargo test -p netstack --lib pipe::stress`).

use super::pipe;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

#[derive(Clone, Copy)]
struct Msg {
    seq: u64,
    words: [u64; 6],
}

fn words(seq: u64) -> [u64; 6] {
    std::array::from_fn(|i| seq.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(i as u32 * 7) ^ i as u64)
}

fn run(seed: u64, n: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let cap = 1usize << rng.random_range(1..7);
    let publish_every = rng.random_range(1..=cap.max(2) / 2);
    let sleepy = rng.random_bool(0.5);
    let (mut p, mut c) = pipe::<Msg>(cap, publish_every).unwrap();
    let prod_seed = rng.random::<u64>();
    let producer = std::thread::spawn(move || {
        let mut rng = StdRng::seed_from_u64(prod_seed);
        let mut seq = 0;
        while seq < n {
            let burst = rng.random_range(1..64);
            for _ in 0..burst {
                if seq == n {
                    break;
                }
                let m = Msg { seq, words: words(seq) };
                while p.try_push(m).is_err() {
                    p.notify();
                    std::thread::yield_now();
                }
                seq += 1;
            }
            p.notify();
            if rng.random_bool(0.01) {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut want = 0;
    while want < n {
        match c.pop() {
            Some(m) => {
                assert_eq!(
                    m.seq, want,
                    "seed {seed}: cap {cap} publish_every {publish_every}: slot lost or duplicated"
                );
                assert_eq!(m.words, words(m.seq), "seed {seed}: torn slot");
                want += 1;
            }
            None if sleepy => c.sleep(5_000_000),
            None => std::thread::yield_now(),
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: consumer stalled at {want} (lost wakeup?)"
        );
    }
    producer.join().unwrap();
    assert!(c.pop().is_none(), "seed {seed}: extra slot");
}

#[test]
fn pipes_never_lose_or_duplicate_a_slot_under_concurrent_wrap() {
    if let Ok(s) = std::env::var("PIPE_SEED") {
        return run(s.parse().expect("PIPE_SEED is a number"), 2_000_000);
    }
    for seed in 0..24 {
        run(seed, 200_000);
    }
}
