//! Concurrent reader/writer stress: a writer rewrites a small hot set of entries in place as
//! fast as it can while clients get them over every validating path. Every value returned must
//! be one that was written whole (no torn value), and never older than the last write that
//! finished before the get started (no stale value beyond the protocol).

use kv_store::client::{ClientConfig, GetPath, KvClient, Op};
use kv_store::server::{KvServer, ServerConfig};
use netstack::verbs::{Context, ContextConfig};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEYS: u32 = 32;

/// A 64-byte value: key, sequence number, and bytes derived from both.
fn value(k: u32, seq: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(64);
    v.extend_from_slice(&k.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend((0..52u64).map(|i| (seq.wrapping_mul(131) ^ (k as u64 * 7 + i)) as u8));
    v
}

/// The sequence number of a whole value of key `k`, or `None` for a torn or foreign one.
fn check(k: u32, v: &[u8]) -> Option<u64> {
    let seq = u64::from_le_bytes(v.get(4..12)?.try_into().ok()?);
    (v == value(k, seq)).then_some(seq)
}

#[test]
fn readers_never_see_torn_or_stale_values_while_a_writer_rewrites_entries() {
    let s = Arc::new(
        KvServer::start(ServerConfig {
            capacity: 1024,
            data_bytes: 1 << 20,
            hot_entries: 16,
            hot_admit: 2,
            ..Default::default()
        })
        .unwrap(),
    );
    let acked: Arc<Vec<AtomicU64>> = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
    for k in 0..KEYS {
        s.put(&k.to_le_bytes(), &value(k, 0)).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (s, acked, stop) = (s.clone(), acked.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                let k = (seq % KEYS as u64) as u32;
                s.put(&k.to_le_bytes(), &value(k, seq)).unwrap();
                acked[k as usize].store(seq, Ordering::Release);
            }
            seq
        })
    };
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let secs = 1.5;
    let mut total = 0u64;
    let mut torn_reread = 0u64;
    for path in paths() {
        let mut c = KvClient::connect(
            &ctx,
            ClientConfig {
                servers: vec![s.cm_addr()],
                depth: 8,
                get_path: path,
                ..Default::default()
            },
        )
        .unwrap();
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut n = 0u64;
        let mut i = 0u32;
        while Instant::now() < end {
            let keys: Vec<u32> = (0..16).map(|j| (i + j * 5) % KEYS).collect();
            i += 1;
            let floor: Vec<u64> = keys
                .iter()
                .map(|&k| acked[k as usize].load(Ordering::Acquire))
                .collect();
            let r = c.execute(keys.iter().map(|k| Op::Get(k.to_le_bytes().to_vec())).collect());
            for ((k, r), floor) in keys.iter().zip(r).zip(floor) {
                let v = r
                    .unwrap_or_else(|e| panic!("{path}: {e}: client {:?} server {:?}", c.stats(), s.stats()))
                    .expect("loaded key");
                let seq = check(*k, &v).unwrap_or_else(|| panic!("{path}: torn value for key {k}: {v:?}"));
                assert!(seq >= floor, "{path}: stale value for key {k}: seq {seq} < {floor}");
                n += 1;
            }
        }
        let st = c.stats();
        eprintln!("{path}: {n} gets verified, {st:?}");
        assert!(n > 100, "{path}: only {n} gets");
        total += n;
        torn_reread += st.torn;
    }
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    eprintln!(
        "{total} gets verified against {writes} in-place writes; server {:?}",
        s.stats().store
    );
    assert!(writes > 1000);
    // the test means something only if readers met writes in progress: copies that were torn,
    // detected (versions, CRC) and read again
    assert!(
        torn_reread > 0,
        "no get met a write in progress ({total} gets, {writes} writes): the race was not exercised"
    );
}

fn paths() -> Vec<GetPath> {
    match std::env::var("KV_TORN_PATHS") {
        Ok(p) => p
            .split(',')
            .map(|p| clap::ValueEnum::from_str(p, true).unwrap())
            .collect(),
        Err(_) => vec![GetPath::A1, GetPath::Offload, GetPath::Hybrid, GetPath::Redn],
    }
}
