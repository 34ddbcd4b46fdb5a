//! The C types of `<infiniband/verbs.h>` this library reads and writes, written from the header
//! (ABI facts: field order and types), and the constants of its enums. `tests/abi_layout.rs`
//! compiles a C program against the real header and compares every offset and size listed by
//! [`layout`] with these.

use libc::{c_char, c_int, c_uint, c_void};
use std::ptr;

/// `struct ibv_device`.
#[repr(C)]
pub struct IbvDevice {
    /// `_ops`: two obsolete function pointers, NULL.
    pub ops: [usize; 2],
    /// `enum ibv_node_type`.
    pub node_type: c_int,
    /// `enum ibv_transport_type`.
    pub transport_type: c_int,
    /// Kernel device name.
    pub name: [c_char; 64],
    /// uverbs device name.
    pub dev_name: [c_char; 64],
    /// uverbs sysfs path.
    pub dev_path: [c_char; 256],
    /// Device sysfs path.
    pub ibdev_path: [c_char; 256],
}

/// `ops.poll_cq`.
pub type PollCqFn = unsafe extern "C" fn(*mut IbvCq, c_int, *mut IbvWc) -> c_int;
/// `ops.req_notify_cq`.
pub type ReqNotifyFn = unsafe extern "C" fn(*mut IbvCq, c_int) -> c_int;
/// `ops.post_send`.
pub type PostSendFn = unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
/// `ops.post_recv`.
pub type PostRecvFn = unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;
/// `ops.post_srq_recv`.
pub type PostSrqRecvFn = unsafe extern "C" fn(*mut c_void, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;

/// `struct ibv_context_ops`: 32 pointers, of which the inline functions of `verbs.h` call
/// `poll_cq`, `req_notify_cq`, `post_srq_recv`, `post_send` and `post_recv`.
#[repr(C)]
pub struct IbvContextOps {
    /// `_compat_query_device` .. `_compat_create_cq` (11 pointers, NULL).
    pub compat_a: [usize; 11],
    /// `poll_cq`.
    pub poll_cq: Option<PollCqFn>,
    /// `req_notify_cq`.
    pub req_notify_cq: Option<ReqNotifyFn>,
    /// `_compat_cq_event` .. `_compat_destroy_srq` (7 pointers, NULL).
    pub compat_b: [usize; 7],
    /// `post_srq_recv`.
    pub post_srq_recv: Option<PostSrqRecvFn>,
    /// `_compat_create_qp` .. `_compat_destroy_qp` (4 pointers, NULL).
    pub compat_c: [usize; 4],
    /// `post_send`.
    pub post_send: Option<PostSendFn>,
    /// `post_recv`.
    pub post_recv: Option<PostRecvFn>,
    /// `_compat_create_ah` .. `_compat_async_event` (5 pointers, NULL).
    pub compat_d: [usize; 5],
}

/// `struct ibv_context`. Its `abi_compat` is not `__VERBS_ABI_IS_EXTENDED`, so the inline
/// functions never look for a `struct verbs_context` before it: extended verbs fall back to the
/// exported functions or fail with `EOPNOTSUPP`.
#[repr(C)]
pub struct IbvContext {
    /// The device.
    pub device: *mut IbvDevice,
    /// The operations the inline functions call.
    pub ops: IbvContextOps,
    /// Command fd.
    pub cmd_fd: c_int,
    /// Asynchronous-event fd.
    pub async_fd: c_int,
    /// Completion vectors.
    pub num_comp_vectors: c_int,
    /// A mutex some programs lock.
    pub mutex: libc::pthread_mutex_t,
    /// Not `__VERBS_ABI_IS_EXTENDED` (NULL).
    pub abi_compat: *mut c_void,
}

/// `struct ibv_device_attr`.
#[repr(C)]
pub struct IbvDeviceAttr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct _compat_ibv_port_attr`: the part of `struct ibv_port_attr` before `flags`, which is
/// all the exported `ibv_query_port` may write (old callers pass the short struct).
#[repr(C)]
pub struct IbvPortAttr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    /// `flags` (the first field past the compat prefix, in its padding byte): written as 0
    /// so that no padding garbage lands in the caller's full struct.
    pub flags: u8,
}

/// `struct ibv_pd`.
#[repr(C)]
pub struct IbvPd {
    pub context: *mut IbvContext,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub cap: IbvQpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route` (8-aligned: `union ibv_gid` holds two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvGlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvQpAttr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `wr` union of `struct ibv_send_wr`, as its `atomic` member (the largest): `rdma` is
/// `remote_addr` then `rkey` at offset 8, which is `compare_add`'s low half here.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvSendWrWr {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `struct ibv_send_wr`.
#[repr(C)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    /// `imm_data` (network order) or `invalidate_rkey`.
    pub imm_data: u32,
    /// The `wr` union.
    pub wr: IbvSendWrWr,
    /// The `qp_type` union (`xrc.remote_srqn`).
    pub qp_type: u32,
    /// The `bind_mw`/`tso` union (unused here): `bind_mw` is a pointer, a key, and a
    /// `struct ibv_mw_bind_info` of a pointer, two u64s and an unsigned int.
    pub bind_mw: [u64; 6],
}

impl IbvSendWr {
    /// `wr.rdma.rkey` (offset 8 of the union).
    pub fn rdma_rkey(&self) -> u32 {
        // SAFETY: `wr.rdma.rkey` is the u32 at offset 8 of the union, which is `compare_add`'s
        // first 4 bytes (8-aligned); only those 4 bytes are read (the 4 after them are padding
        // a program need not initialise).
        unsafe { ptr::read(ptr::addr_of!(self.wr.compare_add).cast::<u32>()) }
    }
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvWc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_gid_entry` (8-aligned, as `union ibv_gid`).
#[repr(C, align(8))]
pub struct IbvGidEntry {
    pub gid: [u8; 16],
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

// enum values of verbs.h
pub const IBV_NODE_CA: c_int = 1;
pub const IBV_TRANSPORT_IB: c_int = 0;
pub const IBV_PORT_ACTIVE: c_int = 4;
pub const IBV_MTU_256: c_int = 1;
pub const IBV_MTU_4096: c_int = 5;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
pub const IBV_ATOMIC_HCA: c_int = 1;
pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;
/// `enum ibv_gid_type_sysfs`'s `IBV_GID_TYPE_SYSFS_ROCE_V2` (what `ibv_query_gid_type` writes).
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: c_int = 1;

pub const IBV_QPS_RESET: c_int = 0;
pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;
pub const IBV_QPS_ERR: c_int = 6;

pub const IBV_QPT_RC: c_int = 2;

pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

pub const IBV_WR_RDMA_WRITE: c_int = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
pub const IBV_WR_SEND: c_int = 2;
pub const IBV_WR_SEND_WITH_IMM: c_int = 3;
pub const IBV_WR_RDMA_READ: c_int = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: c_int = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_int = 6;

pub const IBV_WC_SEND: c_int = 0;
pub const IBV_WC_RDMA_WRITE: c_int = 1;
pub const IBV_WC_RDMA_READ: c_int = 2;
pub const IBV_WC_COMP_SWAP: c_int = 3;
pub const IBV_WC_FETCH_ADD: c_int = 4;
pub const IBV_WC_RECV: c_int = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_int = 129;
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;

pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;
pub const IBV_ACCESS_REMOTE_ATOMIC: c_int = 8;
/// `IBV_ACCESS_MW_BIND`: memory windows do not exist here; accepted and ignored (no window can
/// be bound).
pub const IBV_ACCESS_MW_BIND: c_int = 16;
/// `IBV_ACCESS_OPTIONAL_RANGE`: hints a provider may ignore (relaxed ordering and the like).
pub const IBV_ACCESS_OPTIONAL_RANGE: c_int = 0x3ff0_0000;

/// `enum ibv_wc_status`'s names, by value (what `ibv_wc_status_str` returns).
pub const WC_STATUS_STR: [&std::ffi::CStr; 23] = [
    c"success",
    c"local length error",
    c"local QP operation error",
    c"local EE context operation error",
    c"local protection error",
    c"Work Request Flushed Error",
    c"memory management operation error",
    c"bad response error",
    c"local access error",
    c"remote invalid request error",
    c"remote access error",
    c"remote operation error",
    c"transport retry counter exceeded",
    c"RNR retry counter exceeded",
    c"local RDD violation error",
    c"remote invalid RD request",
    c"aborted error",
    c"invalid EE context number",
    c"invalid EE context state",
    c"fatal error",
    c"response timeout error",
    c"general error",
    c"TM error",
];

/// `(name, value)` of every offset and size the ABI test checks against the real header: a
/// name `struct.field` is `offsetof(struct ibv_struct, field)`, a name `struct` its `sizeof`.
pub fn layout() -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    macro_rules! off {
        ($t:ty, $c:literal, $($f:ident => $cf:literal),*) => {
            vec![($c, size_of::<$t>()), $((concat!($c, ".", $cf), offset_of!($t, $f))),*]
        };
    }
    let mut v = Vec::new();
    v.extend(off!(IbvDevice, "ibv_device", node_type => "node_type", name => "name", dev_name => "dev_name", dev_path => "dev_path", ibdev_path => "ibdev_path"));
    v.extend(off!(IbvContextOps, "ibv_context_ops", poll_cq => "poll_cq", req_notify_cq => "req_notify_cq", post_srq_recv => "post_srq_recv", post_send => "post_send", post_recv => "post_recv"));
    v.extend(off!(IbvContext, "ibv_context", ops => "ops", cmd_fd => "cmd_fd", async_fd => "async_fd", num_comp_vectors => "num_comp_vectors", mutex => "mutex", abi_compat => "abi_compat"));
    v.extend(off!(IbvDeviceAttr, "ibv_device_attr", node_guid => "node_guid", max_mr_size => "max_mr_size", vendor_id => "vendor_id", max_qp_wr => "max_qp_wr", max_sge => "max_sge", max_qp_rd_atom => "max_qp_rd_atom", atomic_cap => "atomic_cap", max_srq_sge => "max_srq_sge", max_pkeys => "max_pkeys", phys_port_cnt => "phys_port_cnt"));
    // the compat prefix of `struct ibv_port_attr` (the header only declares the compat struct):
    // offsets, and its size up to `port_cap_flags2` (the next field past `flags`)
    v.extend(off!(IbvPortAttr, "ibv_port_attr", gid_tbl_len => "gid_tbl_len", max_msg_sz => "max_msg_sz", pkey_tbl_len => "pkey_tbl_len", lid => "lid", lmc => "lmc", active_width => "active_width", phys_state => "phys_state", link_layer => "link_layer", flags => "flags"));
    let sz = v.iter().position(|e| e.0 == "ibv_port_attr").expect("pushed above");
    v[sz] = ("ibv_port_attr.port_cap_flags2", size_of::<IbvPortAttr>());
    v.extend(off!(IbvPd, "ibv_pd", handle => "handle"));
    v.extend(off!(IbvMr, "ibv_mr", addr => "addr", length => "length", lkey => "lkey", rkey => "rkey"));
    v.extend(off!(IbvCompChannel, "ibv_comp_channel", fd => "fd", refcnt => "refcnt"));
    v.extend(off!(IbvCq, "ibv_cq", channel => "channel", cq_context => "cq_context", cqe => "cqe", mutex => "mutex", cond => "cond", comp_events_completed => "comp_events_completed", async_events_completed => "async_events_completed"));
    v.extend(off!(IbvQp, "ibv_qp", pd => "pd", send_cq => "send_cq", recv_cq => "recv_cq", srq => "srq", qp_num => "qp_num", state => "state", qp_type => "qp_type", mutex => "mutex", cond => "cond", events_completed => "events_completed"));
    v.extend(off!(IbvQpInitAttr, "ibv_qp_init_attr", cap => "cap", qp_type => "qp_type", sq_sig_all => "sq_sig_all"));
    v.extend(off!(IbvAhAttr, "ibv_ah_attr", dlid => "dlid", is_global => "is_global", port_num => "port_num"));
    v.extend(off!(IbvGlobalRoute, "ibv_global_route", flow_label => "flow_label", sgid_index => "sgid_index", traffic_class => "traffic_class"));
    v.extend(off!(IbvQpAttr, "ibv_qp_attr", qkey => "qkey", rq_psn => "rq_psn", sq_psn => "sq_psn", dest_qp_num => "dest_qp_num", qp_access_flags => "qp_access_flags", cap => "cap", ah_attr => "ah_attr", alt_ah_attr => "alt_ah_attr", pkey_index => "pkey_index", max_rd_atomic => "max_rd_atomic", max_dest_rd_atomic => "max_dest_rd_atomic", min_rnr_timer => "min_rnr_timer", port_num => "port_num", timeout => "timeout", retry_cnt => "retry_cnt", rnr_retry => "rnr_retry", rate_limit => "rate_limit"));
    v.extend(off!(IbvSge, "ibv_sge", length => "length", lkey => "lkey"));
    v.extend(off!(IbvSendWr, "ibv_send_wr", next => "next", sg_list => "sg_list", num_sge => "num_sge", opcode => "opcode", send_flags => "send_flags", imm_data => "imm_data", wr => "wr", qp_type => "qp_type"));
    v.extend(off!(IbvRecvWr, "ibv_recv_wr", next => "next", sg_list => "sg_list", num_sge => "num_sge"));
    v.extend(off!(IbvWc, "ibv_wc", status => "status", opcode => "opcode", vendor_err => "vendor_err", byte_len => "byte_len", imm_data => "imm_data", qp_num => "qp_num", src_qp => "src_qp", wc_flags => "wc_flags", pkey_index => "pkey_index", slid => "slid", sl => "sl", dlid_path_bits => "dlid_path_bits"));
    v.extend(off!(IbvGidEntry, "ibv_gid_entry", gid_index => "gid_index", port_num => "port_num", gid_type => "gid_type", ndev_ifindex => "ndev_ifindex"));
    // the `wr` union's members, as offsets inside `struct ibv_send_wr`
    let wr = offset_of!(IbvSendWr, wr);
    v.push(("ibv_send_wr.wr.rdma.remote_addr", wr));
    v.push(("ibv_send_wr.wr.rdma.rkey", wr + 8));
    v.push((
        "ibv_send_wr.wr.atomic.compare_add",
        wr + offset_of!(IbvSendWrWr, compare_add),
    ));
    v.push(("ibv_send_wr.wr.atomic.swap", wr + offset_of!(IbvSendWrWr, swap)));
    v.push(("ibv_send_wr.wr.atomic.rkey", wr + offset_of!(IbvSendWrWr, rkey)));
    v
}
