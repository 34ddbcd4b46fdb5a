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
    /// Firmware version string.
    pub fw_ver: [c_char; 64],
    /// Node GUID (network order).
    pub node_guid: u64,
    /// System image GUID (network order).
    pub sys_image_guid: u64,
    /// Largest memory region in bytes.
    pub max_mr_size: u64,
    /// Supported page sizes (a bit per size).
    pub page_size_cap: u64,
    /// IEEE vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Most QPs.
    pub max_qp: c_int,
    /// Most outstanding work requests per queue.
    pub max_qp_wr: c_int,
    /// `IBV_DEVICE_*` capability bits.
    pub device_cap_flags: c_uint,
    /// Most scatter/gather entries per send or receive request.
    pub max_sge: c_int,
    /// Most scatter/gather entries per RDMA READ.
    pub max_sge_rd: c_int,
    /// Most CQs.
    pub max_cq: c_int,
    /// Most entries per CQ.
    pub max_cqe: c_int,
    /// Most memory regions.
    pub max_mr: c_int,
    /// Most protection domains.
    pub max_pd: c_int,
    /// Most outstanding RDMA READs and atomics a QP accepts as target.
    pub max_qp_rd_atom: c_int,
    /// Per EE context: as `max_qp_rd_atom` (EE contexts are not offered).
    pub max_ee_rd_atom: c_int,
    /// Device-wide resources for incoming RDMA READs and atomics.
    pub max_res_rd_atom: c_int,
    /// Most outstanding RDMA READs and atomics a QP initiates.
    pub max_qp_init_rd_atom: c_int,
    /// Per EE context: as `max_qp_init_rd_atom`.
    pub max_ee_init_rd_atom: c_int,
    /// Atomic guarantees (`IBV_ATOMIC_*`).
    pub atomic_cap: c_int,
    /// Most EE contexts.
    pub max_ee: c_int,
    /// Most RD domains.
    pub max_rdd: c_int,
    /// Most memory windows.
    pub max_mw: c_int,
    /// Most raw IPv6 QPs.
    pub max_raw_ipv6_qp: c_int,
    /// Most raw Ethernet QPs.
    pub max_raw_ethy_qp: c_int,
    /// Most multicast groups.
    pub max_mcast_grp: c_int,
    /// Most QPs per multicast group.
    pub max_mcast_qp_attach: c_int,
    /// Most QP attachments to multicast groups in all.
    pub max_total_mcast_qp_attach: c_int,
    /// Most address handles.
    pub max_ah: c_int,
    /// Most fast memory regions.
    pub max_fmr: c_int,
    /// Most remaps per fast memory region.
    pub max_map_per_fmr: c_int,
    /// Most shared receive queues.
    pub max_srq: c_int,
    /// Most work requests per shared receive queue.
    pub max_srq_wr: c_int,
    /// Most scatter/gather entries per shared receive queue request.
    pub max_srq_sge: c_int,
    /// Entries of the partition key table.
    pub max_pkeys: u16,
    /// Local CA ACK delay (exponent, 4.096 µs × 2^n).
    pub local_ca_ack_delay: u8,
    /// Physical ports.
    pub phys_port_cnt: u8,
}

