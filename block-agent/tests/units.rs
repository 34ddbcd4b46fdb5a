//! The block service's systemd units start their daemons with flags the daemons accept.

use clap::Parser;

#[derive(Parser)]
struct Node {
    #[command(flatten)]
    a: block_agent::daemon::NodeArgs,
}
#[derive(Parser)]
struct Agent {
    #[command(flatten)]
    a: block_agent::daemon::AgentArgs,
}
#[derive(Parser)]
struct Control {
    #[command(flatten)]
    a: block_agent::daemon::ControlArgs,
}

#[test]
fn every_block_unit_parses_with_its_daemon_flags() {
    for (unit, prog) in [
        ("block-server.service", "block-server"),
        ("block-agent.service", "block-agent"),
        ("block-control.service", "block-control"),
    ] {
        let (p, args) = test_support::units::exec_start(unit);
        assert_eq!(p, prog, "{unit}");
        let argv = std::iter::once(p).chain(args);
        let r = match prog {
            "block-server" => Node::try_parse_from(argv).map(|c| c.a.metrics_addr),
            "block-agent" => Agent::try_parse_from(argv).map(|c| c.a.metrics_addr),
            _ => Control::try_parse_from(argv).map(|c| c.a.metrics_addr),
        };
        let metrics = r.unwrap_or_else(|e| panic!("{unit}: {e}"));
        assert!(metrics.is_some(), "{unit} serves no metrics");
    }
}
