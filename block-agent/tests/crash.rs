//! kill -9 of a process writing to a volume store, at a random instant, three times over: every
//! write the process saw acknowledged reads back identical after the store is reopened (the log
//! replays it), including crashes in the middle of a checkpoint (a small log limit makes them
//! frequent). The test runs itself as the writing child process.

use block_agent::store::{VolumeStore, BLOCK};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BLOCKS: u64 = 2048;
const NAME: &str = "kill_dash_nine_loses_no_acknowledged_write";

fn pattern(lba: u64, version: u64) -> Vec<u8> {
    let mut x = lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The child: writes until killed, printing each acknowledged write.
fn child(dir: &str, round: u64) -> ! {
    let s = std::sync::Arc::new(VolumeStore::open(std::path::Path::new(dir), 1, 4 << 20).unwrap());
    let out = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (s, out) = (s.clone(), out.clone());
            std::thread::spawn(move || {
                let mut x = t * 7919 + round * 104_729 + 1;
                for i in 0u64.. {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    // each thread owns the blocks ≡ t mod 4: no two writes to a block in flight
                    let lba = ((x >> 33) % (BLOCKS / 4)) * 4 + t;
                    let version = (round << 40) | (i << 2) | t;
                    let b = pattern(lba, version);
                    s.write(lba, &b, crc32c::crc32c(&b), version).unwrap();
                    let mut o = out.lock().unwrap();
                    writeln!(o, "ACK {lba} {version}").unwrap();
                    o.flush().unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    std::process::exit(0)
}

#[test]
fn kill_dash_nine_loses_no_acknowledged_write() {
    if let (Ok(dir), Ok(round)) = (std::env::var("BLOCKSTORE_CHILD_DIR"), std::env::var("BLOCKSTORE_ROUND")) {
        child(&dir, round.parse().unwrap());
    }
    let dir = std::env::temp_dir().join(format!("blockstore-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    drop(VolumeStore::create(&dir, 1, BLOCKS, 4 << 20).unwrap());
    let mut acked: HashMap<u64, u64> = HashMap::new();
    for round in 1..=3u64 {
        let mut c = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env("BLOCKSTORE_CHILD_DIR", &dir)
            .env("BLOCKSTORE_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = c.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        // kill at a different instant each round, once writes are flowing
        let mut n = 0;
        let until = Instant::now() + Duration::from_millis(200 + 150 * round);
        let record = |l: String, acked: &mut HashMap<u64, u64>, n: &mut u64| {
            if let Some(rest) = l.strip_prefix("ACK ") {
                let mut it = rest.split(' ').map(|x| x.parse::<u64>().unwrap());
                let (lba, v) = (it.next().unwrap(), it.next().unwrap());
                let e = acked.entry(lba).or_insert(0);
                *e = (*e).max(v);
                *n += 1;
            }
        };
        while Instant::now() < until || n < 50 {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(l) => record(l, &mut acked, &mut n),
                Err(_) => panic!("the writer stopped acknowledging"),
            }
        }
        c.kill().unwrap(); // SIGKILL
        c.wait().unwrap();
        reader.join().unwrap();
        while let Ok(l) = rx.try_recv() {
            record(l, &mut acked, &mut n);
        }
        // every acknowledged write is there: that version or a later one of the same block
        let s = VolumeStore::open(&dir, 1, 4 << 20).unwrap();
        for (&lba, v) in acked.iter_mut() {
            let (data, _, got) = s.read(lba).unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert!(
                got >= *v,
                "round {round}: block {lba} has version {got}, acknowledged {v}"
            );
            assert!(data == pattern(lba, got), "round {round}: block {lba} data");
            *v = got; // a later write may be durable with its ACK line not printed yet
        }
        eprintln!(
            "round {round}: {n} acknowledged writes, {} blocks checked, replayed {}",
            acked.len(),
            s.stats().replayed
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
