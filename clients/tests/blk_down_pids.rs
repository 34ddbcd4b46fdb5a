//! `blkctl cluster down` signals only processes it can prove are its daemons: a recorded pid
//! whose start time differs (the pid was reused), or, for a state without start times, whose
//! command line does not name the cluster's directory, is left alone; a proven one is stopped.

use clients::blk::{cluster_down, daemon_alive, proc_start_time, Alive, ClusterState};
use std::process::{Child, Command};

fn sleeper() -> Child {
    Command::new("sleep").arg("60").spawn().unwrap()
}

fn state(pid: u32, starts: Vec<u64>) -> ClusterState {
    ClusterState {
        control: "127.0.0.1:1".into(),
        uri: "nbd://127.0.0.1:1/vol".into(),
        pids: vec![("block-server".into(), pid)],
        dir: std::env::temp_dir().join("blk-down-pids-not-a-cluster"),
        starts,
        argv: Vec::new(),
    }
}

fn running(c: &mut Child) -> bool {
    c.try_wait().unwrap().is_none()
}

#[test]
fn down_signals_only_processes_it_can_prove_are_its_daemons() {
    let mut stranger = sleeper();
    let pid = stranger.id();
    let start = proc_start_time(pid).expect("the child's start time");

    // the pid now names a process that started at another time: a reused pid
    let reused = state(pid, vec![start + 1]);
    assert_eq!(daemon_alive(&reused, 0), Alive::Other);
    cluster_down(&reused);
    assert!(
        running(&mut stranger),
        "a process that reused a daemon's pid was signalled"
    );

    // an old state without start times: the command line must name the cluster's directory
    let old = state(pid, Vec::new());
    assert_eq!(daemon_alive(&old, 0), Alive::Other);
    cluster_down(&old);
    assert!(
        running(&mut stranger),
        "a process whose command line is not a daemon's was signalled"
    );

    // the recorded start time proves it: stopped
    let ours = state(pid, vec![start]);
    assert_eq!(daemon_alive(&ours, 0), Alive::Yes);
    cluster_down(&ours);
    let status = stranger.wait().unwrap();
    assert!(!status.success(), "stopped by a signal: {status:?}");
    assert_eq!(daemon_alive(&ours, 0), Alive::Gone);
}
