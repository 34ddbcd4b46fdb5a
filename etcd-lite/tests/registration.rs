//! Registrations never take a key from another live process, against a real etcd (Debian's
//! etcd-server, started here): a zombie (a process paused until its lease expired) leaves its
//! successor's key alone and sees its registration lost; a start waits out a dead holder's
//! lease and refuses a live one; a take-over wins and its victim sees the loss.

use etcd_lite::local::LocalEtcd;
use etcd_lite::{EtcdClient, Registration};
use std::time::{Duration, Instant};

fn start_etcd(test: &str) -> Option<LocalEtcd> {
    if !etcd_lite::local::installed() {
        test_support::skip(
            test,
            test_support::Missing::Tool,
            "etcd is not installed (scripts/install-test-deps.sh installs etcd-server as root)",
        );
        return None;
    }
    Some(LocalEtcd::start(test).expect("starting etcd"))
}

/// A runtime that runs its tasks only while this thread drives it (`block_on`): a
/// registration started on it is a process paused between the calls.
fn pausable() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Waits (up to 15 s) until `key` is absent.
fn until_gone(rt: &tokio::runtime::Runtime, c: &mut EtcdClient, key: &str) -> Duration {
    let t = Instant::now();
    while rt.block_on(c.get(key)).unwrap().is_some() {
        assert!(t.elapsed() < Duration::from_secs(15), "{key} outlived its lease");
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

#[test]
fn a_zombie_whose_lease_expired_leaves_its_successors_key_alone() {
    let Some(etcd) = start_etcd("etcd-lite zombie") else {
        return;
    };
    let (rt, paused) = (rt(), pausable());
    let mut c = rt.block_on(EtcdClient::connect(&etcd.url)).unwrap();
    let zombie = paused
        .block_on(Registration::start(
            &etcd.url,
            "/z/node-1",
            "zombie",
            Duration::from_secs(1),
        ))
        .unwrap();
    // the zombie's process is paused (its runtime is not driven): no renewals, the lease
    // expires and etcd deletes the key
    let gone = until_gone(&rt, &mut c, "/z/node-1");
    eprintln!("the paused process's key expired after {gone:?}");
    let successor = rt
        .block_on(Registration::start(
            &etcd.url,
            "/z/node-1",
            "successor",
            Duration::from_secs(5),
        ))
        .unwrap();
    let theirs = rt.block_on(successor.lease());
    // the zombie wakes up: its renewal finds its lease expired and tries to register again
    let lost = paused
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), zombie.when_lost()).await })
        .expect("the zombie sees its registration lost");
    eprintln!("zombie: {lost}");
    assert!(
        lost.to_string().contains("/z/node-1") && lost.to_string().contains(&format!("{theirs:x}")),
        "{lost}"
    );
    assert_eq!(
        rt.block_on(c.get_lease("/z/node-1")).unwrap(),
        Some((theirs, b"successor".to_vec())),
        "the successor's value and lease"
    );
    assert!(zombie.lost().is_some());
    // an update of the lost registration is refused and writes nothing
    let e = paused.block_on(zombie.update("zombie again")).unwrap_err();
    assert!(e.to_string().contains("/z/node-1"), "{e}");
    // more renewal periods of the zombie change nothing
    paused.block_on(async { tokio::time::sleep(Duration::from_secs(1)).await });
    assert_eq!(
        rt.block_on(c.get_lease("/z/node-1")).unwrap(),
        Some((theirs, b"successor".to_vec()))
    );
    assert!(successor.lost().is_none());
    drop(zombie);
    rt.block_on(successor.revoke()).unwrap();
    assert_eq!(rt.block_on(c.get("/z/node-1")).unwrap(), None);
}

#[test]
fn a_start_waits_out_a_dead_holder_and_refuses_a_live_one() {
    let Some(etcd) = start_etcd("etcd-lite start") else {
        return;
    };
    let rt = rt();
    let mut c = rt.block_on(EtcdClient::connect(&etcd.url)).unwrap();
    // a live holder (renewing): a second process registering the same key is refused
    let live = rt
        .block_on(Registration::start(
            &etcd.url,
            "/s/agent",
            "first",
            Duration::from_secs(1),
        ))
        .unwrap();
    let holder = rt.block_on(live.lease());
    let t = Instant::now();
    let e = match rt.block_on(Registration::start(
        &etcd.url,
        "/s/agent",
        "second",
        Duration::from_secs(1),
    )) {
        Ok(_) => panic!("a second registration took a live process's key"),
        Err(e) => e.to_string(),
    };
    eprintln!("refused after {:?}: {e}", t.elapsed());
    assert!(e.contains("/s/agent") && e.contains(&format!("{holder:x}")), "{e}");
    assert_eq!(
        rt.block_on(c.get_lease("/s/agent")).unwrap(),
        Some((holder, b"first".to_vec()))
    );
    assert!(live.lost().is_none());

    // a holder that died without revoking (dropped: its renewals stop, its lease lingers):
    // a restart waits for that lease to run out, then registers
    let dead = rt
        .block_on(Registration::start(
            &etcd.url,
            "/s/node",
            "before",
            Duration::from_secs(2),
        ))
        .unwrap();
    let old = rt.block_on(dead.lease());
    drop(dead);
    let t = Instant::now();
    let again = rt
        .block_on(Registration::start(
            &etcd.url,
            "/s/node",
            "after",
            Duration::from_secs(2),
        ))
        .expect("the restart registers once the dead lease ran out");
    eprintln!("restart registered after waiting {:?} for the dead lease", t.elapsed());
    let now = rt.block_on(again.lease());
    assert_ne!(now, old);
    assert_eq!(
        rt.block_on(c.get_lease("/s/node")).unwrap(),
        Some((now, b"after".to_vec()))
    );
    // a key put without a lease is no process's registration: it is replaced
    rt.block_on(c.put("/s/plain", "by hand")).unwrap();
    let r = rt
        .block_on(Registration::start(
            &etcd.url,
            "/s/plain",
            "registered",
            Duration::from_secs(2),
        ))
        .unwrap();
    assert_eq!(
        rt.block_on(c.get_lease("/s/plain")).unwrap(),
        Some((rt.block_on(r.lease()), b"registered".to_vec()))
    );
}

#[test]
fn a_take_over_wins_and_the_old_holder_sees_it_lost() {
    let Some(etcd) = start_etcd("etcd-lite take-over") else {
        return;
    };
    let rt = rt();
    let mut c = rt.block_on(EtcdClient::connect(&etcd.url)).unwrap();
    let a = rt
        .block_on(Registration::start(
            &etcd.url,
            "/t/shard-1",
            "a",
            Duration::from_secs(1),
        ))
        .unwrap();
    let b = rt
        .block_on(Registration::take_over(
            &etcd.url,
            "/t/shard-1",
            "b",
            Duration::from_secs(1),
        ))
        .unwrap();
    let theirs = rt.block_on(b.lease());
    assert_eq!(
        rt.block_on(c.get_lease("/t/shard-1")).unwrap(),
        Some((theirs, b"b".to_vec()))
    );
    let lost = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), a.when_lost()).await })
        .expect("the old holder sees the take-over at its next renewal");
    assert!(lost.to_string().contains(&format!("{theirs:x}")), "{lost}");
    // a's revoke does not touch b's key
    rt.block_on(a.revoke()).unwrap();
    assert_eq!(
        rt.block_on(c.get_lease("/t/shard-1")).unwrap(),
        Some((theirs, b"b".to_vec()))
    );
    assert!(b.lost().is_none());
}
