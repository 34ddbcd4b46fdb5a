//! kvcache-engine's systemd unit starts it with flags it accepts.

use clap::Parser;

#[derive(Parser)]
enum Cli {
    Serve(kvcache_engine::daemon::ServeArgs),
}

#[test]
fn the_kvcache_engine_unit_parses_with_its_flags() {
    let (p, args) = test_support::units::exec_start("kvcache-engine.service");
    assert_eq!(p, "kvcache-engine");
    let Cli::Serve(a) =
        Cli::try_parse_from(std::iter::once(p).chain(args)).unwrap_or_else(|e| panic!("kvcache-engine.service: {e}"));
    assert!(a.metrics_addr.is_some());
    a.engine_config()
        .expect("the unit's flags make a valid engine configuration");
}
