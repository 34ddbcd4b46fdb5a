//! YCSB core workloads: operation mixes, key choosers (scrambled Zipfian, uniform, latest) and
//! self-verifying values.

use rand::Rng;

/// A YCSB core workload (E, scans, is left out: the store has no ordered index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Workload {
    /// 50 % read, 50 % update.
    A,
    /// 95 % read, 5 % update.
    B,
    /// 100 % read.
    C,
    /// 95 % read (latest), 5 % insert.
    D,
    /// 50 % read, 50 % read-modify-write.
    F,
}

/// One operation of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// Read a record.
    Read,
    /// Update a record.
    Update,
    /// Insert a new record.
    Insert,
    /// Read a record, then write it back.
    ReadModifyWrite,
}

impl Workload {
    /// Picks the next operation.
    pub fn pick(self, r: &mut impl Rng) -> OpKind {
        let x: f64 = r.random();
        match self {
            Workload::A if x < 0.5 => OpKind::Read,
            Workload::A => OpKind::Update,
            Workload::B if x < 0.95 => OpKind::Read,
            Workload::B => OpKind::Update,
            Workload::C => OpKind::Read,
            Workload::D if x < 0.95 => OpKind::Read,
            Workload::D => OpKind::Insert,
            Workload::F if x < 0.5 => OpKind::Read,
            Workload::F => OpKind::ReadModifyWrite,
        }
    }
    /// Whether reads favour the latest inserts (YCSB `requestdistribution=latest`).
    pub fn latest(self) -> bool {
        self == Workload::D
    }
}

/// The request distribution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Distribution {
    /// Scrambled Zipfian (YCSB's default): Zipfian ranks hashed over the key space.
    Zipfian,
    /// Every record equally likely.
    Uniform,
}

/// YCSB's Zipfian generator (Gray et al., "Quickly generating billion-record synthetic
/// databases"): ranks 0..n with P(i) ∝ 1/(i+1)^θ.
#[derive(Debug, Clone)]
pub struct Zipfian {
    n: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
}

fn zeta(n: u64, theta: f64) -> f64 {
    (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum()
}

impl Zipfian {
    /// A generator of ranks `0..n` (at least 2) with Zipfian constant `theta`.
    pub fn new(n: u64, theta: f64) -> Zipfian {
        let n = n.max(2);
        let zetan = zeta(n, theta);
        let zeta2 = zeta(2, theta);
        Zipfian {
            n,
            theta,
            alpha: 1.0 / (1.0 - theta),
            zetan,
            eta: (1.0 - (2.0 / n as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan),
        }
    }
    /// A rank in 0..n (0 the most popular).
    pub fn rank(&self, r: &mut impl Rng) -> u64 {
        let u: f64 = r.random();
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1;
        }
        ((self.n as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64).min(self.n - 1)
    }
}

/// FNV-1a 64 of a number (YCSB's scrambling and key hashing).
pub fn fnv64(v: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in v.to_le_bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Chooses record numbers.
#[derive(Debug, Clone)]
pub struct KeyChooser {
    dist: Distribution,
    zipf: Zipfian,
    records: u64,
}

impl KeyChooser {
    /// Chooses among `records` records by `dist` (`theta` is the Zipfian constant).
    pub fn new(dist: Distribution, records: u64, theta: f64) -> KeyChooser {
        KeyChooser {
            dist,
            zipf: Zipfian::new(records, theta),
            records,
        }
    }
    /// A record number in `0..inserted` (`inserted` ≥ the loaded records).
    pub fn next(&self, r: &mut impl Rng, inserted: u64, latest: bool) -> u64 {
        if latest {
            // the newest records are the hottest
            let rank = self.zipf.rank(r) % inserted.max(1);
            return inserted - 1 - rank;
        }
        match self.dist {
            Distribution::Uniform => r.random_range(0..self.records),
            Distribution::Zipfian => fnv64(self.zipf.rank(r)) % self.records,
        }
    }
}

/// The 8-byte key of record `n` (YCSB `insertorder=hashed`).
pub fn key(n: u64) -> [u8; 8] {
    fnv64(n ^ 0x5eed).to_le_bytes()
}

/// The value of record `n` at write sequence `seq`: record number, sequence number, then bytes
/// derived from both, `len` bytes in all (at least 16).
pub fn value(n: u64, seq: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len.max(16));
    v.extend_from_slice(&n.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    let mut x = fnv64(n ^ seq.rotate_left(32));
    while v.len() < len.max(16) {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        v.push((x >> 56) as u8);
    }
    v
}

/// The sequence number of a whole value of record `n` and length `len`; `None` when the bytes
/// are not one written value (torn, or another record's).
pub fn check(n: u64, v: &[u8], len: usize) -> Option<u64> {
    let seq = u64::from_le_bytes(v.get(8..16)?.try_into().ok()?);
    (v == value(n, seq, len).as_slice()).then_some(seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn zipfian_is_skewed_and_in_range() {
        let z = Zipfian::new(100_000, 0.99);
        let mut r = rand::rngs::StdRng::seed_from_u64(1);
        let mut top = 0;
        for _ in 0..100_000 {
            let k = z.rank(&mut r);
            assert!(k < 100_000);
            if k < 10 {
                top += 1;
            }
        }
        // with θ = 0.99 the ten hottest ranks draw about a quarter of the requests
        assert!((15_000..40_000).contains(&top), "{top}");
    }

    #[test]
    fn values_verify_and_reject_tearing() {
        let v = value(7, 3, 64);
        assert_eq!(v.len(), 64);
        assert_eq!(check(7, &v, 64), Some(3));
        assert_eq!(check(8, &v, 64), None);
        let mut t = v.clone();
        t[40] ^= 1;
        assert_eq!(check(7, &t, 64), None);
        let mixed: Vec<u8> = value(7, 3, 64)[..32]
            .iter()
            .chain(&value(7, 4, 64)[32..])
            .copied()
            .collect();
        assert_eq!(check(7, &mixed, 64), None);
    }

    #[test]
    fn mixes_match_ycsb() {
        let mut r = rand::rngs::StdRng::seed_from_u64(2);
        let n = 20_000;
        let reads = (0..n).filter(|_| Workload::B.pick(&mut r) == OpKind::Read).count();
        assert!((18_500..19_500).contains(&reads), "{reads}");
        assert!((0..100).all(|_| Workload::C.pick(&mut r) == OpKind::Read));
        let c = KeyChooser::new(Distribution::Zipfian, 1000, 0.99);
        assert!((0..1000).all(|_| c.next(&mut r, 1000, false) < 1000));
        assert!((0..1000).all(|_| c.next(&mut r, 1100, true) < 1100));
    }
}