/// `struct _compat_ibv_port_attr`: the part of `struct ibv_port_attr` before `flags`, which is
/// all the exported `ibv_query_port` may write (old callers pass the short struct).
#[repr(C)]
pub struct IbvPortAttr {
    /// Logical port state (`IBV_PORT_*`).
    pub state: c_int,
    /// Largest MTU (`IBV_MTU_*`).
    pub max_mtu: c_int,
    /// MTU in use (`IBV_MTU_*`).
    pub active_mtu: c_int,
    /// Entries of the GID table.
    pub gid_tbl_len: c_int,
    /// Port capability bits.
    pub port_cap_flags: u32,
    /// Largest message in bytes.
    pub max_msg_sz: u32,
    /// Bad partition key counter.
    pub bad_pkey_cntr: u32,
    /// Q_Key violation counter.
    pub qkey_viol_cntr: u32,
    /// Entries of the partition key table.
    pub pkey_tbl_len: u16,
    /// The port's LID (0 on RoCE).
    pub lid: u16,
    /// The subnet manager's LID.
    pub sm_lid: u16,
    /// LID mask control.
    pub lmc: u8,
    /// Virtual lanes.
    pub max_vl_num: u8,
    /// The subnet manager's service level.
    pub sm_sl: u8,
    /// Subnet propagation delay (exponent).
    pub subnet_timeout: u8,
    /// Type of initialization the SM did.
    pub init_type_reply: u8,
    /// Link width in use.
    pub active_width: u8,
    /// Link speed in use.
    pub active_speed: u8,
    /// Physical port state.
    pub phys_state: u8,
    /// Link layer (`IBV_LINK_LAYER_ETHERNET`).
    pub link_layer: u8,
    /// `flags` (the first field past the compat prefix, in its padding byte): written as 0
    /// so that no padding garbage lands in the caller's full struct.
    pub flags: u8,
}

