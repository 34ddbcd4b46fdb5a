//! Ready-made RedN programs: the hash get of RedN Fig. 9 as a recycled loop that serves gets
//! with no application thread involved.
//!
//! # Hash get ([`HashGetServer`])
//! The table's buckets hold `{key: u64 (low 48 bits compared), value address: u64}` at their
//! start; values are `value_len` bytes in memory registered in the server's PD. A client sends
//! one SEND ([`hash_get_request`]) with the key, the candidate buckets' addresses and a request
//! id; for each candidate bucket `j` a worker chain on the server (RedN-Parallel) runs, per
//! request (a round of its recycled ring, 18 entries):
//!
//! | # | entry | kind |
//! | --- | --- | --- |
//! | 0 | WAIT for the request's receive completion | E |
//! | 1 | WRITE `{NOOP}` over the response entry's word 0 (reset from the last request) | C |
//! | 2 | READ the bucket's key (6 B) into the response entry's operand | C |
//! | 3 | READ the bucket's value address into the response entry's local address | C |
//! | 4 | barrier | E |
//! | 5 | CAS the response entry's word 0 `{NOOP, key}` → `{WRITE_WITH_IMM, key}` | A |
//! | 6 | barrier | E |
//! | 7 | ENABLE the response QP's next entry | E |
//! | 8 | barrier (the round's work and the last round's adds completed) | E |
//! | 9..14 | FETCH_ADD re-arming entries 0, 4, 6, 8 (by a round's completions) and 7 (by one) | A |
//! | 14 | WAIT for the adds | E |
//! | 15 | ENABLE the worker's next round | E |
//! | 16, 17 | FETCH_ADD re-arming entries 14 and 15 | A |
//!
//! The response entry (on response QP `j`, a managed QP connected to the client, one-entry
//! ring) is a WRITE_WITH_IMM of the value into the client's buffer with the request id as
//! immediate data if the keys matched, else a NOOP (no answer: the client treats silence as a
//! miss, or another bucket's chain answers). The request's bytes are placed by the receive's
//! scatter list straight into the chains' entries: the key into entry 5's compare operand, the
//! bucket address into entries 2 and 3 (the second plus 8), the id into the response entry's
//! immediate data. Receives are posted by [`HashGetServer::post_recvs`]; with them posted, gets
//! keep being served while the application's threads are blocked (RedN §5.6).

use super::builder::{entry, ChainBuilder, Entry, Remote, WrCount};
use super::wqe::{self, off};
use crate::verbs::*;

/// Entries per round of a hash-get worker.
pub const HASH_GET_SLOTS: u64 = 18;
/// Bytes of one bucket's part of a request: key (6), bucket address (8), bucket address + 8
/// (8), request id (4).
pub const REQUEST_PART: usize = 26;

