//! `nsperf --icrc`: the client passes the flag on to the server child it starts, the two
//! processes negotiate the mode over the connection manager, and the JSON row states the mode
//! the connection ran: `none` only when both offered it with UDP checksums on.

use serde_json::Value;
use std::process::{Command, Output};

fn nsperf(extra: &[&str]) -> Output {
    let mut args = vec![
        "client",
        "--op",
        "write",
        "--size",
        "64KiB",
        "--duration",
        "0.3",
        "--json",
    ];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_nsperf"))
        .args(&args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("nsperf runs")
}

/// The flexns row of a run with `extra`; its WRITEs verified.
fn row(extra: &[&str]) -> Value {
    let o = nsperf(extra);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "nsperf {extra:?} failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r: Value = out
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .find(|l| l["system"] == "flexns" && l["bench"] != "ratio")
        .unwrap_or_else(|| panic!("no flexns row in {out}"));
    assert_eq!(r["verified"], true, "{r}");
    assert!(r["bytes"].as_u64().unwrap() >= 64 << 10, "{r}");
    r
}

#[test]
fn the_row_states_the_icrc_mode_the_connection_ran() {
    assert_eq!(row(&[])["icrc"], "icrc", "the default");
    assert_eq!(row(&["--icrc", "none"])["icrc"], "none");
    // without UDP checksums neither end offers none
    assert_eq!(row(&["--icrc", "none", "--no-udp-checksum"])["icrc"], "icrc");
}

#[test]
fn a_bad_icrc_value_is_refused_naming_the_flag() {
    let o = nsperf(&["--icrc", "off"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--icrc") && err.contains("\"off\""), "{err}");
}
