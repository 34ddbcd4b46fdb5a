//! Watches, prefix views and leased registrations against a real etcd (Debian's etcd-server,
//! started here).

use etcd_lite::local::LocalEtcd;
use etcd_lite::{EtcdClient, PrefixView, Registration, WatchEvent};
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

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Waits up to `within` for the view to satisfy `ok`; returns how long it took.
fn until(view: &mut PrefixView, within: Duration, ok: impl Fn(&etcd_lite::PrefixSnapshot) -> bool) -> Duration {
    let t = Instant::now();
    loop {
        if ok(&view.current()) {
            return t.elapsed();
        }
        assert!(t.elapsed() < within, "not seen within {within:?}: {:?}", view.current());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_watch_sees_puts_and_deletes_in_order_from_a_revision() {
    let Some(etcd) = start_etcd("etcd-lite watch") else {
        return;
    };
    rt().block_on(async {
        let mut c = EtcdClient::connect(&etcd.url).await.unwrap();
        c.put("/w/a", "1").await.unwrap();
        let (kvs, rev) = c.get_prefix_at(b"/w/").await.unwrap();
        assert_eq!(kvs, vec![(b"/w/a".to_vec(), b"1".to_vec(), rev)]);
        // changes made after the read, before the watch exists, are still delivered
        c.put("/w/b", "2").await.unwrap();
        c.put("/other", "x").await.unwrap();
        c.delete("/w/a").await.unwrap();
        let mut w = c.watch_prefix(b"/w/", rev + 1).await.unwrap();
        let mut seen = Vec::new();
        while seen.len() < 2 {
            seen.extend(w.next().await.unwrap());
        }
        assert!(matches!(&seen[0], WatchEvent::Put { key, value, .. } if key == b"/w/b" && value == b"2"));
        assert!(matches!(&seen[1], WatchEvent::Delete { key, .. } if key == b"/w/a"));
    });
}

#[test]
fn a_prefix_view_follows_changes_and_a_dead_registration_expires() {
    let Some(etcd) = start_etcd("etcd-lite view") else {
        return;
    };
    let rt = rt();
    let mut c = rt.block_on(EtcdClient::connect(&etcd.url)).unwrap();
    rt.block_on(c.put("/v/static", "s")).unwrap();
    let mut view = PrefixView::start(&etcd.url, b"/v/").unwrap();
    let first = view.wait_synced(Duration::from_secs(10)).unwrap();
    assert_eq!(first.entries.get(&b"/v/static"[..]), Some(&b"s".to_vec()));
    assert!(view.changed().is_none(), "nothing changed since wait_synced");

    // a registration appears at once, takes updates, and is gone at once when revoked
    let r = rt
        .block_on(Registration::start(
            &etcd.url,
            "/v/proc-a",
            "addr-1",
            Duration::from_secs(2),
        ))
        .unwrap();
    let seen = until(&mut view, Duration::from_secs(2), |s| {
        s.entries.contains_key(&b"/v/proc-a"[..])
    });
    eprintln!("registration seen by the view after {seen:?}");
    assert!(view.changed().is_some());
    rt.block_on(r.update("addr-2")).unwrap();
    until(&mut view, Duration::from_secs(2), |s| {
        s.entries.get(&b"/v/proc-a"[..]) == Some(&b"addr-2".to_vec())
    });
    // renewals keep it past its TTL
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        view.current().entries.contains_key(&b"/v/proc-a"[..]),
        "renewed past its 2 s lease"
    );
    let t = Instant::now();
    rt.block_on(r.revoke()).unwrap();
    until(&mut view, Duration::from_secs(1), |s| {
        !s.entries.contains_key(&b"/v/proc-a"[..])
    });
    eprintln!("revoked registration gone from the view after {:?}", t.elapsed());

    // a process that stops renewing (dropped without revoking: what a crash leaves) expires
    let r = rt
        .block_on(Registration::start(&etcd.url, "/v/proc-b", "b", Duration::from_secs(2)))
        .unwrap();
    until(&mut view, Duration::from_secs(2), |s| {
        s.entries.contains_key(&b"/v/proc-b"[..])
    });
    let t = Instant::now();
    drop(r);
    let gone = until(&mut view, Duration::from_secs(5), |s| {
        !s.entries.contains_key(&b"/v/proc-b"[..])
    });
    eprintln!("unrenewed registration (2 s lease) gone after {gone:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(500),
        "it lived out (most of) its lease"
    );
    let s = view.current();
    assert!(s.synced && s.revision > first.revision);
    assert_eq!(s.entries.keys().collect::<Vec<_>>(), vec![&b"/v/static".to_vec()]);
}
