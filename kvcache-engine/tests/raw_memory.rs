//! `register_memory_raw` checks the range before registering it: a caller's host buffer is
//! registered and transfers; a stale or bogus address, a read-only mapping and `cuda:N` are
//! refused with the address, the length and the reason; where a CUDA driver and device exist,
//! a device pointer is refused as device memory and pinned host memory is accepted.

use kvcache_engine::*;
use std::ffi::{c_int, c_void};
use std::time::Duration;

fn engine(tag: &str) -> TransferEngine {
    let mut c = EngineConfig::new(&format!("raw-{tag}-{}", std::process::id()), TransportKind::Tcp);
    c.transfer_timeout = Duration::from_secs(10);
    TransferEngine::new(c).unwrap()
}

#[test]
fn host_buffers_register_and_bogus_ranges_are_refused() {
    let (p, d) = (engine("p"), engine("d"));
    // a caller's buffer: registered, and a transfer from it lands
    let mut buf: Vec<u8> = (0..1 << 16).map(|i| (i % 251) as u8).collect();
    // SAFETY: `buf` outlives the engine's use of it (unregistered below, before it drops).
    let a = unsafe { p.register_memory_raw(buf.as_mut_ptr(), buf.len(), Location::Cpu(0)) }.unwrap();
    let remote = d.allocate_memory(1 << 16, Location::Cpu(0)).unwrap();
    let seg = p.open_segment(d.segment_name()).unwrap();
    p.transfer_sync_write(seg, a, remote.addr(), 1 << 16).unwrap();
    let mut got = vec![0u8; 1 << 16];
    remote.read(0, &mut got);
    assert!(got == buf);
    p.unregister_memory(a).unwrap();

    // below vm.mmap_min_addr: never mapped; registering it used to succeed, and the first
    // transfer from it dereferenced it
    // SAFETY: the call must refuse this range without touching it (what the test checks).
    let e = unsafe { p.register_memory_raw(0xf000 as *mut u8, 4096, Location::Cpu(0)) }
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("0xf000 +4096: not in this process's host memory: nothing is mapped at 0xf000"),
        "{e}"
    );
    // a null pointer
    // SAFETY: as above.
    let e = unsafe { p.register_memory_raw(std::ptr::null_mut(), 4096, Location::Cpu(0)) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("0x0 +4096: address 0"), "{e}");
    // a buffer's range with its length overstated past the mapping
    let small = vec![0u8; 4096];
    let huge = 1usize << 46;
    // SAFETY: as above.
    let e = unsafe { p.register_memory_raw(small.as_ptr() as *mut u8, huge, Location::Cpu(0)) }
        .unwrap_err()
        .to_string();
    // (past the heap's end: an unmapped gap, or the no-access reserve of a thread's arena)
    assert!(e.contains(&format!("+{huge}: not")) && e.contains("host memory"), "{e}");

    // a read-only mapping: peers would write it
    // SAFETY: a fresh anonymous read-only mapping, unmapped below.
    let ro = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(ro, libc::MAP_FAILED);
    // SAFETY: the call must refuse this range (read-only) without writing it.
    let r = unsafe { p.register_memory_raw(ro.cast(), 8192, Location::Cpu(0)) };
    // SAFETY: unmaps the mapping made above, once.
    unsafe { libc::munmap(ro, 8192) };
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains("is read-only, and registered memory is written by peers"),
        "{e}"
    );

    // cuda:N by address is refused by name
    // SAFETY: refused before the range is used.
    let e = unsafe { p.register_memory_raw(buf.as_mut_ptr(), 4096, Location::Cuda(0)) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("location cuda:0"), "{e}");
    assert!(
        p.local_descriptor().buffers.is_empty(),
        "nothing refused was registered"
    );
}

/// The CUDA driver API, loaded for this test only (no cudarc: this runs in every build).
struct Cuda {
    lib: *mut c_void,
}

impl Cuda {
    fn load() -> Result<Cuda, String> {
        // SAFETY: loads the driver library by its soname; the handle is kept for the test.
        let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            return Err("the CUDA driver (libcuda.so.1) is not installed".into());
        }
        let c = Cuda { lib };
        // SAFETY: cuInit(unsigned int flags) with flags 0.
        let rc = unsafe { c.sym::<unsafe extern "C" fn(u32) -> c_int>(c"cuInit")(0) };
        if rc != 0 {
            return Err(format!("cuInit failed ({rc}): no usable device"));
        }
        Ok(c)
    }

    /// # Safety
    /// `F` must be the symbol's C signature.
    unsafe fn sym<F: Copy>(&self, name: &std::ffi::CStr) -> F {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.lib, name.as_ptr()) };
        assert!(!p.is_null(), "{name:?} missing from libcuda");
        // SAFETY: the caller names the symbol's signature; a function pointer is pointer-sized.
        unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
    }
}

#[test]
fn device_pointers_are_refused_and_pinned_host_memory_is_not() {
    let cuda = match Cuda::load() {
        Ok(c) => c,
        Err(why) => {
            test_support::skip("kvcache-engine raw_memory cuda", test_support::Missing::Hardware, &why);
            return;
        }
    };
    type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type CtxCreate = unsafe extern "C" fn(*mut *mut c_void, u32, c_int) -> c_int;
    type MemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type MemAllocHost = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
    let (mut dev, mut ctx, mut dptr, mut hptr) = (0, std::ptr::null_mut(), 0u64, std::ptr::null_mut());
    // SAFETY: the driver API's signatures (CUdevice is an int, CUdeviceptr a u64); each writes
    // only through the out-pointer it is given.
    unsafe {
        assert_eq!(cuda.sym::<DeviceGet>(c"cuDeviceGet")(&mut dev, 0), 0);
        assert_eq!(cuda.sym::<CtxCreate>(c"cuCtxCreate_v2")(&mut ctx, 0, dev), 0);
        assert_eq!(cuda.sym::<MemAlloc>(c"cuMemAlloc_v2")(&mut dptr, 1 << 20), 0);
        assert_eq!(cuda.sym::<MemAllocHost>(c"cuMemAllocHost_v2")(&mut hptr, 1 << 20), 0);
    }
    assert!(hostmem::cuda_driver_loaded());
    assert_eq!(hostmem::cuda_device_of(dptr), Some(0));
    assert_eq!(
        hostmem::cuda_device_of(hptr as u64),
        None,
        "pinned host memory is host memory"
    );
    let e = engine("cuda");
    for loc in [Location::Cpu(0), Location::Cpu(1)] {
        // SAFETY: the call must refuse device memory without dereferencing it.
        let err = unsafe { e.register_memory_raw(dptr as *mut u8, 1 << 20, loc) }
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{dptr:#x} +1048576: device memory of cuda:0 (given as {loc})")),
            "{err}"
        );
    }
    let err = hostmem::check_caller_memory(dptr, 4096, None, true).unwrap_err();
    assert!(matches!(err, TransferError::Gpu(_)), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("{dptr:#x} +4096: device memory of cuda:0: ")),
        "{err}"
    );
    // SAFETY: pinned host memory the driver allocated above, freed only after unregistering.
    let a = unsafe { e.register_memory_raw(hptr.cast(), 1 << 20, Location::Cpu(0)) }.unwrap();
    e.unregister_memory(a).unwrap();
    println!("device pointer {dptr:#x} refused; pinned host memory {hptr:p} registered");
}
