//! The engine's side of RedN (see [`crate::redn`] for the model): managed work queues
//! ([`ManagedWq`]), the runner that fetches and executes their entries on the data core
//! ([`ChainRunner`]), the registry that finds a chain's QPs and CQs, the loopback execution of
//! chain operations on this host's memory, and the entry layout ([`wqe`]). It sits below
//! `verbs`; the builder and the programs that use it through verbs are in [`crate::redn`].

mod local;
pub mod wqe;

use crate::mem::{MrTable, Region};
use crate::transport::rc::{PostError, RcQp};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

/// Limits on managed QPs (`[redn]` in the context configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RednGuards {
    /// Entries a managed QP may execute per second.
    pub max_wr_per_sec: u64,
    /// Entries one chain may execute before it is aborted.
    pub max_wr_per_chain: u64,
}

impl Default for RednGuards {
    fn default() -> Self {
        RednGuards {
            max_wr_per_sec: 10_000_000,
            max_wr_per_chain: 100_000,
        }
    }
}

impl RednGuards {
    /// Checks the fields; the error names the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_wr_per_sec == 0 {
            return Err("max_wr_per_sec: must be > 0".into());
        }
        if self.max_wr_per_chain == 0 {
            return Err("max_wr_per_chain: must be > 0".into());
        }
        Ok(())
    }
}

/// Counters of a context's managed QPs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RednStats {
    /// Chains started.
    pub chains: u64,
    /// Entries executed.
    pub steps: u64,
    /// Chains aborted (limit, bad entry, unknown CQ or QP).
    pub aborts: u64,
    /// Times a QP waited for its rate limit.
    pub throttled: u64,
}

