//! Memory named by a bare address (Python's `register_memory(int, len)`,
//! [`TransferEngine::register_memory_raw`](crate::TransferEngine::register_memory_raw)),
//! checked before it is registered, so that a device pointer or a stale address is refused
//! with its reason instead of being dereferenced by the first transfer.
//!
//! Two checks, in order:
//! 1. **CUDA**: where this process has the CUDA driver loaded, the driver classifies the
//!    pointer (`cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`); device memory is
//!    refused by name (with its device). The driver is looked up at run time with
//!    `dlopen(RTLD_NOLOAD)`: it is never loaded into a process that has not loaded it itself,
//!    and such a process holds no device pointer (only the driver hands them out).
//! 2. **Host mappings**: every byte of `[addr, addr+len)` must lie in mappings of
//!    `/proc/self/maps` that are readable and, for memory peers may write, writable (a range
//!    may span adjacent mappings).
//!
//! The check is a snapshot: memory unmapped after it breaks the caller's promise (the safety
//! contract of `register_memory_raw`, Mooncake's `register_memory(addr, len)`).

use crate::{Location, TransferError};

/// One line of `/proc/self/maps`: `[start, end)` and its permissions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// First address of the mapping.
    pub start: u64,
    /// One past the last address of the mapping.
    pub end: u64,
    /// Mapped readable (`r`).
    pub read: bool,
    /// Mapped writable (`w`).
    pub write: bool,
    /// The mapped file or the kernel's name for it (`[heap]`, `[stack]`); empty if anonymous.
    pub path: String,
}

impl std::fmt::Display for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "mapping {:#x}-{:#x}", self.start, self.end)?;
        if self.path.is_empty() {
            write!(f, " (anonymous)")
        } else {
            write!(f, " ({})", self.path)
        }
    }
}

/// Parses the text of `/proc/PID/maps` (lines `start-end perms offset dev inode [path]`).
pub fn parse_maps(text: &str) -> Result<Vec<Mapping>, String> {
    fn field<'a>(rest: &mut &'a str) -> Option<&'a str> {
        let s = rest.trim_start();
        if s.is_empty() {
            return None;
        }
        let end = s.find(char::is_whitespace).unwrap_or(s.len());
        let (f, r) = s.split_at(end);
        *rest = r;
        Some(f)
    }
    let mut maps = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: &str| format!("maps line {}: {why}: {line:?}", i + 1);
        let mut rest = line;
        let range = field(&mut rest).ok_or_else(|| bad("no address range"))?;
        let perms = field(&mut rest).ok_or_else(|| bad("no permissions"))?;
        for what in ["offset", "device", "inode"] {
            field(&mut rest).ok_or_else(|| bad(&format!("no {what}")))?;
        }
        let (s, e) = range
            .split_once('-')
            .ok_or_else(|| bad("address range is not START-END"))?;
        let hex = |v: &str| u64::from_str_radix(v, 16).map_err(|_| bad("address is not hexadecimal"));
        let (start, end) = (hex(s)?, hex(e)?);
        if end < start || perms.len() < 2 {
            return Err(bad("malformed range or permissions"));
        }
        let p = perms.as_bytes();
        maps.push(Mapping {
            start,
            end,
            read: p[0] == b'r',
            write: p[1] == b'w',
            path: rest.trim().to_string(),
        });
    }
    maps.sort_by_key(|m| m.start);
    Ok(maps)
}

/// This process's mappings now.
pub fn self_maps() -> Result<Vec<Mapping>, TransferError> {
    let text = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| TransferError::Io(format!("reading /proc/self/maps: {e}")))?;
    parse_maps(&text).map_err(|e| TransferError::Io(format!("/proc/self/maps: {e}")))
}

/// Why `[addr, addr+len)` is not host memory that `maps` (sorted by start) make readable and,
/// if `write`, writable; `Ok` if it is.
pub fn check_range(maps: &[Mapping], addr: u64, len: u64, write: bool) -> Result<(), String> {
    if addr == 0 {
        return Err("address 0 (a null pointer)".into());
    }
    if len == 0 {
        return Err("length 0".into());
    }
    let end = addr
        .checked_add(len)
        .ok_or("the range runs past the end of the address space")?;
    let mut at = addr;
    let mut i = maps.partition_point(|m| m.end <= at);
    while at < end {
        let Some(m) = maps.get(i).filter(|m| m.start <= at) else {
            return Err(if at == addr {
                format!("not in this process's host memory: nothing is mapped at {at:#x}")
            } else {
                format!(
                    "not in this process's host memory: the range runs past the end of {} by {} bytes \
                     ({at:#x} is not mapped)",
                    maps[i - 1],
                    end - at
                )
            });
        };
        if !m.read {
            return Err(format!(
                "not readable host memory: {m} has no access (a guard page or reserved address space)"
            ));
        }
        if write && !m.write {
            return Err(format!("{m} is read-only, and registered memory is written by peers"));
        }
        at = m.end;
        i += 1;
    }
    Ok(())
}

