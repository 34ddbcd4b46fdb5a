//! A daemon asked to stop exits even while a client holds a gRPC connection open: tonic's
//! graceful shutdown waits for every connection to close, and a client that vanished without
//! closing (its FIN lost on a lossy link, its host gone) used to keep `block-control` running
//! forever after SIGTERM.

use block_agent::control::pb::block_control_client::BlockControlClient;
use block_agent::control::pb::ListRequest;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_controller_stops_within_the_drain_bound_with_a_client_connected() {
    let dir = std::env::temp_dir().join(format!("block-stop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_block-control"))
        .args(["--listen", "127.0.0.1:0", "--state"])
        .arg(dir.join("control.json"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("block-control starts");
    let mut banner = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    let addr = banner
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("control="))
        .unwrap_or_else(|| panic!("banner {banner:?}"))
        .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // a client with its HTTP/2 connection open, kept (never closed) for the whole test
    let _client = rt.block_on(async {
        let mut c = BlockControlClient::connect(format!("http://{addr}")).await.unwrap();
        c.list(ListRequest {}).await.unwrap();
        c
    });
    let t = Instant::now();
    sigterm(child.id());
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("block-control still running 10 s after SIGTERM with a client connected");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t.elapsed();
    assert!(status.success(), "{status}");
    // the drain bound (2 s) plus slack for a busy machine
    assert!(took < Duration::from_secs(5), "stopped after {took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM through kill(1) (this test has no `unsafe`).
fn sigterm(pid: u32) {
    let st = Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
    assert!(st.success());
}