/// A managed QP's ring and indices, shared by the application handle and the engine.
pub struct ManagedWq {
    pub(crate) ring: Arc<Region>,
    pub(crate) slots: u64,
    /// Next index the application posts at.
    pub(crate) posted: AtomicU64,
    /// Entries below this index may be fetched.
    pub(crate) enabled: AtomicU64,
    /// Next index the engine fetches.
    pub(crate) fetched: AtomicU64,
    /// Wakes the data core that runs this QP (set by the engine).
    pub(crate) wake: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl ManagedWq {
    /// A ring of `slots` entries in `ring` (zeroed memory of at least `slots` entries).
    pub(crate) fn new(slots: usize, ring: Region) -> ManagedWq {
        debug_assert!(ring.len() >= slots * wqe::WQE_BYTES);
        ManagedWq {
            ring: Arc::new(ring),
            slots: slots as u64,
            posted: AtomicU64::new(0),
            enabled: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            wake: OnceLock::new(),
        }
    }

    /// Byte offset of index `i`'s entry in the ring.
    pub fn offset(&self, i: u64) -> usize {
        (i % self.slots) as usize * wqe::WQE_BYTES
    }

    /// Writes an entry at the next index; returns the index.
    pub(crate) fn post(&self, words: &[u64; 8]) -> Result<u64, &'static str> {
        let i = self.posted.load(Ordering::Acquire);
        if i >= self.fetched.load(Ordering::Acquire) + self.slots {
            return Err("managed send queue full: its oldest entries were not fetched yet");
        }
        let mut b = [0u8; wqe::WQE_BYTES];
        for (k, w) in words.iter().enumerate() {
            b[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        self.ring.write(self.offset(i), &b);
        self.posted.store(i + 1, Ordering::Release);
        Ok(i)
    }

    /// Lets the engine fetch entries below `index`.
    pub(crate) fn enable(&self, index: u64) {
        if self.enabled.fetch_max(index, Ordering::AcqRel) < index {
            if let Some(w) = self.wake.get() {
                w();
            }
        }
    }

    fn read(&self, i: u64) -> [u64; 8] {
        let mut b = [0u8; wqe::WQE_BYTES];
        self.ring.read(self.offset(i), &mut b);
        std::array::from_fn(|k| u64::from_le_bytes(b[k * 8..k * 8 + 8].try_into().unwrap_or_default()))
    }
}

/// A context's completion-queue counters and managed QPs, by number (what WAIT and ENABLE
/// entries name), with the RedN counters.
#[derive(Default)]
pub(crate) struct RednRegistry {
    cqs: RwLock<HashMap<u32, Weak<AtomicU64>>>,
    wqs: RwLock<HashMap<u32, Weak<ManagedWq>>>,
    chains: AtomicU64,
    steps: AtomicU64,
    aborts: AtomicU64,
    throttled: AtomicU64,
}

impl RednRegistry {
    pub(crate) fn add_cq(&self, num: u32, produced: &Arc<AtomicU64>) {
        let mut m = self.cqs.write();
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(num, Arc::downgrade(produced));
    }
    pub(crate) fn add_wq(&self, qpn: u32, wq: &Arc<ManagedWq>) {
        let mut m = self.wqs.write();
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(qpn, Arc::downgrade(wq));
    }
    fn cq_count(&self, num: u32) -> Option<u64> {
        self.cqs.read().get(&num)?.upgrade().map(|c| c.load(Ordering::Acquire))
    }
    fn wq(&self, qpn: u32) -> Option<Arc<ManagedWq>> {
        self.wqs.read().get(&qpn)?.upgrade()
    }
    /// The counters.
    pub(crate) fn stats(&self) -> RednStats {
        RednStats {
            chains: self.chains.load(Ordering::Relaxed),
            steps: self.steps.load(Ordering::Relaxed),
            aborts: self.aborts.load(Ordering::Relaxed),
            throttled: self.throttled.load(Ordering::Relaxed),
        }
    }
}

/// The engine's per-QP fetch state of a managed QP.
pub(crate) struct ChainRunner {
    wq: Arc<ManagedWq>,
    /// The CQ number of this QP's own send queue (waiting on it does not end a chain).
    own_cq: u32,
    blocked: Option<(u32, u64)>,
    in_chain: bool,
    chain_steps: u64,
    tokens: f64,
    refilled_at: u64,
    aborted: bool,
}

/// What a fetch pass did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Pass {
    /// Entries were fetched (the QP may have packets or completions).
    pub progressed: bool,
    /// Throttled until this time (ns).
    pub retry_at: Option<u64>,
}

/// Most entries fetched per pass (a pass always ends a segment at a WAIT or here).
const PASS_LIMIT: usize = 1024;

impl ChainRunner {
    pub(crate) fn new(wq: Arc<ManagedWq>, own_cq: u32, now: u64, guards: &RednGuards) -> ChainRunner {
        ChainRunner {
            wq,
            own_cq,
            blocked: None,
            in_chain: false,
            chain_steps: 0,
            tokens: Self::burst(guards),
            refilled_at: now,
            aborted: false,
        }
    }

    fn burst(g: &RednGuards) -> f64 {
        (g.max_wr_per_sec as f64 / 1000.0).max(64.0)
    }

    fn abort(&mut self, qp: &mut RcQp, reg: &RednRegistry, why: &str) -> Pass {
        tracing::warn!("managed QP {:#x}: chain aborted: {why}", qp.qpn());
        reg.aborts.fetch_add(1, Ordering::Relaxed);
        self.aborted = true;
        qp.modify_to_err();
        Pass {
            progressed: true,
            retry_at: None,
        }
    }

