//! `flexns bench --only netns`: the comparisons across two network namespaces joined by a veth
//! pair. Both rows are there, verified, on the UDP link (not the same-host copy that two
//! namespaces of one host would otherwise meet by), the servers in the other namespace are
//! accounted, and the bytes the runs moved crossed the veth. Needs root (CI runs as root);
//! skipped with a message otherwise.

use serde_json::Value;
use std::process::Command;

#[test]
fn netns_rows_cross_the_veth_on_the_udp_link() {
    if !test_support::is_root() {
        test_support::skip(
            "flexns bench netns rows",
            test_support::Missing::Root,
            "network namespaces and a veth pair need root; CI runs as root",
        );
        return;
    }
    if !test_support::have("ip", "-V") {
        test_support::skip(
            "flexns bench netns rows",
            test_support::Missing::Tool,
            "no `ip` (scripts/install-test-deps.sh installs iproute2)",
        );
        return;
    }
    let out = std::env::temp_dir().join(format!("flexns-bench-netns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = Command::new(env!("CARGO_BIN_EXE_flexns"))
        .args(["bench", "--quick", "--only", "netns", "--out"])
        .arg(&out)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap_or_default();
    assert!(o.status.success(), "{md}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(!md.contains("Skipped:"), "{md}");
    let jsonl = std::fs::read_to_string(out.join("results.jsonl")).unwrap();
    let lines: Vec<Value> = jsonl.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    for (name, reference, server) in [
        ("netns-write-64KiB", "udp-raw", "server"),
        ("netns-kvcache-16MiB", "tcp", "decode"),
    ] {
        let of: Vec<&Value> = lines.iter().filter(|l| l["comparison"] == name).collect();
        let row = md
            .lines()
            .find(|l| l.starts_with(&format!("| {name} (path: UDP across the veth) | {reference} |")))
            .unwrap_or_else(|| panic!("no {name} row over UDP against {reference}: {md}"));
        assert!(row.ends_with("| yes |"), "{row}");
        let runs: Vec<&&Value> = of
            .iter()
            .filter(|l| l.get("bytes").is_some() && l["bench"] != "ratio")
            .collect();
        let flexns: Vec<&&&Value> = runs.iter().filter(|l| l["system"] == "flexns").collect();
        assert!(flexns.len() >= 3 && runs.len() >= 6, "3 pairs: {of:?}");
        let n = |l: &Value, k: &str| l[k].as_u64().unwrap_or_else(|| panic!("{k} in {l}"));
        for l in &flexns {
            // packets on the UDP link: no byte by the same-host copy, none through shm rings
            assert_eq!(n(l, "same_host_copy_bytes"), 0, "{l}");
            assert_eq!(n(l, "shm_tx_messages"), 0, "{l}");
            assert!(n(l, "tx_bytes") >= n(l, "bytes") && n(l, "bytes") > 0, "{l}");
            assert_eq!(l["verified"], true, "{l}");
            // the server in the other namespace is accounted with the client
            let roles: Vec<&str> = l["processes"]
                .as_array()
                .unwrap_or_else(|| panic!("processes in {l}"))
                .iter()
                .filter_map(|p| p["role"].as_str())
                .collect();
            assert!(roles.contains(&server), "{roles:?} in {l}");
        }
        // every byte the runs wrote (flexns's and the reference's) went out of namespace A's
        // end of the veth
        let veth = of
            .iter()
            .find(|l| l["bench"] == "netns_veth")
            .unwrap_or_else(|| panic!("no veth counters for {name}: {of:?}"));
        let moved: u64 = runs.iter().map(|l| n(l, "bytes")).sum();
        assert!(n(veth, "a_to_b_bytes") >= moved, "{veth} < {moved} B moved");
    }
    let _ = std::fs::remove_dir_all(&out);
}
