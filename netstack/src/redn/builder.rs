//! A builder for RedN chains: posts the work requests of the `if` and `while` constructs on a
//! managed "worker" QP and counts them in RedN Table 2's terms.
//!
//! The worker is a managed QP connected to another QP of the same context (its loopback peer),
//! so its READ, WRITE and atomics act on this host's memory, rings included. The builder tracks
//! how many completions the worker's send CQ will have produced after each signaled request, so
//! it can place the WAITs (barriers) that order a chain.
//!
//! | construct | work requests (C copy, A atomic, E WAIT/ENABLE) |
//! | --- | --- |
//! | `if` ([`ChainBuilder::if_eq`] after the copy of its operand) | 1 C + 1 A + 3 E |
//! | unrolled `while`, per iteration | 1 C + 1 A + 3 E |
//! | `break`, per iteration | + 1 C + 1 A + 1 E |
//! | recycled `while`, per round ([`ChainBuilder::recycle`]) | body + 1 A per WAIT/ENABLE re-armed (its barriers, the others it names, the tail's two) + 3 E |
//!
//! The C of an `if` is the copy that puts its operand next to the target's opcode (a RECV
//! scatter, READ or WRITE); the three E are the barrier before the CAS, the barrier after it, and
//! the ENABLE that releases the target's queue. A recycled loop re-arms its WAITs and ENABLEs
//! with one FETCH_ADD each (RedN's ADD), then waits for them and enables the next round.

use super::wqe::{self, off};
use crate::verbs::{Cq, Qp, VerbsError};
use crate::work::{SendFlags, SendWr, Sge, WrOpcode};

/// Work requests of a chain by kind (RedN Table 2: copies, atomics, WAIT/ENABLE), plus the
/// others (responses, NOOPs).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WrCount {
    /// Copies (WRITE, READ).
    pub copy: u32,
    /// Atomics (CAS, FAA).
    pub atomic: u32,
    /// Ordering verbs (WAIT, ENABLE).
    pub order: u32,
    /// The rest (responses, NOOPs).
    pub other: u32,
}

impl WrCount {
    /// All of them.
    pub fn total(&self) -> u32 {
        self.copy + self.atomic + self.order + self.other
    }
}

impl std::ops::Sub for WrCount {
    type Output = WrCount;
    fn sub(self, o: WrCount) -> WrCount {
        WrCount {
            copy: self.copy - o.copy,
            atomic: self.atomic - o.atomic,
            order: self.order - o.order,
            other: self.other - o.other,
        }
    }
}

/// A word in this host's memory that the worker reaches remotely (through its loopback peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote {
    /// Its host address.
    pub addr: u64,
    /// The remote key it is reached with.
    pub rkey: u32,
}

/// An entry of a managed QP's ring, reachable through the ring's memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Host address of the entry.
    pub addr: u64,
    /// The ring MR's keys.
    pub rkey: u32,
    /// The ring MR's local key.
    pub lkey: u32,
    /// The entry's index in its QP.
    pub index: u64,
}

impl Entry {
    /// The entry's field at byte offset `field` ([`wqe::off`]) as a remote target.
    pub fn field(&self, field: usize) -> Remote {
        Remote {
            addr: self.addr + field as u64,
            rkey: self.rkey,
        }
    }
    /// The same field as a local scatter-gather element of `len` bytes (for RECV scatter and
    /// READ destinations).
    pub fn sge(&self, field: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr + field as u64,
            length: len,
            lkey: self.lkey,
        }
    }
}

/// Posts a chain on a worker QP (see the module docs).
pub struct ChainBuilder<'a> {
    worker: &'a Qp,
    cq_num: u32,
    /// Completions the worker's send CQ will have produced once everything posted completes.
    completions: u64,
    /// 8 bytes of registered memory for atomic results.
    scratch: Sge,
    /// The worker ring's keys (for re-arming entries of a recycled loop).
    ring: (u32, u32),
    count: WrCount,
    /// An open recycled loop: its first index, the completions before it, its barriers.
    loop_start: Option<(u64, u64, Vec<u64>)>,
}

