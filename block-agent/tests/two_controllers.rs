//! Two controllers sharing one etcd: each state change is written only if the stored state is
//! the one that controller read, so the second writer gets ABORTED (and reads the state again)
//! instead of overwriting the first one's change.

use block_agent::control::pb::block_control_server::BlockControl;
use block_agent::control::pb::RegisterAgentRequest;
use block_agent::control::{Controller, ControllerConfig, ControllerService, MetaStore};
use std::sync::Arc;
use tonic::{Code, Request};

fn agent(name: &str, port: u16) -> Request<RegisterAgentRequest> {
    Request::new(RegisterAgentRequest {
        name: name.into(),
        admin: format!("127.0.0.1:{port}"),
        nbd: format!("127.0.0.1:{}", port + 1),
        first: false,
    })
}

#[test]
fn a_second_controller_gets_a_conflict_never_a_lost_update() {
    if !etcd_lite::local::installed() {
        test_support::skip(
            "two controllers on one etcd",
            test_support::Missing::Tool,
            "etcd is not installed (scripts/install-test-deps.sh installs etcd-server)",
        );
        return;
    }
    let etcd = etcd_lite::local::LocalEtcd::start("two-ctl").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let open = || async {
            let meta = MetaStore::etcd(&etcd.url, "/flexns-test").await.unwrap();
            ControllerService(Arc::new(
                Controller::new(meta, ControllerConfig::default()).await.unwrap(),
            ))
        };
        // both read the (empty) state
        let (a, b) = (open().await, open().await);
        a.register_agent(agent("agent-a", 7000)).await.unwrap();
        // b's state is stale: its write is refused, and nothing of a's is lost
        let e = b.register_agent(agent("agent-b", 7100)).await.unwrap_err();
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        // b read the state again: its retry lands on top of a's change
        b.register_agent(agent("agent-b", 7100)).await.unwrap();
        // and now a is the stale one
        let e = a.register_agent(agent("agent-c", 7200)).await.unwrap_err();
        assert_eq!(e.code(), Code::Aborted);
        a.register_agent(agent("agent-c", 7200)).await.unwrap();
        // what etcd holds has all three
        let stored = MetaStore::etcd(&etcd.url, "/flexns-test")
            .await
            .unwrap()
            .load()
            .await
            .unwrap();
        let mut names: Vec<&String> = stored.agents.keys().collect();
        names.sort();
        assert_eq!(names, ["agent-a", "agent-b", "agent-c"]);
    });
}
