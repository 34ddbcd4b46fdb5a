//! A block-agent process paused past its etcd lease (SIGSTOP: what a long GC pause, a frozen
//! VM or a partition does) comes back after a successor registered its name: it leaves the
//! successor's key alone and stops, saying why, rather than serve beside it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn signal(sig: &str, pid: u32) {
    let st = Command::new("kill").args([sig, &pid.to_string()]).status().unwrap();
    assert!(st.success(), "kill {sig} {pid}");
}

#[test]
fn a_paused_agent_whose_key_a_successor_took_stops() {
    if !etcd_lite::local::installed() {
        test_support::skip(
            "block-agent etcd loss",
            test_support::Missing::Tool,
            "etcd is not installed (scripts/install-test-deps.sh installs etcd-server)",
        );
        return;
    }
    let etcd = etcd_lite::local::LocalEtcd::start("blk-lost").unwrap();
    let key = block_agent::daemon::live_key("/lost", "agents", "a0");
    // a file, not a pipe: nothing reads the daemon's log until it exits
    let log = std::env::temp_dir().join(format!("block-agent-lost-{}.log", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_block-agent"))
        .args(["--name", "a0", "--nbd", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--etcd", &etcd.url, "--etcd-prefix", "/lost", "--etcd-lease-ttl", "1"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("block-agent starts");
    let mut banner = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    assert!(banner.starts_with("block-agent "), "banner {banner:?}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut c = rt.block_on(etcd_lite::EtcdClient::connect(&etcd.url)).unwrap();
    assert!(rt.block_on(c.get(key.clone())).unwrap().is_some(), "registered");

    // paused: no renewals; etcd deletes the key when the lease runs out
    signal("-STOP", child.id());
    let t = Instant::now();
    while rt.block_on(c.get(key.clone())).unwrap().is_some() {
        if t.elapsed() > Duration::from_secs(15) {
            signal("-CONT", child.id());
            let _ = child.kill();
            panic!("the paused agent's key outlived its 1 s lease");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let successor = rt
        .block_on(etcd_lite::Registration::start(
            &etcd.url,
            key.clone(),
            "successor",
            Duration::from_secs(5),
        ))
        .unwrap();
    let theirs = rt.block_on(successor.lease());
    signal("-CONT", child.id());
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the agent still runs 15 s after it woke beside its successor; the key holds {:?}",
                rt.block_on(c.get_lease(key.clone())).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    eprintln!("the woken agent stopped {:?} after SIGCONT ({status})", t.elapsed());
    assert!(!status.success(), "{status}");
    assert!(err.contains("another process holds this process's etcd key"), "{err}");
    assert_eq!(
        rt.block_on(c.get_lease(key.clone())).unwrap(),
        Some((theirs, b"successor".to_vec())),
        "the successor keeps its key"
    );
}
