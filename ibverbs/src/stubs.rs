//! The functions of `libmlx5.so.1`, `libefa.so.1` and `librdmacm.so.1` that perftest's
//! binaries import. Those libraries are rdma-core providers and the connection manager; the
//! real ones need rdma-core's private symbols, which this libibverbs does not offer, so
//! `scripts/build-ibverbs.sh` links these instead. Each fails the documented way (NULL or -1
//! with `errno` = `EOPNOTSUPP`, or the error number itself where the function returns one), so
//! a program that asks for vendor extensions or rdma_cm gets a clean error.

use crate::{report, set_errno};
use libc::{c_char, c_int, c_void, EOPNOTSUPP};

/// Reports the refused call, sets `errno` and returns NULL.
fn null(name: &str) -> *mut c_void {
    report(&format!("{name}: not supported by flexns (EOPNOTSUPP)"));
    set_errno(EOPNOTSUPP);
    std::ptr::null_mut()
}

/// Reports the refused call, sets `errno` and returns -1.
fn minus_one(name: &str) -> c_int {
    report(&format!("{name}: not supported by flexns (EOPNOTSUPP)"));
    set_errno(EOPNOTSUPP);
    -1
}

/// Reports the refused call and returns `EOPNOTSUPP` (for functions that return an errno).
fn errno_ret(name: &str) -> c_int {
    report(&format!("{name}: not supported by flexns (EOPNOTSUPP)"));
    EOPNOTSUPP
}

macro_rules! stub {
    ($how:ident: $($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported (see the module).")]
        #[no_mangle]
        pub extern "C" fn $name() -> stub!(@ty $how) {
            $how(stringify!($name))
        }
    )*};
    (@ty null) => { *mut c_void };
    (@ty minus_one) => { c_int };
    (@ty errno_ret) => { c_int };
}

// libmlx5.so.1 (mlx5dv): device-specific extensions of a device that is not here
stub!(null: mlx5dv_open_device, mlx5dv_create_qp, mlx5dv_qp_ex_from_ibv_qp_ex, mlx5dv_create_mkey, mlx5dv_dek_create);
stub!(errno_ret: mlx5dv_destroy_mkey, mlx5dv_devx_general_cmd, mlx5dv_crypto_login, mlx5dv_dek_destroy);
// libefa.so.1 (efadv)
stub!(null: efadv_create_qp_ex);
stub!(errno_ret: efadv_query_device);
// librdmacm.so.1: perftest uses it only with -R
stub!(null: rdma_create_event_channel, rdma_create_qp_ex);
stub!(minus_one: rdma_accept, rdma_ack_cm_event, rdma_bind_addr, rdma_connect, rdma_create_id, rdma_create_qp,
    rdma_destroy_id, rdma_disconnect, rdma_get_cm_event, rdma_getaddrinfo, rdma_listen, rdma_reject,
    rdma_resolve_addr, rdma_resolve_route, rdma_set_option);

/// `rdma_destroy_event_channel`: nothing was created, so nothing to destroy.
#[no_mangle]
pub extern "C" fn rdma_destroy_event_channel(_channel: *mut c_void) {}

/// `rdma_destroy_qp`: nothing was created, so nothing to destroy.
#[no_mangle]
pub extern "C" fn rdma_destroy_qp(_id: *mut c_void) {}

/// `rdma_freeaddrinfo`: `rdma_getaddrinfo` never returns a list, so nothing to free.
#[no_mangle]
pub extern "C" fn rdma_freeaddrinfo(_res: *mut c_void) {}

/// `rdma_event_str`: every event is named the same, since none is ever produced.
#[no_mangle]
pub extern "C" fn rdma_event_str(_event: c_int) -> *const c_char {
    c"RDMA_CM_EVENT_UNSUPPORTED (flexns has no rdma_cm)".as_ptr()
}
