//! The ECMP multipath testbed (`deploy/testbed/ecmp.sh`): two hosts joined by two equal-cost
//! paths through a router namespace with L4 ECMP and an HTB limit per path; one QP sprayed over
//! sixteen source ports against the same QP on one port, then a path cut in the middle of a
//! transfer; then a single-path QP over two address pairs (multi-NIC hosts) failing over when
//! its link is cut; KV-cache transfers sprayed against one path and the tcp transport's lanes; block
//! writes over Solar and over TCP through a link cut and random loss. Needs root
//! (CI runs as root); skipped with a message otherwise.

use std::process::Command;

/// The experiments measure rates and stalls on 2 cores: one testbed at a time.
static TESTBED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `ecmp.sh ARGS --prefix TAG<pid>` with `env` set, one testbed at a time; returns its
/// output and JSON lines, or None (skipped, with a message) when not root.
fn ecmp(args: &[&str], tag: &str, env: (&str, &str)) -> Option<(String, Vec<serde_json::Value>)> {
    if !test_support::is_root() {
        test_support::skip(
            &format!("ECMP testbed {tag}"),
            test_support::Missing::Root,
            "the ECMP testbed needs root (network namespaces, tc); CI runs it as root",
        );
        return None;
    }
    let _one = TESTBED.lock().unwrap_or_else(|e| e.into_inner());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/testbed/ecmp.sh");
    let o = Command::new("bash")
        .arg(script)
        .args(args)
        .arg("--prefix")
        .arg(format!("{tag}{}", std::process::id() % 100000))
        .env(env.0, env.1)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("bash runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "ecmp.sh {args:?} failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    Some((out, lines))
}

#[test]
fn spraying_fills_both_paths_and_a_cut_path_is_routed_around() {
    // debug nsperf: paths of 200 Mbit/s keep it network-bound on a 2-core machine
    #[rustfmt::skip]
    let args = [
        "run", "--rate", "200mbit", "--duration", "1", "--pairs", "3",
        // 16 source ports: the chance that ECMP hashes them all onto one link is 2^-15
        "--paths", "16",
        "--cut-bytes", "200MiB", "--cut-at", "1.5", "--cut-for", "2",
        // enough bytes to run ~2.5 s past the restore: a restored link carries traffic again
        // only once the router re-resolves B's address on it (up to about a second)
        "--failover-bytes", "160MiB",
    ];
    let Some((_out, lines)) = ecmp(&args, "fe", ("NSPERF", env!("CARGO_BIN_EXE_nsperf"))) else {
        return;
    };
    let find = |f: &dyn Fn(&serde_json::Value) -> bool| lines.iter().find(|l| f(l)).cloned().expect("line");
    let spray = find(&|l| l["experiment"] == "spray" && l["mode"] == "spray");
    let fixed = find(&|l| l["experiment"] == "spray" && l["mode"] == "fixed");
    let ratio = find(&|l| l["experiment"] == "spray" && l.get("ratio").is_some());
    let split = find(&|l| l["experiment"] == "spray" && l.get("link_bytes").is_some());
    let cut = find(&|l| l["experiment"] == "cut");
    let g = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    // one source port: at most one path's 200 Mbit/s
    assert!(g(&fixed, "gbps") < 0.21, "{fixed}");
    // sprayed: both links carry the QP's bytes, about half each (the router's counters, so
    // this holds however few cycles a loaded machine leaves the debug sender; the speed-up it
    // gives is the benchmark's figure, `ecmp.sh run` with release binaries, in BENCHMARKS.md)
    let share = g(&split, "sprayed_share_of_lesser_link");
    assert!((0.3..=0.7).contains(&share), "both links carry sprayed bytes: {split}");
    assert!(g(&spray, "gbps") > 0.0 && g(&ratio, "ratio") > 0.0, "{spray} {ratio}");
    assert_eq!(ratio["verified"], true, "{ratio}");
    // the cut: the data arrives intact, the stall is short, one path carries on, the path returns
    assert_eq!(cut["verified"], true, "{cut}");
    assert!(g(&cut, "stall_ms") < 200.0, "{cut}");
    // one path carries on: its 200 Mbit/s, or, when the debug sender could not fill both paths
    // before the cut (a slow or loaded CI machine: 0.22 of 0.4 Gbit/s in one run), at least
    // half of what it sent then
    let during = g(&cut, "gbps_during");
    let floor = (0.5 * g(&cut, "gbps_before")).min(0.15);
    assert!((floor..0.21).contains(&during), "one path's rate while cut: {cut}");
    assert!(cut["path_downs"].as_u64().unwrap() >= 1, "{cut}");
    assert_eq!(cut["path_returned"], true, "{cut}");
    assert!(g(&cut, "gbps_after_peak") > 1.5 * during, "both paths again: {cut}");
    // a single-path QP over two address pairs fails over to the second when the first is cut
    let fo = find(&|l| l["experiment"] == "failover");
    assert_eq!(fo["verified"], true, "{fo}");
    assert!(g(&fo, "stall_ms") < 200.0, "{fo}");
    // one path before and after the failover: the other pair carries what the first did
    let floor = (0.75 * g(&fo, "gbps_before")).min(0.15);
    assert!(
        (floor..0.21).contains(&g(&fo, "gbps_during")),
        "the other pair's rate: {fo}"
    );
    assert!(fo["path_downs"].as_u64().unwrap() >= 1, "{fo}");
    assert_eq!(fo["path_returned"], true, "{fo}");
}

#[test]
fn kvcache_transfers_spray_over_both_paths() {
    let args = [
        "kvcache",
        "--rate",
        "200mbit",
        "--paths",
        "16",
        "--size",
        "8MiB",
        "--duration",
        "1.5",
        "--pairs",
        "1",
    ];
    let bench = ("KVCACHE_BENCH", env!("CARGO_BIN_EXE_kvcache-bench"));
    let Some((out, lines)) = ecmp(&args, "fk", bench) else {
        return;
    };
    assert!(
        lines
            .iter()
            .filter(|l| l["bench"] == "kvcache_write")
            .all(|l| l["verified"] == true),
        "{out}"
    );
    let ratio = |reference: &str| {
        lines
            .iter()
            .find(|l| l["bench"] == "ratio" && l["reference"] == reference)
            .and_then(|l| l["ratio"].as_f64())
            .unwrap_or_else(|| panic!("ratio against {reference} in {out}"))
    };
    // the comparison ran and measured both references; how much faster two 200 Mbit/s paths
    // are than one (and than tcp's lanes) is the benchmark's figure with release binaries
    // (`ecmp.sh kvcache`, BENCHMARKS.md): a debug prefill and decode on 2 loaded cores are
    // CPU-bound and do not say it
    assert!(ratio("flexns") > 0.0 && ratio("tcp") > 0.0, "{out}");
    // sprayed transfers cross both links, about half each: the router's counters
    let split = lines
        .iter()
        .find(|l| l["experiment"] == "kvcache")
        .unwrap_or_else(|| panic!("the sprayed run's link split in {out}"));
    assert_eq!(split["verified"], true, "{split}");
    let share = split["sprayed_share_of_lesser_link"]
        .as_f64()
        .unwrap_or_else(|| panic!("{split}"));
    assert!((0.3..=0.7).contains(&share), "both links carry sprayed bytes: {split}");
}

/// The block service on the faulty fabric (`ecmp.sh block`): one storage node in B, agents in
/// A over Solar (sprayed over 8 source ports) and over the plain block protocol on one kernel
/// TCP connection, fio writing fresh random blocks and reading them back verified. A cut of
/// the link carrying the run, then 5 % random loss in both directions, then an incast.
#[test]
fn block_writes_ride_out_a_cut_and_random_loss_on_solar() {
    let blkctl = ("BLKCTL", env!("CARGO_BIN_EXE_blkctl"));
    #[rustfmt::skip]
    let cut = [
        "block", "--fault", "cut", "--rate", "200mbit", "--paths", "8", "--pairs", "1",
        "--io-bytes", "128MiB", "--cut-at", "1.5", "--cut-for", "2",
    ];
    let Some((out, lines)) = ecmp(&cut, "fb", blkctl) else {
        return;
    };
    let run = |sys: &str| {
        lines
            .iter()
            .find(|l| l["experiment"] == "block" && l["system"] == sys)
            .cloned()
            .unwrap_or_else(|| panic!("a {sys} run in {out}"))
    };
    let g = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    let (solar, tcp) = (run("solar"), run("tcp"));
    for r in [&solar, &tcp] {
        assert_eq!(r["verified"], true, "every written block read back intact: {r}");
        assert_eq!(r["errors"], 0, "no I/O error: {r}");
    }
    // TCP's one connection waits for the link (2 s); Solar's requests move to the other link
    // within a few path RTOs. The target (no stall of 100 ms) is a benchmark figure
    // (`ecmp.sh block --fault cut`, ARCHITECTURE has the runs): on this 2-core VM most runs
    // stall under 15 ms, and about one in ten 100-125 ms (a resend that hashed onto the cut
    // link too waits out a backed-off RTO). On a CPU-starved machine Solar also stalls where
    // no fault is: with two busy loops beside the testbed, 92-199 ms at any time in the run
    // (its 2 ms RTO floor meets scheduling delays: about 10 % of blocks resent), and one CI
    // run measured 253 ms. What a test can hold: no stall near TCP's, which waits out the cut
    assert!(g(&tcp, "stall_ms") > 1000.0, "the cut hit the TCP flow: {tcp}");
    assert!(g(&solar, "stall_ms") * 4.0 < g(&tcp, "stall_ms"), "{solar}\n{tcp}");
    // Solar's two links are no IOPS gain here: on 2 cores it is CPU-bound near one link's line
    // rate (about 6,000 IOPS at 200 Mbit/s), as TCP is outside its stall, so what it gains is
    // the time TCP waits for the link (2 s of about 7.5)
    assert!(g(&solar, "iops") > g(&tcp, "iops"), "{solar}\n{tcp}");

    #[rustfmt::skip]
    let loss = [
        "block", "--fault", "loss", "--loss", "5", "--rate", "200mbit", "--paths", "8",
        "--pairs", "3", "--io-bytes", "32MiB",
    ];
    let Some((out, sum)) = block_summary(&loss, "fl") else {
        return;
    };
    // a lost block is resent after a path RTO: no long wait. How much faster than TCP Solar
    // is here is a benchmark figure (1.6-2.2x on this VM; ARCHITECTURE has the runs): TCP
    // loses most where one of its RTOs (200 ms) occurs, most runs but not all, and on a slower
    // 2-core CI machine both are CPU-bound, where CI measured 1.14-1.62x per pair. What a test
    // can hold: sprayed over both links Solar is no slower than the one connection (within
    // 10 %). TCP's p99.9 is no assertion
    assert!(g(&sum, "iops_ratio") > 0.9, "{out}");
    assert!(g(&sum, "stall_ms_solar_max") < 250.0, "{out}");

    // an incast: two agents per system write to the one storage node at once. No figure is
    // asserted (two TCP connections cover both links 1 time in 2, then TCP is on par): every
    // block arrives intact and nothing fails
    #[rustfmt::skip]
    let incast = [
        "block", "--fault", "incast", "--agents", "2", "--rate", "200mbit", "--paths", "8",
        "--pairs", "1", "--io-bytes", "24MiB",
    ];
    block_summary(&incast, "fi");
}

/// A busy host is not a faulty fabric (`ecmp.sh block --fault none --busy 2`): with two busy
/// loops beside the testbed on 2 cores, the engine threads wait milliseconds for a core, and
/// Solar's RTO (a 1-2 ms floor) used to call their late answers lost: thousands of RTO
/// expiries in a run of 8,192 writes, about a tenth of the blocks sent twice, paths taken out
/// of the rotation. Its timers now allow for the delay the host itself adds (the engine's
/// `lateness`: how long datagrams sat in a socket, how late a wake-up came) and are judged
/// only at what the core has taken in. Interleaved on this VM: 538 RTO expiries and 2,461
/// blocks resent before, 9-41 and 123-414 after. What the test holds: spurious RTO expiries
/// under 2 % of the writes, every block intact, no I/O error. The stall is no assertion: both
/// systems stall about as long here (Solar 147-155 ms, TCP 155-201 ms), which the host makes,
/// not a transport (the storage node's log syncs over 50 ms are in the JSON).
#[test]
fn a_busy_host_is_not_a_faulty_fabric_to_solar() {
    #[rustfmt::skip]
    let args = [
        "block", "--fault", "none", "--busy", "2", "--rate", "200mbit", "--paths", "8",
        "--pairs", "1", "--io-bytes", "32MiB",
    ];
    let Some((out, sum)) = block_summary(&args, "fn") else {
        return;
    };
    let writes = 8192.0;
    let timeouts = sum["solar_timeouts"]
        .as_f64()
        .unwrap_or_else(|| panic!("solar_timeouts in {out}"));
    assert!(timeouts < 0.02 * writes, "{timeouts} RTO expiries with no fault: {out}");
}

/// Runs `ecmp.sh ARGS` (a block experiment); checks that every block of every run read back
/// intact with no I/O error in either system; returns the output and the summary line.
fn block_summary(args: &[&str], tag: &str) -> Option<(String, serde_json::Value)> {
    let (out, lines) = ecmp(args, tag, ("BLKCTL", env!("CARGO_BIN_EXE_blkctl")))?;
    let sum = lines
        .iter()
        .find(|l| l["summary"] == true)
        .cloned()
        .unwrap_or_else(|| panic!("a summary in {out}"));
    assert_eq!(sum["verified"], true, "{out}");
    assert_eq!(
        (sum["errors_solar"].as_u64(), sum["errors_tcp"].as_u64()),
        (Some(0), Some(0)),
        "{out}"
    );
    Some((out, sum))
}
