//! Per-volume QoS: provisioned IOPS and bandwidth, each a token bucket with a burst.
//!
//! A bucket fills at its rate up to `rate × burst` tokens. A request takes its cost (1 per
//! I/O; its bytes) at once and may drive the bucket negative: it then waits until the debt is
//! paid at the rate. So a request is never starved by its size, requests are served in the
//! order they arrived, and over any interval the volume gets at most rate × time plus one
//! burst. Limits change online ([`Qos::set`]); the debt already taken stays.

use std::time::{Duration, Instant};

/// A volume's limits; 0 means none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QosLimits {
    /// I/O requests per second.
    pub iops: u64,
    /// Bytes per second, reads and writes together.
    pub bytes_per_sec: u64,
    /// How much unused allowance a bucket keeps, in milliseconds of its rate (0: 1000).
    pub burst_ms: u64,
}

impl QosLimits {
    /// Whether no limit is set.
    pub fn unlimited(&self) -> bool {
        self.iops == 0 && self.bytes_per_sec == 0
    }

    fn burst(&self) -> Duration {
        Duration::from_millis(if self.burst_ms == 0 { 1000 } else { self.burst_ms })
    }
}

/// One token bucket.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    rate: f64,
    cap: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate: u64, burst: Duration, now: Instant) -> Bucket {
        let cap = (rate as f64 * burst.as_secs_f64()).max(1.0);
        Bucket {
            rate: rate as f64,
            cap,
            tokens: cap,
            last: now,
        }
    }

    /// Takes `cost` tokens; returns how long the taker must wait for its debt to be paid.
    fn take(&mut self, cost: f64, now: Instant) -> Duration {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.cap) - cost;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

/// The buckets of a volume and what they held back.
#[derive(Debug, Default)]
pub struct Qos {
    limits: QosLimits,
    iops: Option<Bucket>,
    bytes: Option<Bucket>,
    /// Requests that had to wait, and the time they waited in total.
    pub throttled: u64,
    /// Total nanoseconds throttled requests waited.
    pub throttled_ns: u64,
}

impl Qos {
    /// Buckets for `limits`, full.
    pub fn new(limits: QosLimits) -> Qos {
        let mut q = Qos::default();
        q.set(limits, Instant::now());
        q
    }

    /// The limits in force.
    pub fn limits(&self) -> QosLimits {
        self.limits
    }

    /// New limits; a bucket whose rate is unchanged keeps its state (debt or allowance), a
    /// changed one starts full at the new rate.
    pub fn set(&mut self, limits: QosLimits, now: Instant) {
        if limits == self.limits {
            return;
        }
        let burst = limits.burst();
        let keep = |old: Option<Bucket>, rate: u64| match old {
            Some(b) if b.rate == rate as f64 && limits.burst_ms == self.limits.burst_ms => Some(b),
            _ => (rate > 0).then(|| Bucket::new(rate, burst, now)),
        };
        self.iops = keep(self.iops, limits.iops);
        self.bytes = keep(self.bytes, limits.bytes_per_sec);
        self.limits = limits;
    }

    /// Admits one request of `bytes`: how long it must wait first (zero when within the
    /// limits), counted as throttling.
    pub fn admit(&mut self, bytes: u64, now: Instant) -> Duration {
        let a = self.iops.as_mut().map_or(Duration::ZERO, |b| b.take(1.0, now));
        let b = self
            .bytes
            .as_mut()
            .map_or(Duration::ZERO, |b| b.take(bytes as f64, now));
        let wait = a.max(b);
        if !wait.is_zero() {
            self.throttled += 1;
            self.throttled_ns += wait.as_nanos() as u64;
        }
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_rate_holds() {
        let t0 = Instant::now();
        let mut q = Qos::new(QosLimits {
            iops: 100,
            bytes_per_sec: 0,
            burst_ms: 200,
        });
        // 20 requests of burst go at once, the 21st waits 10 ms
        for _ in 0..20 {
            assert_eq!(q.admit(4096, t0), Duration::ZERO);
        }
        let w = q.admit(4096, t0);
        assert!((w.as_secs_f64() - 0.010).abs() < 1e-6, "{w:?}");
        // queued behind it: 20 ms
        let w = q.admit(4096, t0);
        assert!((w.as_secs_f64() - 0.020).abs() < 1e-6, "{w:?}");
        assert_eq!(q.throttled, 2);
        // a second later the debt is paid and the bucket full again (capped at the burst)
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..20 {
            assert_eq!(q.admit(4096, t1), Duration::ZERO);
        }
        assert!(q.admit(4096, t1) > Duration::ZERO);
    }

    #[test]
    fn bandwidth_limits_large_requests_and_limits_change_online() {
        let t0 = Instant::now();
        let mut q = Qos::new(QosLimits {
            iops: 0,
            bytes_per_sec: 1 << 20,
            burst_ms: 1000,
        });
        // a 4 MiB request on a 1 MiB/s bucket with 1 MiB of burst: 3 s of debt
        let w = q.admit(4 << 20, t0);
        assert!((w.as_secs_f64() - 3.0).abs() < 1e-6, "{w:?}");
        // lifted: nothing waits
        q.set(QosLimits::default(), t0);
        assert_eq!(q.admit(64 << 20, t0), Duration::ZERO);
        // set again: a fresh bucket at the new rate
        q.set(
            QosLimits {
                iops: 10,
                bytes_per_sec: 0,
                burst_ms: 100,
            },
            t0,
        );
        assert_eq!(q.admit(1, t0), Duration::ZERO);
        assert!(q.admit(1, t0) > Duration::ZERO);
    }
}
