//! Prometheus metrics.
//!
//! Every part of flexns records through the [`metrics`] facade: events as they happen
//! (latency histograms, per-operation counters), and the stack's own counters (the engine's,
//! the QPs', the offloading engine's) by *collectors* that copy them into the registry once a
//! second. Without a recorder installed all of it is a no-op. A daemon or benchmark calls
//! [`serve_prometheus`] for its `--metrics-addr` flag: it installs the Prometheus recorder with
//! an HTTP listener (`GET /metrics`) and starts the collector thread.
//!
//! Names follow Prometheus conventions: a `flexns_` prefix, the unit in the name
//! (`_bytes`, `_seconds`), `_total` on counters; every series of the stack carries a
//! `context` label (the context's data-path address).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// Errors of [`serve_prometheus`].
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The Prometheus endpoint could not be started.
    #[error("--metrics-addr {addr}: {message}")]
    Install {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        message: String,
    },
    /// This process serves metrics already.
    #[error("metrics are already served by this process")]
    AlreadyServing,
}

/// Something that copies its counters into the metrics registry when asked.
pub trait Collect: Send + Sync {
    /// Records the current values (called about once a second, from the collector thread).
    fn collect(&self);
}

/// How often collectors run.
pub const COLLECT_EVERY: Duration = Duration::from_secs(1);

fn collectors() -> &'static Mutex<Vec<Weak<dyn Collect>>> {
    static C: OnceLock<Mutex<Vec<Weak<dyn Collect>>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(Vec::new()))
}

static SERVING: AtomicBool = AtomicBool::new(false);

/// Adds a collector; it runs while it lives (held weakly) and metrics are served. Dead ones
/// are dropped here too, so a process that opens and closes contexts without serving metrics
/// keeps only the live ones.
pub fn register(c: Weak<dyn Collect>) {
    let mut v = collectors().lock().unwrap_or_else(|p| p.into_inner());
    v.retain(|w| w.strong_count() > 0);
    v.push(c);
}

/// Whether this process serves metrics (collectors need not do work otherwise).
pub fn serving() -> bool {
    SERVING.load(Ordering::Relaxed)
}

/// Runs every live collector once (the collector thread calls this; tests may too).
pub fn collect_now() {
    let live: Vec<Arc<dyn Collect>> = {
        let mut v = collectors().lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|w| w.strong_count() > 0);
        v.iter().filter_map(Weak::upgrade).collect()
    };
    for c in live {
        c.collect();
    }
}

/// Latency buckets in seconds: 1 µs to 10 s, about three per decade.
pub const LATENCY_BUCKETS: [f64; 22] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0,
    5.0, 10.0,
];

/// Serves Prometheus metrics on `addr` (`GET /metrics`) and starts the collector thread.
/// Histograms (names ending in `_seconds`) get [`LATENCY_BUCKETS`]. Works with or without a
/// Tokio runtime around it (the exporter runs its own otherwise).
pub fn serve_prometheus(addr: SocketAddr) -> Result<(), TelemetryError> {
    if SERVING.swap(true, Ordering::SeqCst) {
        return Err(TelemetryError::AlreadyServing);
    }
    let fail = |message: String| {
        SERVING.store(false, Ordering::SeqCst);
        TelemetryError::Install { addr, message }
    };
    // bind first, so a taken port is an error here and not in the exporter's background task
    drop(std::net::TcpListener::bind(addr).map_err(|e| fail(e.to_string()))?);
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            &LATENCY_BUCKETS,
        )
        .map_err(|e| fail(e.to_string()))?
        .install()
        .map_err(|e| fail(e.to_string()))?;
    std::thread::Builder::new()
        .name("flexns-metrics".into())
        .spawn(|| loop {
            collect_now();
            std::thread::sleep(COLLECT_EVERY);
        })
        .map_err(|e| fail(format!("starting the collector thread: {e}")))?;
    tracing::info!("metrics on http://{addr}/metrics");
    Ok(())
}