impl<'a> ChainBuilder<'a> {
    /// A builder on `worker` (managed, connected to a QP of the same context), whose send CQ is
    /// `worker_cq` and has produced all the completions of what was posted before; `scratch` is 8
    /// bytes of registered memory for atomic results; `ring_mr` is the worker's ring registered
    /// with [`Qp::reg_wq_mr`].
    pub fn new(worker: &'a Qp, worker_cq: &Cq, scratch: Sge, ring_mr: &crate::verbs::Mr) -> Result<Self, VerbsError> {
        if !worker.is_managed() || worker_cq.cq_num() != worker.send_cq_num() {
            return Err(VerbsError::Invalid(
                "chain builder: the worker must be a managed QP and worker_cq its send CQ".into(),
            ));
        }
        Ok(ChainBuilder {
            worker,
            cq_num: worker_cq.cq_num(),
            completions: worker_cq.produced(),
            scratch,
            ring: (ring_mr.lkey(), ring_mr.rkey()),
            count: WrCount::default(),
            loop_start: None,
        })
    }

    /// Work requests posted so far, by kind.
    pub fn count(&self) -> WrCount {
        self.count
    }

    /// The worker's send-CQ count once everything posted so far has completed.
    pub fn completions(&self) -> u64 {
        self.completions
    }

    /// The worker entry at index `i` (a target for later patches).
    pub fn worker_entry(&self, i: u64) -> Result<Entry, VerbsError> {
        entry(self.worker, i, self.ring.0, self.ring.1)
    }

    fn post(&mut self, wr: SendWr, operand: u64) -> Result<u64, VerbsError> {
        if wr.flags.contains(SendFlags::SIGNALED) {
            self.completions += 1;
        }
        self.worker.post_managed(&wr, operand)
    }

    /// WAIT until `cq` has produced `count` completions (1 E).
    pub fn wait(&mut self, cq_num: u32, count: u64) -> Result<u64, VerbsError> {
        self.count.order += 1;
        self.post(SendWr::wait(0, cq_num, count), 0)
    }

    /// WAIT until everything posted so far on the worker completed (1 E): a data barrier, and
    /// (fetching never passes a WAIT) an instruction barrier.
    pub fn barrier(&mut self) -> Result<u64, VerbsError> {
        let (cq, n) = (self.cq_num, self.completions);
        let i = self.wait(cq, n)?;
        if let Some((_, _, b)) = self.loop_start.as_mut() {
            b.push(i);
        }
        Ok(i)
    }

    /// ENABLE managed QP `qpn` up to `index` (1 E).
    pub fn enable(&mut self, qpn: u32, index: u64) -> Result<u64, VerbsError> {
        self.count.order += 1;
        self.post(SendWr::enable(0, qpn, index), 0)
    }

    /// READ `len` bytes at `src` into `dst` (1 C).
    pub fn copy(&mut self, dst: Sge, src: Remote) -> Result<u64, VerbsError> {
        self.count.copy += 1;
        self.post(
            SendWr::new(0, WrOpcode::RdmaRead).sge(dst).remote(src.addr, src.rkey),
            0,
        )
    }

    /// WRITE the local `src` to `dst` (1 C).
    pub fn write(&mut self, dst: Remote, src: Sge) -> Result<u64, VerbsError> {
        self.count.copy += 1;
        self.post(
            SendWr::new(0, WrOpcode::RdmaWrite).sge(src).remote(dst.addr, dst.rkey),
            0,
        )
    }

    /// CMP_AND_SWP on `target` (1 A).
    pub fn cas(&mut self, target: Remote, compare: u64, swap: u64) -> Result<u64, VerbsError> {
        self.count.atomic += 1;
        self.post(
            SendWr::new(0, WrOpcode::AtomicCmpAndSwp)
                .sge(self.scratch)
                .remote(target.addr, target.rkey)
                .atomic(compare, swap),
            0,
        )
    }

    /// FETCH_AND_ADD `add` to `target` (1 A).
    pub fn add(&mut self, target: Remote, add: u64) -> Result<u64, VerbsError> {
        self.count.atomic += 1;
        self.post(
            SendWr::new(0, WrOpcode::AtomicFetchAndAdd)
                .sge(self.scratch)
                .remote(target.addr, target.rkey)
                .atomic(add, 0),
            0,
        )
    }

    /// Posts another work request on the worker (counted as other).
    pub fn other(&mut self, wr: SendWr, operand: u64) -> Result<u64, VerbsError> {
        self.count.other += 1;
        self.post(wr, operand)
    }