/// The CUDA device holding `addr`, if the CUDA driver is loaded in this process and says
/// `addr` is device memory.
pub fn cuda_device_of(addr: u64) -> Option<u32> {
    cuda::device_of(addr)
}

/// Whether this process has the CUDA driver (`libcuda.so.1`) loaded.
pub fn cuda_driver_loaded() -> bool {
    cuda::get_attribute().is_some()
}

#[cfg(feature = "gpu")]
const DEVICE_BY_ADDRESS: &str = "device memory is not registered by address: register a gpu::GpuBuffer \
     (TransferEngine::register_gpu_memory), which moves through a registered host mirror";
#[cfg(not(feature = "gpu"))]
const DEVICE_BY_ADDRESS: &str = "this build has no GPU support (kvcache-engine feature `gpu`), and \
     device memory is never registered by address; copy it to host memory first";

/// Checks memory named by an address before it is registered, and says where it is.
///
/// `requested` is the caller's location, `None` to detect it (Mooncake's `"*"`): CUDA memory
/// (if the driver says so) is refused with its device, host memory is `cpu:0`, anything else
/// is refused. `cuda:N` is refused (a bare device pointer cannot be registered; see [`crate::gpu`]),
/// and so is `cpu:N` for a pointer the driver says is device memory. `write`: peers may write
/// the memory (remote registration), so its mappings must be writable. The error names the
/// address, the length and the reason.
pub fn check_caller_memory(
    addr: u64,
    len: u64,
    requested: Option<Location>,
    write: bool,
) -> Result<Location, TransferError> {
    let at = |why: String| format!("{addr:#x} +{len}: {why}");
    if let Some(Location::Cuda(n)) = requested {
        return Err(TransferError::Gpu(at(format!(
            "location cuda:{n}: {DEVICE_BY_ADDRESS}"
        ))));
    }
    if let Some(dev) = cuda_device_of(addr) {
        let asked = requested.map(|l| format!(" (given as {l})")).unwrap_or_default();
        return Err(TransferError::Gpu(at(format!(
            "device memory of cuda:{dev}{asked}: {DEVICE_BY_ADDRESS}"
        ))));
    }
    let maps = self_maps()?;
    check_range(&maps, addr, len, write).map_err(|why| {
        let hint = if cuda_driver_loaded() {
            ""
        } else {
            " (a freed buffer or a wrong address; not device memory either: this process has not loaded the CUDA driver)"
        };
        TransferError::Invalid(at(format!("{why}{hint}")))
    })?;
    Ok(requested.unwrap_or(Location::Cpu(0)))
}

/// The CUDA driver's pointer query, found at run time in a driver this process already loaded.
mod cuda {
    use std::ffi::{c_int, c_uint, c_void};
    use std::sync::OnceLock;

    /// `CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)`
    pub(super) type GetAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;

    const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
    const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
    const CU_MEMORYTYPE_DEVICE: c_uint = 2;
    const CU_MEMORYTYPE_ARRAY: c_uint = 3;
    const CUDA_SUCCESS: c_int = 0;

    static FOUND: OnceLock<GetAttribute> = OnceLock::new();

