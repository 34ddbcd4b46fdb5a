//! Every get path against an in-process partition over real UDP sockets: values, misses,
//! writes, errors, and gets while the server's application thread is blocked.

use kv_store::client::{AsyncKvClient, ClientConfig, GetPath, KvClient, Op};
use kv_store::server::{KvServer, ServerConfig};
use kv_store::KvError;
use netstack::verbs::{Context, ContextConfig};
use std::time::Duration;

fn server() -> KvServer {
    KvServer::start(ServerConfig {
        capacity: 8192,
        data_bytes: 8 << 20,
        resp: Some("127.0.0.1:0".parse().unwrap()),
        hot_entries: 64,
        hot_admit: 2,
        ..Default::default()
    })
    .unwrap()
}

fn client(ctx: &Context, s: &KvServer, path: GetPath) -> KvClient {
    KvClient::connect(
        ctx,
        ClientConfig {
            servers: vec![s.cm_addr()],
            depth: 8,
            get_path: path,
            timeout: Duration::from_secs(5),
            ..Default::default()
        },
    )
    .unwrap()
}

fn value(k: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| (k as usize * 31 + i) as u8).collect()
}

#[test]
fn every_get_path_returns_what_was_written() {
    let s = server();
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let mut w = client(&ctx, &s, GetPath::Rpc);
    // load through RPC in one pipelined batch: 64-byte values (RedN's class) and a few larger
    let ops: Vec<Op> = (0..2000u32)
        .map(|k| Op::Put(k.to_le_bytes().to_vec(), value(k, if k % 100 == 7 { 1000 } else { 64 })))
        .collect();
    assert!(w.execute(ops).into_iter().all(|r| r.is_ok()));
    for path in [
        GetPath::A1,
        GetPath::Offload,
        GetPath::Redn,
        GetPath::Rpc,
        GetPath::Hybrid,
    ] {
        let mut c = client(&ctx, &s, path);
        for round in 0..3 {
            let keys: Vec<u32> = (0..300u32).map(|i| (i * 7 + round) % 2000).collect();
            let r = c.execute(keys.iter().map(|k| Op::Get(k.to_le_bytes().to_vec())).collect());
            for (k, r) in keys.iter().zip(r) {
                let want = value(*k, if k % 100 == 7 { 1000 } else { 64 });
                assert_eq!(r.unwrap().as_deref(), Some(&want[..]), "{path} key {k}");
            }
        }
        assert_eq!(c.get(&99999u32.to_le_bytes()).unwrap(), None, "{path}: a missing key");
        // one hot key, read again and again (the hybrid path caches it in the engine)
        for _ in 0..10 {
            assert_eq!(
                c.get(&5u32.to_le_bytes()).unwrap(),
                Some(value(5, 64)),
                "{path}: hot key"
            );
        }
        let st = c.stats();
        eprintln!("{path}: {st:?}");
        match path {
            GetPath::A1 => assert!(st.get_round_trips >= 2 * st.gets),
            // batches of gets travel as multi-gets (several keys per round trip)
            GetPath::Offload => assert!(st.get_round_trips * 2 < st.gets, "{st:?}"),
            GetPath::Rpc => assert_eq!(st.get_round_trips, st.gets),
            // RedN: the 1000-byte values and the missing key are not in the mirror
            GetPath::Redn => assert!(st.fallbacks >= 1 && st.fallbacks < st.gets / 10, "{st:?}"),
            GetPath::Hybrid => assert!(st.hot_hits > 0, "repeated keys become hot: {st:?}"),
        }
    }
    // writes: update, insert conflict, delete, missing delete, bad key
    w.put(b"k1", b"one").unwrap();
    assert!(matches!(
        w.execute(vec![Op::Insert(b"k1".to_vec(), b"x".to_vec())])
            .pop()
            .unwrap(),
        Err(KvError::Exists)
    ));
    assert!(matches!(
        w.execute(vec![Op::Update(b"nope".to_vec(), b"x".to_vec())])
            .pop()
            .unwrap(),
        Err(KvError::NotFound)
    ));
    w.delete(b"k1").unwrap();
    assert!(matches!(w.delete(b"k1"), Err(KvError::NotFound)));
    assert!(matches!(w.get(b""), Err(KvError::BadKey(0))));
    let big = vec![1u8; 70_000];
    assert!(w.put(b"big", &big).is_err(), "a value over 64 KiB is refused");
    w.put(b"after", b"still serving").unwrap();
    assert_eq!(w.get(b"after").unwrap().as_deref(), Some(&b"still serving"[..]));
    let st = s.stats();
    assert!(st.offload.ok > 0, "{st:?}");
    // clients that leave say goodbye: their connections and RedN pairs are freed (the five
    // get-path clients are gone; the writer is still here)
    let gone = |conns: u64| {
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while s.stats().connections != conns || s.stats().redn_pairs != 0 {
            assert!(std::time::Instant::now() < until, "{:?}", s.stats());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    gone(1);
    drop(w);
    gone(0);
}

#[test]
fn connections_beyond_the_limit_are_refused_with_a_reason() {
    let s = KvServer::start(ServerConfig {
        capacity: 1024,
        data_bytes: 1 << 20,
        max_connections: 2,
        // every client here is 127.0.0.1: let this one caller reach the server's own limit
        max_connections_per_caller: Some(3),
        ..Default::default()
    })
    .unwrap();
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let a = client(&ctx, &s, GetPath::Offload);
    let _b = client(&ctx, &s, GetPath::Offload);
    let cfg = ClientConfig {
        servers: vec![s.cm_addr()],
        ..Default::default()
    };
    let e = KvClient::connect(&ctx, cfg.clone())
        .err()
        .expect("a third connection is refused");
    assert!(e.to_string().contains("max_connections 2"), "{e}");
    drop(a);
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while s.stats().connections > 1 {
        assert!(std::time::Instant::now() < until);
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = KvClient::connect(&ctx, cfg).unwrap();
    c.put(b"k", b"v").unwrap();
}

#[test]
fn a_client_that_vanishes_is_found_by_the_keepalive() {
    let s = KvServer::start(ServerConfig {
        capacity: 1024,
        data_bytes: 1 << 20,
        keepalive: Duration::from_millis(200),
        ..Default::default()
    })
    .unwrap();
    {
        // a bare connection whose process "dies": its QP and context go away without a word
        let ctx = Context::open(ContextConfig::default()).unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(16).unwrap();
        let qp = ctx.create_qp(&pd, &cq, &cq, Default::default()).unwrap();
        let hello = serde_json::to_vec(&kv_store::proto::Hello::Kv { depth: 4 }).unwrap();
        netstack::cm::connect_blocking(s.cm_addr(), &qp, hello).unwrap();
        let until = std::time::Instant::now() + Duration::from_secs(2);
        while s.stats().connections == 0 {
            assert!(std::time::Instant::now() < until);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while s.stats().connections > 0 {
        assert!(
            std::time::Instant::now() < until,
            "the dead connection was never dropped"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn offloaded_one_sided_and_redn_gets_need_no_application_thread() {
    let s = server();
    for k in 0..500u32 {
        s.put(&k.to_le_bytes(), &value(k, 64)).unwrap();
    }
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let mut clients: Vec<(GetPath, KvClient)> = [GetPath::Offload, GetPath::A1, GetPath::Redn, GetPath::Hybrid]
        .into_iter()
        .map(|p| (p, client(&ctx, &s, p)))
        .collect();
    let mut rpc = KvClient::connect(
        &ctx,
        ClientConfig {
            servers: vec![s.cm_addr()],
            get_path: GetPath::Rpc,
            timeout: Duration::from_millis(300),
            ..Default::default()
        },
    )
    .unwrap();
    let pause = s.pause_app();
    for (p, c) in &mut clients {
        for k in (0..500u32).step_by(5) {
            assert_eq!(
                c.get(&k.to_le_bytes()).unwrap(),
                Some(value(k, 64)),
                "{p} key {k} while paused"
            );
        }
    }
    assert!(
        matches!(rpc.get(&1u32.to_le_bytes()), Err(KvError::Timeout(_))),
        "the RPC path does need the application thread"
    );
    drop(pause);
    assert_eq!(rpc.get(&2u32.to_le_bytes()).unwrap(), Some(value(2, 64)));
}

#[test]
fn the_async_api_batches_concurrent_tasks() {
    let s = server();
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let c = AsyncKvClient::connect(
        &ctx,
        ClientConfig {
            servers: vec![s.cm_addr()],
            ..Default::default()
        },
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let tasks: Vec<_> = (0..200u32)
            .map(|k| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.put(&k.to_be_bytes(), &value(k, 40)).await.unwrap();
                    c.get(&k.to_be_bytes()).await.unwrap()
                })
            })
            .collect();
        for (k, t) in tasks.into_iter().enumerate() {
            assert_eq!(t.await.unwrap(), Some(value(k as u32, 40)));
        }
        c.delete(&5u32.to_be_bytes()).await.unwrap();
        assert_eq!(c.get(&5u32.to_be_bytes()).await.unwrap(), None);
    });
}
