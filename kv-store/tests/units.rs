//! kv-server's systemd unit starts it with flags it accepts.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    a: kv_store::cli::ServerArgs,
}

#[test]
fn the_kv_server_unit_parses_with_its_flags() {
    let (p, args) = test_support::units::exec_start("kv-server.service");
    assert_eq!(p, "kv-server");
    let c = Cli::try_parse_from(std::iter::once(p).chain(args)).unwrap_or_else(|e| panic!("kv-server.service: {e}"));
    assert!(c.a.metrics_addr.is_some() && c.a.etcd.is_some());
    c.a.config()
        .expect("the unit's flags make a valid partition configuration");
}