/// `struct ibv_pd`.
#[repr(C)]
pub struct IbvPd {
    /// The context it belongs to.
    pub context: *mut IbvContext,
    /// The object's handle (here the engine's id of it: PD id, lkey, CQ or QP number).
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct IbvMr {
    /// The context it belongs to.
    pub context: *mut IbvContext,
    /// The protection domain.
    pub pd: *mut IbvPd,
    /// Start of the registered range.
    pub addr: *mut c_void,
    /// Length of the range in bytes.
    pub length: usize,
    /// The object's handle (here the engine's id of it: PD id, lkey, CQ or QP number).
    pub handle: u32,
    /// Local key (for scatter/gather entries).
    pub lkey: u32,
    /// Remote key (for peers' RDMA).
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct IbvCompChannel {
    /// The context it belongs to.
    pub context: *mut IbvContext,
    /// The file descriptor that becomes readable on a completion event.
    pub fd: c_int,
    /// CQs using the channel.
    pub refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct IbvCq {
    /// The context it belongs to.
    pub context: *mut IbvContext,
    /// The completion channel events go to (NULL: none).
    pub channel: *mut IbvCompChannel,
    /// The user's context pointer (returned by `ibv_get_cq_event`).
    pub cq_context: *mut c_void,
    /// The object's handle (here the engine's id of it: PD id, lkey, CQ or QP number).
    pub handle: u32,
    /// Entries the CQ holds.
    pub cqe: c_int,
    /// A mutex the inline functions of `verbs.h` may lock.
    pub mutex: libc::pthread_mutex_t,
    /// A condition variable paired with `mutex`.
    pub cond: libc::pthread_cond_t,
    /// Completion events acknowledged.
    pub comp_events_completed: u32,
    /// Asynchronous events acknowledged.
    pub async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct IbvQp {
    /// The context it belongs to.
    pub context: *mut IbvContext,
    /// The user's context pointer.
    pub qp_context: *mut c_void,
    /// The protection domain.
    pub pd: *mut IbvPd,
    /// The send CQ.
    pub send_cq: *mut IbvCq,
    /// The receive CQ.
    pub recv_cq: *mut IbvCq,
    /// The shared receive queue (NULL: none are offered).
    pub srq: *mut c_void,
    /// The object's handle (here the engine's id of it: PD id, lkey, CQ or QP number).
    pub handle: u32,
    /// The QP number.
    pub qp_num: u32,
    /// The QP state (`IBV_QPS_*`).
    pub state: c_int,
    /// The QP type (`IBV_QPT_RC`).
    pub qp_type: c_int,
    /// A mutex the inline functions of `verbs.h` may lock.
    pub mutex: libc::pthread_mutex_t,
    /// A condition variable paired with `mutex`.
    pub cond: libc::pthread_cond_t,
    /// Asynchronous events acknowledged.
    pub events_completed: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvQpCap {
    /// Most outstanding send work requests.
    pub max_send_wr: u32,
    /// Most outstanding receive work requests.
    pub max_recv_wr: u32,
    /// Most scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Most scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Most bytes a send request may carry inline.
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct IbvQpInitAttr {
    /// The user's context pointer.
    pub qp_context: *mut c_void,
    /// The send CQ.
    pub send_cq: *mut IbvCq,
    /// The receive CQ.
    pub recv_cq: *mut IbvCq,
    /// The shared receive queue (NULL: none are offered).
    pub srq: *mut c_void,
    /// Queue sizes asked for (and granted, written back).
    pub cap: IbvQpCap,
    /// The QP type (`IBV_QPT_RC`).
    pub qp_type: c_int,
    /// Nonzero: every send request completes with a CQE, signaled or not.
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route` (8-aligned: `union ibv_gid` holds two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvGlobalRoute {
    /// Destination GID (here `::ffff:a.b.c.d`, the peer's IPv4 address).
    pub dgid: [u8; 16],
    /// IPv6 flow label.
    pub flow_label: u32,
    /// Index of the source GID.
    pub sgid_index: u8,
    /// Hop limit (TTL).
    pub hop_limit: u8,
    /// Traffic class (DSCP and ECN).
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvAhAttr {
    /// The global route header (RoCE: the peer's address).
    pub grh: IbvGlobalRoute,
    /// Destination LID (unused on RoCE).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Maximum injection rate.
    pub static_rate: u8,
    /// Nonzero: `grh` is valid.
    pub is_global: u8,
    /// Local port.
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvQpAttr {
    /// Target state (`IBV_QPS_*`).
    pub qp_state: c_int,
    /// Assumed current state.
    pub cur_qp_state: c_int,
    /// Path MTU (`IBV_MTU_*`).
    pub path_mtu: c_int,
    /// Path migration state.
    pub path_mig_state: c_int,
    /// Q_Key (UD only).
    pub qkey: u32,
    /// First PSN expected on receive.
    pub rq_psn: u32,
    /// First PSN sent.
    pub sq_psn: u32,
    /// The peer's QP number.
    pub dest_qp_num: u32,
    /// Remote access allowed (`IBV_ACCESS_REMOTE_*`).
    pub qp_access_flags: c_uint,
    /// Queue sizes.
    pub cap: IbvQpCap,
    /// The primary path (the peer's address).
    pub ah_attr: IbvAhAttr,
    /// The alternate path (unused).
    pub alt_ah_attr: IbvAhAttr,
    /// Partition key index.
    pub pkey_index: u16,
    /// Alternate path's partition key index.
    pub alt_pkey_index: u16,
    /// Notify when the SQ drains.
    pub en_sqd_async_notify: u8,
    /// Whether the SQ is draining.
    pub sq_draining: u8,
    /// Outstanding RDMA READs and atomics this QP initiates.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READs and atomics this QP accepts as target.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer (encoded).
    pub min_rnr_timer: u8,
    /// Local port.
    pub port_num: u8,
    /// Local ACK timeout (exponent: 4.096 µs × 2^n).
    pub timeout: u8,
    /// Retries after a timeout.
    pub retry_cnt: u8,
    /// Retries after an RNR NAK (7: forever).
    pub rnr_retry: u8,
    /// Alternate path's port.
    pub alt_port_num: u8,
    /// Alternate path's ACK timeout.
    pub alt_timeout: u8,
    /// Packet pacing rate in kbit/s (0: none).
    pub rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvSge {
    /// Start address in a registered region.
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// The `wr` union of `struct ibv_send_wr`, as its `atomic` member (the largest): `rdma` is
/// `remote_addr` then `rkey` at offset 8, which is `compare_add`'s low half here.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvSendWrWr {
    /// Remote address (RDMA and atomics).
    pub remote_addr: u64,
    /// Atomics: the compare value or the addend (its low half is `rdma.rkey`).
    pub compare_add: u64,
    /// Compare-and-swap: the swap value.
    pub swap: u64,
    /// Atomics: the remote key.
    pub rkey: u32,
}

/// `struct ibv_send_wr`.
#[repr(C)]
pub struct IbvSendWr {
    /// The user's id of the work request, returned in its completion.
    pub wr_id: u64,
    /// The next request of the list (NULL: last).
    pub next: *mut IbvSendWr,
    /// The scatter/gather list.
    pub sg_list: *mut IbvSge,
    /// Entries in `sg_list`.
    pub num_sge: c_int,
    /// The operation (`IBV_WR_*`).
    pub opcode: c_int,
    /// `IBV_SEND_*` flags (signaled, inline, fence...).
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
    /// The user's id of the work request, returned in its completion.
    pub wr_id: u64,
    /// The next request of the list (NULL: last).
    pub next: *mut IbvRecvWr,
    /// The scatter/gather list.
    pub sg_list: *mut IbvSge,
    /// Entries in `sg_list`.
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvWc {
    /// The user's id of the work request, returned in its completion.
    pub wr_id: u64,
    /// Completion status (`enum ibv_wc_status`; 0 success).
    pub status: c_int,
    /// What completed (`IBV_WC_*`).
    pub opcode: c_int,
    /// Vendor error code.
    pub vendor_err: u32,
    /// Bytes received (receive completions).
    pub byte_len: u32,
    /// Immediate data (network order), when `wc_flags` has `IBV_WC_WITH_IMM`.
    pub imm_data: u32,
    /// The local QP number.
    pub qp_num: u32,
    /// The remote QP number.
    pub src_qp: u32,
    /// `IBV_WC_*` flags.
    pub wc_flags: c_uint,
    /// Partition key index (GSI only).
    pub pkey_index: u16,
    /// Source LID (UD only).
    pub slid: u16,
    /// Service level (UD only).
    pub sl: u8,
    /// Destination LID path bits (UD only).
    pub dlid_path_bits: u8,
}

/// `struct ibv_gid_entry` (8-aligned, as `union ibv_gid`).
#[repr(C, align(8))]
pub struct IbvGidEntry {
    /// The GID.
    pub gid: [u8; 16],
    /// Its index in the GID table.
    pub gid_index: u32,
    /// The port.
    pub port_num: u32,
    /// `IBV_GID_TYPE_*`.
    pub gid_type: u32,
    /// The network interface index of the GID.
    pub ndev_ifindex: u32,
}

// enum values of verbs.h
/// `IBV_NODE_CA`: a channel adapter.
pub const IBV_NODE_CA: c_int = 1;
/// `IBV_TRANSPORT_IB`: the InfiniBand transport (RoCE included).
pub const IBV_TRANSPORT_IB: c_int = 0;
/// `IBV_PORT_ACTIVE`: the port is up.
pub const IBV_PORT_ACTIVE: c_int = 4;
/// `IBV_MTU_256`.
pub const IBV_MTU_256: c_int = 1;
/// `IBV_MTU_4096`.
pub const IBV_MTU_4096: c_int = 5;
/// `IBV_LINK_LAYER_ETHERNET` (RoCE).
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
/// `IBV_ATOMIC_HCA`: atomics are atomic among this device's QPs.
pub const IBV_ATOMIC_HCA: c_int = 1;
/// `IBV_GID_TYPE_ROCE_V2` (of `struct ibv_gid_entry`).
pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;
/// `enum ibv_gid_type_sysfs`'s `IBV_GID_TYPE_SYSFS_ROCE_V2` (what `ibv_query_gid_type` writes).
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: c_int = 1;

/// QP state `IBV_QPS_RESET`.
pub const IBV_QPS_RESET: c_int = 0;
/// QP state `IBV_QPS_INIT`.
pub const IBV_QPS_INIT: c_int = 1;
/// QP state `IBV_QPS_RTR` (ready to receive).
pub const IBV_QPS_RTR: c_int = 2;
/// QP state `IBV_QPS_RTS` (ready to send).
pub const IBV_QPS_RTS: c_int = 3;
/// QP state `IBV_QPS_ERR`.
pub const IBV_QPS_ERR: c_int = 6;

/// QP type `IBV_QPT_RC` (reliable connected, the only one offered).
pub const IBV_QPT_RC: c_int = 2;

/// `ibv_modify_qp` mask bit: `qp_state`.
pub const IBV_QP_STATE: c_int = 1 << 0;
/// `ibv_modify_qp` mask bit: `qp_access_flags`.
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
/// `ibv_modify_qp` mask bit: `ah_attr`.
pub const IBV_QP_AV: c_int = 1 << 7;
/// `ibv_modify_qp` mask bit: `path_mtu`.
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
/// `ibv_modify_qp` mask bit: `timeout`.
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
/// `ibv_modify_qp` mask bit: `retry_cnt`.
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
/// `ibv_modify_qp` mask bit: `rnr_retry`.
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
/// `ibv_modify_qp` mask bit: `rq_psn`.
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
/// `ibv_modify_qp` mask bit: `max_rd_atomic`.
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
/// `ibv_modify_qp` mask bit: `min_rnr_timer`.
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
/// `ibv_modify_qp` mask bit: `sq_psn`.
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
/// `ibv_modify_qp` mask bit: `max_dest_rd_atomic`.
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
/// `ibv_modify_qp` mask bit: `dest_qp_num`.
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

/// Send opcode `IBV_WR_RDMA_WRITE`.
pub const IBV_WR_RDMA_WRITE: c_int = 0;
/// Send opcode `IBV_WR_RDMA_WRITE_WITH_IMM`.
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
/// Send opcode `IBV_WR_SEND`.
pub const IBV_WR_SEND: c_int = 2;
/// Send opcode `IBV_WR_SEND_WITH_IMM`.
pub const IBV_WR_SEND_WITH_IMM: c_int = 3;
/// Send opcode `IBV_WR_RDMA_READ`.
pub const IBV_WR_RDMA_READ: c_int = 4;
/// Send opcode `IBV_WR_ATOMIC_CMP_AND_SWP`.
pub const IBV_WR_ATOMIC_CMP_AND_SWP: c_int = 5;
/// Send opcode `IBV_WR_ATOMIC_FETCH_AND_ADD`.
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_int = 6;

/// Completion opcode `IBV_WC_SEND`.
pub const IBV_WC_SEND: c_int = 0;
/// Completion opcode `IBV_WC_RDMA_WRITE`.
pub const IBV_WC_RDMA_WRITE: c_int = 1;
/// Completion opcode `IBV_WC_RDMA_READ`.
pub const IBV_WC_RDMA_READ: c_int = 2;
/// Completion opcode `IBV_WC_COMP_SWAP`.
pub const IBV_WC_COMP_SWAP: c_int = 3;
/// Completion opcode `IBV_WC_FETCH_ADD`.
pub const IBV_WC_FETCH_ADD: c_int = 4;
/// Completion opcode `IBV_WC_RECV`.
pub const IBV_WC_RECV: c_int = 128;
/// Completion opcode `IBV_WC_RECV_RDMA_WITH_IMM`.
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_int = 129;
/// Completion flag `IBV_WC_WITH_IMM`: `imm_data` is valid.
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;

/// Access flag `IBV_ACCESS_LOCAL_WRITE`.
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
/// Access flag `IBV_ACCESS_REMOTE_WRITE`.
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
/// Access flag `IBV_ACCESS_REMOTE_READ`.
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;
/// Access flag `IBV_ACCESS_REMOTE_ATOMIC`.
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
