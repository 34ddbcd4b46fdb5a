//! The offload operations of `nsperf client`: batched READ, list walk (offloaded or client-side)
//! and the RedN hash get, each verified, each with its reference run interleaved in the same
//! invocation (`--pairs`): 32 separate READs, the other walk mode, one 64-byte READ.

use super::args::ClientArgs;
use super::completion::next_wc;
use super::{Hello, Op, WalkMode, Welcome, LIST_NODES, TABLE_BUCKETS, VALUE_LEN};
use crate::bench::{histogram, median, pattern_byte, BenchResult};
use anyhow::{bail, Context as _, Result};
use netstack::cm;
use netstack::offload::builtin;
use netstack::verbs::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// One connected QP to an `nsperf server`.
struct Conn {
    _ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    w: Welcome,
}

fn connect(a: &ClientArgs, cm_addr: SocketAddr, op: Op, mr_len: usize) -> Result<Conn> {
    let qp = RcConfig {
        mtu: a.mtu,
        recovery: a.recovery,
        ..Default::default()
    };
    let ctx = Context::open(a.context_config(qp, ContextConfig::default().path_ports)?)?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4096)?;
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default())?;
    let mr = pd.reg_mr(mr_len, Access::ALL)?;
    let hello = Hello {
        op,
        size: a.size,
        depth: a.depth,
        echo: false,
        low_latency: false,
        signaled: false,
        resp_addr: mr.addr(),
        resp_rkey: mr.rkey(),
        need: 0,
        session: 0,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let pd_bytes = serde_json::to_vec(&hello)?;
    let reply = rt.block_on(async {
        let mut c = cm::Connector::new(cm_addr).await?;
        c.connect(&qp, pd_bytes).await
    })?;
    let w: Welcome = serde_json::from_slice(&reply).context("bad welcome from server")?;
    if op != Op::Read && w.list_head == 0 {
        bail!("the server offers no offload data (an older nsperf server?)");
    }
    Ok(Conn {
        _ctx: ctx,
        _pd: pd,
        cq,
        qp,
        mr,
        w,
    })
}

/// The next completion, waiting as the run's discipline says.
fn wait_wc(cq: &Cq, limit: Instant, wait: super::reference::Wait) -> Result<Wc> {
    let mut wc = [EMPTY_WC];
    next_wc(cq, &mut wc, limit, wait)?;
    Ok(wc[0])
}

fn ok(wc: &Wc) -> Result<()> {
    if wc.status != WcStatus::Success {
        bail!(
            "work completion {:?} (vendor_err {}) for wr {}",
            wc.status,
            wc.vendor_err,
            wc.wr_id
        );
    }
    Ok(())
}

/// A run's row; `c` says which ICRC mode its connection runs.
#[allow(clippy::too_many_arguments)]
fn result(
    c: &Conn,
    bench: &str,
    msg_bytes: u64,
    depth: u32,
    ops: u64,
    bytes: u64,
    secs: f64,
    verified: bool,
    h: &hdrhistogram::Histogram<u64>,
) -> BenchResult {
    let mut r = BenchResult {
        bench: bench.into(),
        system: "flexns".into(),
        transport: Some("rc".into()),
        msg_bytes,
        qps: 1,
        depth,
        bytes,
        ops,
        secs,
        verified,
        ..Default::default()
    };
    r.latencies(h);
    r.rates();
    r.extra.insert("icrc".into(), c.qp.icrc_mode().name().into());
    r
}

