//! `ycsb` and `kv` end to end: the binaries start their own kv-server processes (and
//! redis-server when installed), every get path runs, every get is verified.

use std::process::Command;

fn json_lines(out: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn has(cmd: &str) -> bool {
    Command::new(cmd).arg("--version").output().is_ok()
}

#[test]
fn ycsb_runs_every_get_path_verified() {
    let mut systems = "flexns".to_string();
    if has("redis-server") {
        systems.push_str(",redis");
    } else {
        eprintln!("redis-server not installed: running flexns only (scripts/install-test-deps.sh installs it as root)");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ycsb"))
        .args(["--workload", "a", "--records", "5000", "--system", &systems])
        .args([
            "--get-path",
            "a1,offload,redn,rpc,hybrid",
            "--threads",
            "2",
            "--depth",
            "4",
        ])
        .args(["--duration", "0.4", "--pairs", "1", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ycsb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out.stdout);
    let runs: Vec<_> = lines.iter().filter(|l| l["bench"] == "ycsb-a").collect();
    assert_eq!(runs.len(), 5 + systems.contains("redis") as usize, "{lines:?}");
    for r in &runs {
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["ops"].as_u64().unwrap() > 0, "{r}");
        assert!(r["updates"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["torn"], 0);
        assert_eq!(r["stale"], 0);
    }
    let rt = |name: &str| {
        runs.iter().find(|r| r["system"] == name).unwrap()["round_trips_per_get"]
            .as_f64()
            .unwrap()
    };
    assert!(rt("flexns-a1") >= 2.0);
    assert!(rt("flexns-offload") <= 1.01);
    // each ratio line is the quotient of its runs (throughput against redis, p50 against A1)
    for l in lines.iter().filter(|l| l["bench"] == "ycsb-a-ratio") {
        let what = l["what"].as_str().unwrap();
        let (metric, rest) = what.split_once(' ').unwrap();
        let (a, b) = rest.split_once(" / ").unwrap();
        let v = |name: &str| {
            let r = runs.iter().find(|r| r["system"] == name).unwrap();
            r[if metric == "throughput" { "mops" } else { "p50_us" }]
                .as_f64()
                .unwrap()
        };
        let want = v(a) / v(b);
        let got = l["ratio"].as_f64().unwrap();
        assert!((got - want).abs() <= 0.002 + 0.01 * want, "{l}: runs say {want}");
    }
    assert!(lines.iter().any(|l| l["bench"] == "ycsb-a-ratio"), "ratio lines");
}

#[test]
fn ycsb_spreads_records_over_shards_and_inserts() {
    let out = Command::new(env!("CARGO_BIN_EXE_ycsb"))
        .args([
            "--workload",
            "d",
            "--records",
            "4000",
            "--shards",
            "2",
            "--get-path",
            "offload,a1",
        ])
        .args(["--duration", "0.4", "--pairs", "1", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ycsb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out.stdout);
    let runs: Vec<_> = lines.iter().filter(|l| l["bench"] == "ycsb-d").collect();
    assert_eq!(runs.len(), 2);
    for r in runs {
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["inserts"].as_u64().unwrap() > 0, "{r}");
    }
}

#[test]
fn kv_cli_puts_gets_and_deletes() {
    let mut server = clients::bench::ChildServer::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_ycsb")),
        &["kv-server", "--capacity", "1024", "--data-size", "1MiB"].map(String::from),
    )
    .unwrap();
    let cm = server.field("cm").unwrap();
    let kv = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kv"))
            .args(["--server", &cm])
            .args(args)
            .output()
            .unwrap()
    };
    assert!(kv(&["put", "alpha", "first value"]).status.success());
    for path in ["a1", "offload", "redn", "rpc", "hybrid"] {
        let o = kv(&["--get-path", path, "get", "alpha"]);
        assert!(o.status.success(), "{path}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "first value", "{path}");
    }
    assert!(kv(&["del", "alpha"]).status.success());
    let o = kv(&["get", "alpha"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not found"));
    let o = Command::new(env!("CARGO_BIN_EXE_kv"))
        .args(["get", "x"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--server"));
    assert!(server.is_running(), "the server survived every request");
}
