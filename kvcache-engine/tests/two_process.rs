//! A prefill engine (this process) and a decode engine (a `kvcache-engine serve` process, P2P
//! metadata) over each transport: one LLM request's paged KV blocks go to the decode node's
//! pre-allocated blocks in one batch, the decode process prints the notification naming them,
//! and the blocks read back intact. Then a decode process killed in the middle of a batch: the
//! batch ends Failed with a message that names the peer and the cause, within seconds.

use kvcache_engine::kvcache::{blocks_landed, BlockOrder, PagedKvLayout};
use kvcache_engine::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

struct Decode {
    child: Child,
    lines: Receiver<String>,
    segment: String,
    pool_addr: u64,
}

impl Drop for Decode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn decode(t: TransportKind, pool: &str) -> Decode {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvcache-engine"))
        .args(["serve", "--transport", &t.to_string(), "--metadata", "P2PHANDSHAKE"])
        .args(["--advertise", "127.0.0.1", "--pool", pool])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting kvcache-engine");
    let out = child.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    let banner = lines
        .recv_timeout(Duration::from_secs(30))
        .expect("the decode engine's banner");
    let field = |k: &str| {
        banner
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")).map(str::to_string))
            .unwrap_or_else(|| panic!("{k} in {banner}"))
    };
    let pool_addr = u64::from_str_radix(field("pool_addr").trim_start_matches("0x"), 16).unwrap();
    Decode {
        segment: field("segment"),
        pool_addr,
        child,
        lines,
    }
}

fn prefill(t: TransportKind) -> TransferEngine {
    let mut c = EngineConfig::new("prefill", t);
    c.metadata = MetadataConfig::P2p;
    c.advertise_ip = Some(std::net::Ipv4Addr::LOCALHOST);
    c.transfer_timeout = Duration::from_secs(20);
    TransferEngine::new(c).unwrap()
}

fn blocks_to_decode_process(t: TransportKind) {
    let d = decode(t, "64MiB");
    let p = prefill(t);
    // 4 layers × 8 KV heads × head dim 128 × 16 tokens, fp16: 256 KiB blocks, vLLM layout
    let layout = PagedKvLayout {
        layers: 4,
        kv_heads: 8,
        head_dim: 128,
        block_tokens: 16,
        dtype_bytes: 2,
        num_blocks: 256,
        order: BlockOrder::LayerMajor,
    };
    assert_eq!(layout.pool_bytes(), 64 << 20);
    let src = p
        .allocate_memory(layout.pool_bytes() as usize, Location::Cpu(0))
        .unwrap();
    let check = p
        .allocate_memory(layout.pool_bytes() as usize, Location::Cpu(0))
        .unwrap();
    let data: Vec<u8> = (0..layout.pool_bytes()).map(|i| (i * 7 + (i >> 16)) as u8).collect();
    src.write(0, &data);
    let seg = p.open_segment(&d.segment).unwrap();
    // a 70-token request: 5 blocks, partly consecutive on both sides
    let (from, to) = ([3u32, 4, 5, 9, 200], [10u32, 11, 12, 40, 0]);
    assert_eq!(layout.blocks_for_tokens(70), from.len());
    let reqs = layout
        .transfer_requests(Opcode::Write, src.addr(), &from, seg, d.pool_addr, &to)
        .unwrap();
    assert!(reqs.len() < 5 * 8, "consecutive blocks merge: {} requests", reqs.len());
    let b = p.allocate_batch(reqs.len()).unwrap();
    p.submit_with_notify(b, &reqs, seg, &blocks_landed("req-42", &to))
        .unwrap();
    let s = p.wait_batch(b, Duration::from_secs(20)).unwrap();
    assert_eq!(s.state, TransferState::Completed, "{t}: {s:?}");
    // the decode process learns which blocks landed
    let line = d
        .lines
        .recv_timeout(Duration::from_secs(10))
        .expect("notification line");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let n: Notification = serde_json::from_value(v["notify"].clone()).unwrap();
    assert_eq!(
        kvcache_engine::kvcache::parse_blocks_landed(&n),
        Some(("req-42".to_string(), to.to_vec()))
    );
    // read the decode blocks back and compare chunk by chunk with the source blocks
    let back = layout
        .transfer_requests(Opcode::Read, check.addr(), &to, seg, d.pool_addr, &to)
        .unwrap();
    p.transfer_sync(seg, &back, None).unwrap();
    for (s, dd) in from.iter().zip(&to) {
        for ((so, len), (dof, _)) in layout.chunks(*s).into_iter().zip(layout.chunks(*dd)) {
            let mut got = vec![0u8; len as usize];
            check.read(dof as usize, &mut got);
            assert!(
                got == data[so as usize..][..len as usize],
                "{t}: block {s}→{dd} differs"
            );
        }
    }
}

#[test]
fn flexns_blocks_to_a_decode_process() {
    blocks_to_decode_process(TransportKind::Flexns);
}

#[test]
fn tcp_blocks_to_a_decode_process() {
    blocks_to_decode_process(TransportKind::Tcp);
}

fn peer_dies_mid_batch(t: TransportKind) {
    let mut d = decode(t, "512MiB");
    let p = prefill(t);
    let src = p.allocate_memory(512 << 20, Location::Cpu(0)).unwrap();
    let seg = p.open_segment(&d.segment).unwrap();
    let reqs: Vec<TransferRequest> = (0..128u64)
        .map(|i| TransferRequest {
            opcode: Opcode::Write,
            source: src.addr() + i * (4 << 20),
            target: seg,
            target_offset: d.pool_addr + i * (4 << 20),
            length: 4 << 20,
        })
        .collect();
    let b = p.allocate_batch(reqs.len()).unwrap();
    p.submit(b, &reqs).unwrap();
    d.child.kill().unwrap(); // SIGKILL in the middle of 512 MiB
    let start = Instant::now();
    let s = p.wait_batch(b, Duration::from_secs(30)).unwrap();
    let took = start.elapsed();
    match &s.state {
        TransferState::Failed(m) => {
            assert!(m.contains(&d.segment), "{t}: the message names the peer: {m}");
            eprintln!("{t}: failed after {took:?}: {m}");
        }
        other => panic!("{t}: expected Failed, got {other:?} after {took:?}"),
    }
    assert!(took < Duration::from_secs(15), "{t}: took {took:?}");
    assert!(s.transferred_bytes < 512 << 20);
    // the engine keeps serving: another batch to the dead peer fails fast too
    let e = p.transfer_sync_write(seg, src.addr(), d.pool_addr, 4096).unwrap_err();
    assert!(e.to_string().contains(&d.segment), "{e}");
}

#[test]
fn flexns_peer_dies_mid_batch() {
    peer_dies_mid_batch(TransportKind::Flexns);
}

#[test]
fn tcp_peer_dies_mid_batch() {
    peer_dies_mid_batch(TransportKind::Tcp);
}