/// Batched READs at depth `--depth`: each request fetches `--batch` ranges of `--size` bytes
/// from the server's patterned region; `ops` counts ranges (READ equivalents).
fn batch_read(a: &ClientArgs, cm_addr: SocketAddr) -> Result<BenchResult> {
    let (n, size, depth) = (a.batch as usize, a.size as usize, a.depth as usize);
    if n == 0 || n * 16 + 8 + 8 > a.mtu as usize {
        bail!("--batch: {n} ranges do not fit one {}-byte request", a.mtu);
    }
    let resp = n * size;
    let c = connect(a, cm_addr, Op::BatchRead, resp * depth)?;
    let span = (c.w.len as usize / size).max(1);
    let ranges = |slot: usize, round: u64| -> Vec<(u64, u32)> {
        (0..n)
            .map(|i| {
                let k = (slot * 7919 + i * 104_729 + round as usize * 31) % span;
                (c.w.addr + (k * size) as u64, size as u32)
            })
            .collect()
    };
    let mut round = vec![0u64; depth];
    let mut posted_at = vec![Instant::now(); depth];
    let mut h = histogram();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(a.duration);
    let limit = end + Duration::from_secs(30);
    for s in 0..depth {
        c.qp.post_offload(
            s as u64,
            builtin::BATCH_READ,
            &builtin::encode_batch_read(c.w.rkey, &ranges(s, 0)),
            c.mr.sge(s * resp, resp),
        )?;
    }
    let (mut ops, mut outstanding, mut verified) = (0u64, depth, true);
    let mut got = vec![0u8; resp];
    while outstanding > 0 {
        let wc = wait_wc(&c.cq, limit, a.wait_mode())?;
        ok(&wc)?;
        let s = wc.wr_id as usize;
        let now = Instant::now();
        h.record((now - posted_at[s]).as_nanos().max(1) as u64)?;
        verified &= wc.byte_len as usize == resp;
        // check one response in 64 in full (the check costs the client more than the READs)
        if round[s] % 64 == 0 {
            c.mr.read(s * resp, &mut got);
            for (i, (addr, len)) in ranges(s, round[s]).into_iter().enumerate() {
                let off = addr - c.w.addr;
                verified &= (0..len as usize).all(|j| got[i * size + j] == pattern_byte(off + j as u64, c.w.seed));
            }
        }
        ops += n as u64;
        if now < end && !crate::procs::stopping() {
            round[s] += 1;
            posted_at[s] = now;
            c.qp.post_offload(
                s as u64,
                builtin::BATCH_READ,
                &builtin::encode_batch_read(c.w.rkey, &ranges(s, round[s])),
                c.mr.sge(s * resp, resp),
            )?;
        } else {
            outstanding -= 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let mut r = result(
        &c,
        "batch_read_rate",
        a.size,
        a.depth,
        ops,
        ops * size as u64,
        secs,
        verified,
        &h,
    );
    r.extra.insert("batch".into(), n.into());
    r.extra.insert("requests".into(), (ops / n as u64).into());
    Ok(r)
}

/// Looks up the `--hops`-th node of the server's list, one lookup at a time.
fn list_walk(a: &ClientArgs, cm_addr: SocketAddr, mode: WalkMode) -> Result<BenchResult> {
    if a.hops == 0 || a.hops > LIST_NODES {
        bail!("--hops: {} not in 1..={LIST_NODES}", a.hops);
    }
    let node = 16 + VALUE_LEN;
    let c = connect(a, cm_addr, Op::ListWalk, 4096)?;
    let key = a.hops as u64; // node j holds key j + 1
    let want = super::value_of(key);
    let mut h = histogram();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(a.duration);
    let limit = end + Duration::from_secs(30);
    let (mut ops, mut verified, mut reads) = (0u64, true, 0u64);
    let mut v = vec![0u8; VALUE_LEN];
    while crate::procs::running_until(end) {
        let t = Instant::now();
        match mode {
            WalkMode::Offload => {
                let req = builtin::encode_list_walk(key, c.w.list_head, LIST_NODES, c.w.kv_rkey);
                c.qp.post_offload(0, builtin::LIST_WALK, &req, c.mr.sge(0, 8 + VALUE_LEN))?;
                let wc = wait_wc(&c.cq, limit, a.wait_mode())?;
                ok(&wc)?;
                let mut hdr = [0u8; 8];
                c.mr.read(0, &mut hdr);
                verified &= u32::from_le_bytes(hdr[..4].try_into()?) == builtin::FOUND;
                verified &= u32::from_le_bytes(hdr[4..].try_into()?) == a.hops;
                c.mr.read(8, &mut v);
            }
            WalkMode::Client => {
                let mut addr = c.w.list_head;
                let mut found = false;
                while addr != 0 {
                    c.qp.post_send(
                        SendWr::new(0, WrOpcode::RdmaRead)
                            .sge(c.mr.sge(0, node))
                            .remote(addr, c.w.kv_rkey),
                    )?;
                    ok(&wait_wc(&c.cq, limit, a.wait_mode())?)?;
                    reads += 1;
                    let k = c.mr.load_u64(0).unwrap_or(0);
                    if k == key {
                        found = true;
                        break;
                    }
                    addr = c.mr.load_u64(8).unwrap_or(0);
                }
                verified &= found;
                c.mr.read(16, &mut v);
            }
        }
        h.record(t.elapsed().as_nanos().max(1) as u64)?;
        verified &= v == want;
        ops += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let mut r = result(
        &c,
        "list_walk_lat",
        VALUE_LEN as u64,
        1,
        ops,
        ops * VALUE_LEN as u64,
        secs,
        verified,
        &h,
    );
    r.system = format!(
        "flexns walk={}",
        if mode == WalkMode::Offload { "offload" } else { "client" }
    );
    r.extra.insert("hops".into(), a.hops.into());
    r.extra.insert(
        "round_trips_per_lookup".into(),
        if mode == WalkMode::Offload {
            1.0
        } else {
            reads as f64 / ops.max(1) as f64
        }
        .into(),
    );
    Ok(r)
}

/// RedN hash gets, one at a time: a SEND of the key and its bucket, answered by a
/// WRITE_WITH_IMM of the value from the server's chain.
fn redn_get(a: &ClientArgs, cm_addr: SocketAddr) -> Result<BenchResult> {
    let c = connect(a, cm_addr, Op::RednGet, 4096)?;
    for i in 0..64 {
        c.qp.post_recv(RecvWr {
            wr_id: i,
            sg_list: [c.mr.sge(2048, 4)].into_iter().collect(),
        })?;
    }
    let mut h = histogram();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(a.duration);
    let (mut ops, mut verified) = (0u64, true);
    let mut v = vec![0u8; VALUE_LEN];
    let mut k = 1u64;
    while crate::procs::running_until(end) {
        k = k.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) % TABLE_BUCKETS + 1;
        let id = ops as u32;
        let msg = netstack::redn::programs::hash_get_request(k, id, &[c.w.table_addr + (k % TABLE_BUCKETS) * 16]);
        c.mr.write(1024, &msg);
        let t = Instant::now();
        c.qp.post_send(
            SendWr::new(1, WrOpcode::Send)
                .sge(c.mr.sge(1024, msg.len()))
                .flags(SendFlags::INLINE),
        )?;
        // a hit is always answered; a lost chain would leave the client waiting a second
        let limit = Instant::now() + Duration::from_secs(1);
        loop {
            let wc = wait_wc(&c.cq, limit, a.wait_mode()).context("no RedN answer within a second")?;
            ok(&wc)?;
            if wc.opcode == WcOpcode::RecvRdmaWithImm {
                verified &= wc.imm_data == Some(id);
                c.qp.post_recv(RecvWr {
                    wr_id: wc.wr_id,
                    sg_list: [c.mr.sge(2048, 4)].into_iter().collect(),
                })?;
                break;
            }
        }
        h.record(t.elapsed().as_nanos().max(1) as u64)?;
        c.mr.read(0, &mut v);
        verified &= v == super::value_of(k);
        ops += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let mut r = result(
        &c,
        "redn_get_lat",
        VALUE_LEN as u64,
        1,
        ops,
        ops * VALUE_LEN as u64,
        secs,
        verified,
        &h,
    );
    r.extra.insert("round_trips_per_get".into(), 1.into());
    Ok(r)
}

/// Runs an offload operation, interleaved with its reference when `--pairs` > 0 and
/// `--no-reference` is not given, and prints a ratio line.
pub fn run(
    a: &ClientArgs,
    cm_addr: SocketAddr,
    procs: &[crate::bench::Proc],
    read_ref: impl Fn(&ClientArgs) -> Result<BenchResult>,
) -> Result<Vec<BenchResult>> {
    let measured = |f: &dyn Fn() -> Result<BenchResult>| -> Result<BenchResult> {
        let meter = crate::bench::Meter::start(procs);
        let mut r = f()?;
        r.account(&meter.finish());
        r.extra.insert("wait".into(), a.wait_mode().name().into());
        r.incomplete = crate::procs::stopping();
        Ok(r)
    };
    let main = |a: &ClientArgs| -> Result<BenchResult> {
        match a.op {
            Op::BatchRead => batch_read(a, cm_addr),
            Op::ListWalk => list_walk(a, cm_addr, a.mode),
            Op::RednGet => redn_get(a, cm_addr),
            _ => bail!("not an offload operation"),
        }
    };
    // the references: 64 B READs at the same depth; the other walk mode; one 64 B READ
    let reference = |a: &ClientArgs| -> Result<BenchResult> {
        match a.op {
            Op::ListWalk => {
                let other = if a.mode == WalkMode::Offload {
                    WalkMode::Client
                } else {
                    WalkMode::Offload
                };
                list_walk(a, cm_addr, other)
            }
            Op::BatchRead => read_ref(&ClientArgs {
                op: Op::Read,
                ..a.clone()
            }),
            _ => read_ref(&ClientArgs {
                op: Op::Read,
                size: 64,
                depth: 1,
                ..a.clone()
            }),
        }
    };
    let mut out = Vec::new();
    let pairs = if a.no_reference { 0 } else { a.pairs };
    if pairs == 0 {
        let r = measured(&|| main(a))?;
        r.print(a.json);
        out.push(r);
        return Ok(out);
    }
    let lat = a.op != Op::BatchRead;
    let mut ratios = Vec::new();
    let mut cpu_ratios = Vec::new();
    let cpu = |r: &BenchResult| {
        r.extra
            .get("cpu_us_per_op")
            .and_then(|v| v.as_f64())
            .unwrap_or(f64::NAN)
    };
    for _ in 0..pairs {
        if crate::procs::stopping() {
            break;
        }
        let x = measured(&|| main(a))?;
        x.print(a.json);
        if x.incomplete {
            out.push(x);
            break;
        }
        let y = measured(&|| reference(a))?;
        y.print(a.json);
        if y.incomplete {
            out.extend([x, y]);
            break;
        }
        cpu_ratios.push((cpu(&x) / cpu(&y) * 1000.0).round() / 1000.0);
        ratios.push(if lat {
            x.p50_us.unwrap_or(f64::NAN) / y.p50_us.unwrap_or(f64::NAN)
        } else {
            x.mops / y.mops
        });
        out.push(x);
        out.push(y);
    }
    if ratios.is_empty() {
        return Ok(out); // interrupted before a whole pair
    }
    let pairs = ratios.len();
    let ratio = (median(&mut ratios) * 1000.0).round() / 1000.0;
    let metric = if lat { "p50_us" } else { "mops" };
    let reference = match a.op {
        Op::ListWalk => format!(
            "flexns walk={}",
            if a.mode == WalkMode::Offload {
                "client"
            } else {
                "offload"
            }
        ),
        Op::BatchRead => format!("flexns read {} B depth {}", a.size, a.depth),
        _ => "flexns read 64 B depth 1".into(),
    };
    let cpu_ratio = (median(&mut cpu_ratios) * 1000.0).round() / 1000.0;
    let line = serde_json::json!({"bench": "ratio", "metric": metric, "system": out[0].system, "op": a.op,
        "reference": reference, "msg_bytes": out[0].msg_bytes, "depth": out[0].depth, "pairs": pairs, "ratio": ratio, "ratios": ratios,
        "cpu_us_per_op_ratio": cpu_ratio, "wait": a.wait_mode().name(),
        "verified": out.iter().all(|r| r.verified)});
    if a.json {
        println!("{line}");
    } else {
        println!(
            "ratio {} {:?} / {reference} ({metric}), median of {pairs} pairs: {ratio}",
            out[0].system, a.op
        );
    }
    Ok(out)
}