    /// `if (target's operand == y) target becomes then_opcode`: a barrier (the copy that placed
    /// the operand has completed), a CAS of the target's word 0 from `{NOOP, flags, y}` to
    /// `{then_opcode, flags, y}`, and a barrier after it (1 A + 2 E; with the operand's copy and
    /// the ENABLE that releases the target, RedN's 1 C + 1 A + 3 E). `flags` are the target's
    /// flags byte as posted.
    ///
    /// Returns the CAS's index: a receive may scatter `y` into its compare operand
    /// ([`wqe::off::COMPARE_ADD`] + 2, 6 bytes) before it runs.
    pub fn if_eq(&mut self, target: Entry, y: u64, then_opcode: u8, flags: u8) -> Result<u64, VerbsError> {
        self.barrier()?;
        let cas = self.cas(
            target.field(off::WORD0),
            wqe::word0(wqe::OP_NOOP, flags, y),
            wqe::word0(then_opcode, flags, y),
        )?;
        self.barrier()?;
        Ok(cas)
    }

    /// Lets the worker run what was posted (its own doorbell).
    pub fn start(&self) -> Result<(), VerbsError> {
        self.worker.enable(self.worker.next_index())
    }

    /// Starts the body of a recycled loop at the worker's next index (see
    /// [`ChainBuilder::recycle`]); barriers posted from now on are re-armed each round.
    pub fn begin_loop(&mut self) -> u64 {
        let first = self.worker.next_index();
        self.loop_start = Some((first, self.completions, Vec::new()));
        first
    }

    /// Closes a recycled loop begun with [`ChainBuilder::begin_loop`] by appending its tail:
    ///
    /// 1. a barrier (the round's work, and the previous round's last adds, have completed);
    /// 2. one FETCH_ADD per barrier of the loop (by the completions of a round) and per field
    ///    in `rearm` (a WAIT's count or an ENABLE's index in the loop or in another managed QP's
    ///    ring, with its step per round);
    /// 3. a WAIT for those adds, then an ENABLE of the worker's next round;
    /// 4. two FETCH_ADDs re-arming that WAIT and that ENABLE.
    ///
    /// Every re-armed entry is fetched before its add within a round, and every add lands
    /// before the entry's next fetch, whether the adds execute at once (on a loopback peer) or
    /// over the transport. The body and the tail must fill the worker's ring (`slots` entries)
    /// exactly, so round `r` re-executes the same entries at indices `first + r × slots ..`.
    /// Returns the entries per round.
    pub fn recycle(&mut self, slots: u64, rearm: &[(Remote, u64)]) -> Result<u64, VerbsError> {
        if self.loop_start.is_none() {
            return Err(VerbsError::Invalid("recycle: no loop begun".into()));
        }
        self.barrier()?;
        let Some((first, base, barriers)) = self.loop_start.take() else {
            return Err(VerbsError::Invalid("recycle: no loop begun".into()));
        };
        let adds = barriers.len() + rearm.len();
        let tail_rest = adds as u64 + 2 + 2;
        let used = self.worker.next_index() - first;
        if used + tail_rest != slots {
            return Err(VerbsError::Invalid(format!(
                "recycle: a body of {} entries and a tail of {} must fill the {slots}-entry ring",
                used - 1,
                tail_rest + 1
            )));
        }
        // every add is signaled: a round's completions are the body's plus the adds
        let per_round = self.completions - base + adds as u64 + 2;
        for b in &barriers {
            self.add(self.worker_entry(*b)?.field(off::REMOTE_ADDR), per_round)?;
        }
        for (r, k) in rearm {
            self.add(*r, *k)?;
        }
        let w = self.completions;
        self.count.order += 1;
        let tail_wait = self.post(SendWr::wait(0, self.cq_num, w), 0)?;
        self.count.order += 1;
        let qpn = self.worker.qp_num();
        let tail_enable = self.post(SendWr::enable(0, qpn, first + 2 * slots), 0)?;
        let (tw, te) = (self.worker_entry(tail_wait)?, self.worker_entry(tail_enable)?);
        self.add(tw.field(off::REMOTE_ADDR), per_round)?;
        self.add(te.field(off::REMOTE_ADDR), slots)?;
        debug_assert_eq!(self.completions - base, per_round);
        Ok(slots)
    }
}

/// The entry at index `i` of managed QP `qp`, whose ring is registered with keys `lkey`/`rkey`.
pub fn entry(qp: &Qp, i: u64, lkey: u32, rkey: u32) -> Result<Entry, VerbsError> {
    Ok(Entry {
        addr: qp.wqe_addr(i)?,
        rkey,
        lkey,
        index: i,
    })
}
