//! GPU memory segments (feature `gpu`): device memory from cudarc, loaded at run time, so the
//! crate builds with no CUDA installed and a machine without a driver gets a clear error.
//!
//! A software stack cannot DMA into device memory, so a [`GpuBuffer`] is device memory plus a
//! registered host mirror of the same size, the way Mooncake's TCP transport bounces GPU
//! buffers through DRAM. Requests name the mirror's addresses; the engine copies a WRITE's
//! source range device→mirror before sending it and a completed READ's range mirror→device.
//! Remote WRITEs into a GPU segment land in the mirror; the receiver moves the blocks a
//! notification names to the device with [`GpuBuffer::copy_to_device`].

use crate::TransferError;
use netstack::mem::Region;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Mirrors of live GPU buffers by address: only these may be registered as `cuda:N` memory.
fn mirrors() -> &'static Mutex<HashMap<u64, Arc<Device>>> {
    static M: OnceLock<Mutex<HashMap<u64, Arc<Device>>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

/// Whether `region` is the host mirror of a live [`GpuBuffer`].
pub fn is_gpu_mirror(region: &Region) -> bool {
    mirrors().lock().contains_key(&region.addr())
}

/// The device side of a GPU buffer covering the mirror at `addr`, if `addr` is one.
pub(crate) fn device_of(addr: u64) -> Option<Arc<Device>> {
    mirrors().lock().get(&addr).cloned()
}

/// Device memory behind a mirror.
pub(crate) struct Device {
    #[cfg(feature = "gpu")]
    stream: Arc<cudarc::driver::CudaStream>,
    #[cfg(feature = "gpu")]
    mem: Mutex<cudarc::driver::CudaSlice<u8>>,
    pub ordinal: u32,
}

/// Device memory of `len` bytes on GPU `ordinal`, with its registered host mirror.
pub struct GpuBuffer {
    dev: Arc<Device>,
    mirror: Arc<Region>,
}

/// Whether this build can use GPUs at all, and if not, why.
pub fn availability() -> Result<usize, TransferError> {
    #[cfg(not(feature = "gpu"))]
    {
        Err(TransferError::Gpu(
            "this build has no GPU support (rebuild with --features gpu)".into(),
        ))
    }
    #[cfg(feature = "gpu")]
    {
        // SAFETY: only tries to dlopen the driver library; no driver call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(TransferError::Gpu(
                "the CUDA driver (libcuda.so) is not installed or not on the library path".into(),
            ));
        }
        let n = cudarc::driver::CudaContext::device_count()
            .map_err(|e| TransferError::Gpu(format!("counting devices: {e}")))?;
        if n <= 0 {
            return Err(TransferError::Gpu("the CUDA driver reports no device".into()));
        }
        Ok(n as usize)
    }
}

impl GpuBuffer {
    /// Allocates `len` bytes on GPU `ordinal` and a host mirror.
    pub fn new(ordinal: u32, len: usize) -> Result<GpuBuffer, TransferError> {
        let n = availability()?;
        if ordinal as usize >= n {
            return Err(TransferError::Gpu(format!("device {ordinal}: only {n} device(s)")));
        }
        #[cfg(feature = "gpu")]
        let dev = {
            let e = |what: &str, e: cudarc::driver::DriverError| TransferError::Gpu(format!("{what}: {e}"));
            let ctx = cudarc::driver::CudaContext::new(ordinal as usize).map_err(|x| e("context", x))?;
            let stream = ctx.default_stream();
            let mem = stream
                .alloc_zeros::<u8>(len)
                .map_err(|x| e("allocating device memory", x))?;
            Device {
                stream,
                mem: Mutex::new(mem),
                ordinal,
            }
        };
        #[cfg(not(feature = "gpu"))]
        let dev = Device { ordinal };
        let dev = Arc::new(dev);
        let mirror = Arc::new(Region::alloc_shareable(len));
        mirrors().lock().insert(mirror.addr(), dev.clone());
        Ok(GpuBuffer { dev, mirror })
    }

    /// The host mirror (what the engine registers and requests address).
    pub fn mirror(&self) -> &Arc<Region> {
        &self.mirror
    }

    /// The mirror's address of byte 0.
    pub fn addr(&self) -> u64 {
        self.mirror.addr()
    }

    /// The buffer's length in bytes (device memory and mirror alike).
    pub fn len(&self) -> usize {
        self.mirror.len()
    }

    /// Whether the buffer is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.mirror.len() == 0
    }

    /// The CUDA device ordinal the buffer lives on.
    pub fn device(&self) -> u32 {
        self.dev.ordinal
    }

    /// Copies mirror → device for `[off, off+len)` (after data landed in the mirror).
    pub fn copy_to_device(&self, off: usize, len: usize) -> Result<(), TransferError> {
        self.dev.sync(&self.mirror, off, len, true)
    }

    /// Copies device → mirror for `[off, off+len)` (before the mirror is sent).
    pub fn copy_from_device(&self, off: usize, len: usize) -> Result<(), TransferError> {
        self.dev.sync(&self.mirror, off, len, false)
    }
}

impl Device {
    #[allow(unused_variables)]
    pub(crate) fn sync(&self, mirror: &Region, off: usize, len: usize, to_device: bool) -> Result<(), TransferError> {
        if off.checked_add(len).is_none_or(|e| e > mirror.len()) {
            return Err(TransferError::Invalid(format!(
                "gpu copy {off}+{len} outside a buffer of {}",
                mirror.len()
            )));
        }
        #[cfg(feature = "gpu")]
        {
            let e = |x: cudarc::driver::DriverError| TransferError::Gpu(format!("copy: {x}"));
            let mut mem = self.mem.lock();
            if to_device {
                let mut dst = mem.slice_mut(off..off + len);
                // The mirror is shared memory peers may write: copy it out (byte-wise atomic)
                // before handing bytes to the driver, which takes a `&[u8]`.
                let host = mirror.to_vec(off, len);
                self.stream.memcpy_htod(&host, &mut dst).map_err(e)?;
            } else {
                let src = mem.slice(off..off + len);
                // The driver writes a private `&mut [u8]`; the bytes then enter the shared
                // mirror through its atomic copy.
                let mut host = vec![0u8; len];
                self.stream.memcpy_dtoh(&src, &mut host).map_err(e)?;
                mirror.write(off, &host);
            }
            self.stream.synchronize().map_err(e)
        }
        #[cfg(not(feature = "gpu"))]
        Err(TransferError::Gpu("this build has no GPU support".into()))
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        mirrors().lock().remove(&self.mirror.addr());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_gpu_is_a_clear_error_not_a_panic() {
        match GpuBuffer::new(0, 4096) {
            Ok(b) => {
                // a GPU exists here: a round trip through the device must preserve data
                b.mirror().write(0, b"kv-block");
                b.copy_to_device(0, 4096).unwrap();
                b.mirror().fill(0, 8, 0);
                b.copy_from_device(0, 4096).unwrap();
                let mut out = [0u8; 8];
                b.mirror().read(0, &mut out);
                assert_eq!(&out, b"kv-block");
            }
            Err(e) => {
                test_support::skip(
                    "kvcache-engine gpu device round trip",
                    test_support::Missing::Hardware,
                    &e.to_string(),
                );
                assert!(matches!(e, TransferError::Gpu(_)), "{e}");
            }
        }
    }
}