    /// Fetches and executes what the QP's WAITs, ENABLEs and guards allow.
    pub(crate) fn pass(
        &mut self,
        qp: &mut RcQp,
        mrs: &MrTable,
        reg: &RednRegistry,
        guards: &RednGuards,
        now: u64,
        local_peer_pd: Option<u32>,
    ) -> Pass {
        let mut out = Pass::default();
        if self.aborted {
            return out;
        }
        if let Some((cq, count)) = self.blocked {
            match reg.cq_count(cq) {
                Some(c) if c >= count => {
                    self.blocked = None;
                    if cq != self.own_cq {
                        self.in_chain = false; // an outside event starts a new chain
                    }
                }
                Some(_) => return out,
                None => return self.abort(qp, reg, &format!("WAIT on unknown CQ {cq}")),
            }
        }
        // the rate guard is checked at the start of a segment
        let elapsed = now.saturating_sub(self.refilled_at) as f64 / 1e9;
        self.refilled_at = now;
        self.tokens = (self.tokens + elapsed * guards.max_wr_per_sec as f64).min(Self::burst(guards));
        let mut fetched_any = false;
        let mut n = 0;
        loop {
            let f = self.wq.fetched.load(Ordering::Acquire);
            if f >= self.wq.enabled.load(Ordering::Acquire) {
                self.in_chain = false;
                break;
            }
            if !fetched_any && self.tokens < 1.0 {
                reg.throttled.fetch_add(1, Ordering::Relaxed);
                let wait = ((1.0 - self.tokens) / guards.max_wr_per_sec as f64 * 1e9) as u64;
                out.retry_at = Some(now + wait.max(1_000));
                break;
            }
            let words = self.wq.read(f);
            // a pass may end anywhere but right before a WAIT or ENABLE: those read their
            // fields as they are fetched, right after the entries that re-arm them were posted
            n += 1;
            if n > PASS_LIMIT && !matches!(words[0] as u8, wqe::OP_WAIT | wqe::OP_ENABLE) {
                break;
            }
            if !self.in_chain {
                self.in_chain = true;
                self.chain_steps = 0;
                reg.chains.fetch_add(1, Ordering::Relaxed);
            }
            self.chain_steps += 1;
            if self.chain_steps > guards.max_wr_per_chain {
                return self.abort(
                    qp,
                    reg,
                    &format!("more than max_wr_per_chain = {} entries", guards.max_wr_per_chain),
                );
            }
            fetched_any = true;
            self.tokens -= 1.0;
            reg.steps.fetch_add(1, Ordering::Relaxed);
            tracing::trace!("managed QP {:#x}: fetch {f}: {:x?}", qp.qpn(), words);
            let Some(wr) = wqe::decode(&words) else {
                return self.abort(qp, reg, &format!("entry {f} has unknown opcode {}", words[0] as u8));
            };
            use crate::work::WrOpcode;
            match wr.opcode {
                WrOpcode::Wait => {
                    let (cq, count) = (wr.rkey, wr.remote_addr);
                    self.wq.fetched.store(f + 1, Ordering::Release);
                    match reg.cq_count(cq) {
                        Some(c) if c >= count => {}
                        Some(_) => {
                            self.blocked = Some((cq, count));
                            out.progressed = true;
                            return out;
                        }
                        None => return self.abort(qp, reg, &format!("WAIT on unknown CQ {cq}")),
                    }
                }
                WrOpcode::Enable => {
                    let Some(t) = reg.wq(wr.rkey) else {
                        return self.abort(qp, reg, &format!("ENABLE of unknown managed QP {:#x}", wr.rkey));
                    };
                    self.wq.fetched.store(f + 1, Ordering::Release);
                    t.enable(wr.remote_addr);
                }
                _ if local_peer_pd.is_some_and(|pd| {
                    qp.state() == crate::transport::rc::QpState::Rts
                        && qp.send_queue_idle()
                        && local::execute(qp, mrs, &wr, pd)
                }) =>
                {
                    self.wq.fetched.store(f + 1, Ordering::Release);
                }
                _ => match qp.post_send(wr, mrs) {
                    Ok(()) => self.wq.fetched.store(f + 1, Ordering::Release),
                    Err(PostError::QueueFull(_)) => {
                        // the send queue is full: fetch it again when completions free room
                        self.chain_steps -= 1;
                        self.tokens += 1.0;
                        reg.steps.fetch_sub(1, Ordering::Relaxed);
                        break;
                    }
                    Err(e) => return self.abort(qp, reg, &format!("entry {f}: {e}")),
                },
            }
        }
        out.progressed |= fetched_any;
        out
    }
}