/// The SEND a client issues for a RedN hash get: for each candidate bucket, the key's low 48
/// bits, the bucket's address twice (its key and its value address) and the request id.
pub fn hash_get_request(key: u64, id: u32, buckets: &[u64]) -> Vec<u8> {
    let mut v = Vec::with_capacity(REQUEST_PART * buckets.len());
    for &b in buckets {
        v.extend_from_slice(&key.to_le_bytes()[..6]);
        v.extend_from_slice(&b.to_le_bytes());
        v.extend_from_slice(&(b + 8).to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// Bytes of one bucket of a hash-get table: `{key: u64, value address: u64}`.
pub const BUCKET: usize = 16;

/// Puts `key`, with its value at `value_addr`, into the first empty bucket (key 0) among
/// `candidates` (bucket indices) of `table`, the layout [`HashGetServer`] serves; returns the
/// bucket used, or `None` when every candidate is taken.
pub fn insert_bucket(table: &Mr, candidates: &[u64], key: u64, value_addr: u64) -> Option<u64> {
    let b = *candidates
        .iter()
        .find(|&&b| table.load_u64(b as usize * BUCKET) == Some(0))?;
    table.write(b as usize * BUCKET, &key.to_le_bytes());
    table.write(b as usize * BUCKET + 8, &value_addr.to_le_bytes());
    Some(b)
}

/// Where a hash get's value goes: the client's buffer (registered with REMOTE_WRITE).
#[derive(Debug, Clone, Copy)]
pub struct ClientBuffer {
    /// Its address in the client's memory.
    pub addr: u64,
    /// The key the server's WRITE uses.
    pub rkey: u32,
}

struct Chain {
    _cq: Cq,
    _peer: Qp,
    worker: Qp,
    _ring_mr: Mr,
    /// The entries the receive scatters into: CAS (key), READ key, READ value address.
    cas: Entry,
    read_key: Entry,
    read_ptr: Entry,
    /// The response entry's immediate-data field.
    resp: Entry,
}

/// A RedN hash-get server (see the module docs).
pub struct HashGetServer {
    chains: Vec<Chain>,
    _scratch: Mr,
    _resp_rings: Vec<Mr>,
    /// Work requests per round of one chain.
    pub per_round: WrCount,
}

impl HashGetServer {
    /// Builds the chains for `resp_qps.len()` candidate buckets. `resp_qps[j]` are managed QPs
    /// (one-entry rings are enough), connected to the client, whose receive completions
    /// `recv_cq` counts (requests arrive on `resp_qps[0]`; the CQ must count nothing else);
    /// `table_rkey` is the rkey of the memory holding the buckets (REMOTE_READ), `value_lkey`
    /// the lkey of the memory holding the values; `value_len` their length; `buf` the client's
    /// buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &Context,
        pd: &Pd,
        resp_qps: &[&Qp],
        recv_cq: &Cq,
        table_rkey: u32,
        value_lkey: u32,
        value_len: u32,
        buf: ClientBuffer,
    ) -> Result<HashGetServer, VerbsError> {
        if resp_qps.is_empty() || resp_qps.len() > 4 || resp_qps.iter().any(|q| !q.is_managed()) {
            return Err(VerbsError::Invalid(
                "hash get: 1 to 4 managed response QPs (one per candidate bucket)".into(),
            ));
        }
        let scratch = pd.reg_mr(64, Access::ALL)?;
        // the template of a reset response entry's word 0, at offset 8 of the scratch region
        let flags = 0u8;
        scratch.write(8, &wqe::word0(wqe::OP_NOOP, flags, 0).to_le_bytes());
        let mut chains = Vec::new();
        let mut resp_rings = Vec::new();
        for (j, q) in resp_qps.iter().enumerate() {
            // the response entry: a WRITE_WITH_IMM of the value to the client, posted as NOOP
            let rmr = q.reg_wq_mr(pd, Access::ALL)?;
            let mut resp_wr = SendWr::new(j as u64, WrOpcode::RdmaWriteWithImm)
                .sge(Sge {
                    addr: 0,
                    length: value_len,
                    lkey: value_lkey,
                })
                .remote(buf.addr, buf.rkey)
                .flags(SendFlags(0));
            resp_wr.opcode = WrOpcode::Noop;
            let ri = q.post_managed(&resp_wr, 0)?;
            let resp = entry(q, ri, rmr.lkey(), rmr.rkey())?;
            // the worker and its loopback peer; the worker's CQ counts only its own completions
            let cq = ctx.create_cq_ignore_overrun(1024)?;
            let worker = ctx.create_qp(
                pd,
                &cq,
                &cq,
                QpInitAttr {
                    managed_slots: HASH_GET_SLOTS as usize,
                    ..Default::default()
                },
            )?;
            let peer = ctx.create_qp(pd, &cq, &cq, QpInitAttr::default())?;
            worker.connect(&peer.local_endpoint())?;
            peer.connect(&worker.local_endpoint())?;
            let wmr = worker.reg_wq_mr(pd, Access::ALL)?;
            let mut b = ChainBuilder::new(&worker, &cq, scratch.sge(0, 8), &wmr)?;
            let first = b.begin_loop();
            let base = recv_cq.produced();
            let wait_req = b.wait(recv_cq.cq_num(), base + 1)?;
            b.write(
                resp.field(off::WORD0),
                Sge {
                    addr: scratch.addr() + 8,
                    length: 8,
                    lkey: scratch.lkey(),
                },
            )?;
            // the bucket addresses come with each request (receive scatter)
            let bucket = Remote {
                addr: 0,
                rkey: table_rkey,
            };
            let read_key = b.copy(resp.sge(off::OPERAND, 6), bucket)?;
            let read_ptr = b.copy(resp.sge(off::LOCAL_ADDR, 8), bucket)?;
            b.barrier()?;
            let cas = b.cas(
                resp.field(off::WORD0),
                wqe::word0(wqe::OP_NOOP, flags, 0),
                wqe::word0(wqe::OP_WRITE_IMM, flags, 0),
            )?;
            b.barrier()?;
            let enable = b.enable(q.qp_num(), ri + 1)?;
            let wait_e = b.worker_entry(wait_req)?;
            let enable_e = b.worker_entry(enable)?;
            b.recycle(
                HASH_GET_SLOTS,
                &[
                    (wait_e.field(off::REMOTE_ADDR), 1),
                    (enable_e.field(off::REMOTE_ADDR), 1),
                ],
            )?;
            let per_round = b.count();
            debug_assert_eq!(worker.next_index() - first, HASH_GET_SLOTS);
            let (cas, read_key, read_ptr) = (
                b.worker_entry(cas)?,
                b.worker_entry(read_key)?,
                b.worker_entry(read_ptr)?,
            );
            b.start()?;
            drop(b);
            let ch = Chain {
                cas,
                read_key,
                read_ptr,
                resp,
                _cq: cq,
                _peer: peer,
                _ring_mr: wmr,
                worker,
            };
            resp_rings.push(rmr);
            chains.push((ch, per_round));
        }
        let per_round = chains[0].1;
        Ok(HashGetServer {
            chains: chains.into_iter().map(|(c, _)| c).collect(),
            _scratch: scratch,
            _resp_rings: resp_rings,
            per_round,
        })
    }

    /// The receive that scatters one request into the chains' entries.
    pub fn recv_wr(&self, wr_id: u64) -> RecvWr {
        let mut sg = SgList::new();
        for c in &self.chains {
            sg.push(c.cas.sge(off::COMPARE_ADD + 2, 6));
            sg.push(c.read_key.sge(off::REMOTE_ADDR, 8));
            sg.push(c.read_ptr.sge(off::REMOTE_ADDR, 8));
            sg.push(c.resp.sge(off::IMM, 4));
        }
        RecvWr { wr_id, sg_list: sg }
    }

    /// A response QP for [`HashGetServer::new`]: managed, a one-entry ring, room for
    /// `recvs` receives (requests arrive on the first one; `recv_cq` must count nothing else).
    pub fn response_qp(ctx: &Context, pd: &Pd, send_cq: &Cq, recv_cq: &Cq, recvs: u32) -> Result<Qp, VerbsError> {
        ctx.create_qp(
            pd,
            send_cq,
            recv_cq,
            QpInitAttr {
                managed_slots: 1,
                config: Some(RcConfig {
                    max_recv_wr: recvs,
                    ..ctx.config().qp
                }),
                ..Default::default()
            },
        )
    }

    /// Keeps `keep` receives posted on the request QP `qp`: posts from `*posted` (the
    /// receives posted so far) until it is `keep` ahead of the requests `recv_cq` has counted.
    /// An application chore that the gets themselves never wait for.
    pub fn top_up(&self, qp: &Qp, recv_cq: &Cq, posted: &mut u64, keep: u64) {
        let used = recv_cq.produced();
        while *posted < used + keep {
            if qp.post_recv(self.recv_wr(*posted)).is_err() {
                break;
            }
            *posted += 1;
        }
    }

    /// Posts `n` receives on the request QP (each serves one get).
    pub fn post_recvs(&self, qp: &Qp, n: usize) -> Result<(), VerbsError> {
        for i in 0..n {
            qp.post_recv(self.recv_wr(i as u64))?;
        }
        Ok(())
    }

    /// The worker QPs (for counters).
    pub fn workers(&self) -> impl Iterator<Item = &Qp> {
        self.chains.iter().map(|c| &c.worker)
    }
}