    /// `cuPointerGetAttribute` of the loaded driver; `None` while none is loaded.
    pub(super) fn get_attribute() -> Option<GetAttribute> {
        if let Some(f) = FOUND.get() {
            return Some(*f);
        }
        for name in [c"libcuda.so.1", c"libcuda.so"] {
            // SAFETY: RTLD_NOLOAD only looks up a library this process already loaded (it never
            // loads one, so no initializer runs); the name is a NUL-terminated literal. The
            // handle is never closed, so the library stays loaded while `FOUND` holds its symbol.
            let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
            if h.is_null() {
                continue;
            }
            // SAFETY: `h` is a live handle and the symbol name a NUL-terminated literal.
            let sym = unsafe { libc::dlsym(h, c"cuPointerGetAttribute".as_ptr()) };
            if sym.is_null() {
                continue;
            }
            // SAFETY: the CUDA driver API declares cuPointerGetAttribute with this C signature
            // (CUdeviceptr is an unsigned 64-bit integer on 64-bit Linux).
            let f = unsafe { std::mem::transmute::<*mut c_void, GetAttribute>(sym) };
            return Some(*FOUND.get_or_init(|| f));
        }
        None
    }

    /// The device ordinal of `addr` if the driver says it is device (or array) memory. A driver
    /// error (not initialized: nothing in this process used CUDA; invalid value: not memory the
    /// driver knows) means it is not.
    pub(super) fn device_of(addr: u64) -> Option<u32> {
        let f = get_attribute()?;
        let mut kind: c_uint = 0;
        // SAFETY: `kind` is the unsigned int this attribute writes; the driver only looks `addr`
        // up in its own tables and never dereferences it.
        let rc = unsafe {
            f(
                (&mut kind as *mut c_uint).cast(),
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if rc != CUDA_SUCCESS || !(kind == CU_MEMORYTYPE_DEVICE || kind == CU_MEMORYTYPE_ARRAY) {
            return None;
        }
        let mut ordinal: c_int = 0;
        // SAFETY: as above; this attribute writes an int.
        let rc = unsafe {
            f(
                (&mut ordinal as *mut c_int).cast(),
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        };
        Some(if rc == CUDA_SUCCESS { ordinal.max(0) as u32 } else { 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn here(addr: u64, len: u64, write: bool) -> Result<(), String> {
        check_range(&self_maps().unwrap(), addr, len, write)
    }

    /// An anonymous mapping of `pages` pages with `prot`; unmapped when dropped.
    struct Mmap(*mut libc::c_void, usize);
    impl Mmap {
        fn new(pages: usize, prot: libc::c_int) -> Mmap {
            let len = pages * page();
            // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Mmap(p, len)
        }
        fn addr(&self) -> u64 {
            self.0 as u64
        }
        /// Changes the protection of page `i` of this mapping.
        fn protect_page(&self, i: usize, prot: libc::c_int) {
            assert!((i + 1) * page() <= self.1);
            // SAFETY: page `i` lies inside this mapping, which this test owns and holds no
            // reference into.
            let rc = unsafe { libc::mprotect(self.0.cast::<u8>().add(i * page()).cast(), page(), prot) };
            assert_eq!(rc, 0);
        }
    }
    impl Drop for Mmap {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly the mapping `new` created, once.
            unsafe { libc::munmap(self.0, self.1) };
        }
    }
    fn page() -> usize {
        // SAFETY: sysconf reads a constant.
        unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
    }

    #[test]
    fn parses_maps_lines() {
        let m = parse_maps(
            "55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0          [heap]\n\
             7f0000000000-7f0000001000 ---p 00000000 00:00 0 \n\
             7f0000001000-7f0000002000 r--s 00001000 08:01 1234       /tmp/a file\n",
        )
        .unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(
            (m[0].start, m[0].end, m[0].read, m[0].write),
            (0x55d0c0a00000, 0x55d0c0a21000, true, true)
        );
        assert_eq!(m[0].path, "[heap]");
        assert!(!m[1].read && !m[1].write && m[1].path.is_empty());
        assert!(m[2].read && !m[2].write);
        assert_eq!(m[2].path, "/tmp/a file");
        let e = parse_maps("zz-10 rw-p 0 0:0 0").unwrap_err();
        assert!(e.contains("line 1") && e.contains("hexadecimal"), "{e}");
        assert!(parse_maps("1000-2000 rw-p").unwrap_err().contains("no offset"));
    }

    #[test]
    fn a_vec_is_host_memory() {
        let v = vec![7u8; 1 << 20];
        here(v.as_ptr() as u64, v.len() as u64, true).unwrap();
        let loc = check_caller_memory(v.as_ptr() as u64, v.len() as u64, None, true).unwrap();
        assert_eq!(loc, Location::Cpu(0));
        assert_eq!(
            check_caller_memory(v.as_ptr() as u64, 4096, Some(Location::Cpu(1)), true).unwrap(),
            Location::Cpu(1)
        );
    }

    fn synthetic() -> Vec<Mapping> {
        let m = |start, end, read, write| Mapping {
            start,
            end,
            read,
            write,
            path: String::new(),
        };
        vec![
            m(0x10000, 0x12000, true, true),
            m(0x12000, 0x13000, true, false),
            m(0x20000, 0x21000, true, true),
        ]
    }

    #[test]
    fn an_unmapped_range_is_refused() {
        let maps = synthetic();
        let e = check_range(&maps, 0x14000, 16, false).unwrap_err();
        assert!(e.contains("nothing is mapped at 0x14000"), "{e}");
        let e = check_range(&maps, 0x30000, 16, false).unwrap_err();
        assert!(e.contains("nothing is mapped at 0x30000"), "{e}");
        // this process: below vm.mmap_min_addr (64 KiB by default) nothing is ever mapped, and
        // a non-canonical address never is
        for addr in [0xf000u64, 0x7fff_ffff_0000_0000] {
            let e = check_caller_memory(addr, 4096, None, true).unwrap_err().to_string();
            assert!(
                e.contains(&format!(
                    "{addr:#x} +4096: not in this process's host memory: nothing is mapped"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn a_range_past_the_end_of_a_mapping_is_refused() {
        let maps = synthetic();
        check_range(&maps, 0x11000, 0x1000, true).unwrap();
        check_range(&maps, 0x11000, 0x2000, false).unwrap(); // into the adjacent read-only one
        let e = check_range(&maps, 0x12800, 0x1000, false).unwrap_err();
        assert!(
            e.contains("runs past the end of mapping 0x12000-0x13000 (anonymous) by 2048 bytes"),
            "{e}"
        );
        assert!(e.contains("0x13000 is not mapped"), "{e}");
        // this process: a range running from a writable mapping into a no-access page (a guard)
        let m = Mmap::new(2, libc::PROT_READ | libc::PROT_WRITE);
        let p = page();
        m.protect_page(1, libc::PROT_NONE);
        here(m.addr(), p as u64, true).unwrap();
        let e = here(m.addr() + 8, p as u64, true).unwrap_err();
        assert!(e.contains("has no access"), "{e}");
    }

    #[test]
    fn adjacent_mappings_share_a_range() {
        // two mappings with different permissions, side by side: both readable
        let m = Mmap::new(2, libc::PROT_READ | libc::PROT_WRITE);
        let p = page();
        m.protect_page(1, libc::PROT_READ);
        here(m.addr(), 2 * p as u64, false).unwrap();
        let e = here(m.addr(), 2 * p as u64, true).unwrap_err();
        assert!(e.contains("is read-only"), "{e}");
    }

    #[test]
    fn read_only_memory_is_refused_for_writable_registration() {
        let m = Mmap::new(1, libc::PROT_READ);
        here(m.addr(), page() as u64, false).unwrap();
        let e = check_caller_memory(m.addr(), page() as u64, None, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is read-only, and registered memory is written by peers"),
            "{e}"
        );
        assert!(e.contains(&format!("{:#x} +{}", m.addr(), page())), "{e}");
    }

    #[test]
    fn no_access_memory_is_refused() {
        let m = Mmap::new(1, libc::PROT_NONE);
        let e = here(m.addr(), 16, false).unwrap_err();
        assert!(e.contains("has no access"), "{e}");
    }

    #[test]
    fn null_empty_and_wrapping_ranges_are_refused() {
        let e = check_caller_memory(0, 4096, None, true).unwrap_err().to_string();
        assert!(e.contains("0x0 +4096: address 0"), "{e}");
        let v = [0u8; 16];
        assert!(here(v.as_ptr() as u64, 0, false).unwrap_err().contains("length 0"));
        assert!(here(u64::MAX - 10, 100, false)
            .unwrap_err()
            .contains("end of the address space"));
    }

    #[test]
    fn cuda_locations_are_refused_by_name() {
        let v = vec![0u8; 4096];
        let e = check_caller_memory(v.as_ptr() as u64, 4096, Some(Location::Cuda(1)), true).unwrap_err();
        assert!(matches!(e, TransferError::Gpu(_)), "{e}");
        assert!(e.to_string().contains("location cuda:1"), "{e}");
        #[cfg(not(feature = "gpu"))]
        assert!(e.to_string().contains("this build has no GPU support"), "{e}");
    }
}
