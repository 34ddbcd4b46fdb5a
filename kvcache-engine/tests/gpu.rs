//! GPU memory segments (feature `gpu`): a WRITE from device memory sends what the device holds
//! (staged through the registered host mirror) and a READ into device memory lands on the
//! device. Skipped with a message where no CUDA driver or device exists; CI compiles it.
#![cfg(feature = "gpu")]

use kvcache_engine::gpu::GpuBuffer;
use kvcache_engine::*;
use std::time::Duration;

#[test]
fn device_memory_is_a_transfer_source_and_destination() {
    let g = match GpuBuffer::new(0, 4 << 20) {
        Ok(g) => g,
        Err(e) => {
            test_support::skip(
                "kvcache-engine gpu",
                test_support::Missing::Hardware,
                &format!("no GPU here: {e}"),
            );
            return;
        }
    };
    let mk = |n: &str| {
        let mut c = EngineConfig::new(&format!("{n}-gpu-{}", std::process::id()), TransportKind::Flexns);
        c.transfer_timeout = Duration::from_secs(10);
        TransferEngine::new(c).unwrap()
    };
    let (p, d) = (mk("prefill"), mk("decode"));
    let host = d.allocate_memory(4 << 20, Location::Cpu(0)).unwrap();
    let base = p.register_gpu_memory(&g).unwrap();
    assert_eq!(p.local_descriptor().buffers[0].location, Location::Cuda(0));
    // the device holds the KV data; the mirror holds garbage
    let data: Vec<u8> = (0..1 << 20).map(|i| (i * 13 % 251) as u8).collect();
    g.mirror().write(0, &data);
    g.copy_to_device(0, 1 << 20).unwrap();
    g.mirror().fill(0, 1 << 20, 0xEE);
    let seg = p.open_segment(d.segment_name()).unwrap();
    p.transfer_sync_write(seg, base, host.addr(), 1 << 20).unwrap();
    let mut got = vec![0u8; 1 << 20];
    host.read(0, &mut got);
    assert!(got == data, "the WRITE sent the device's bytes");
    // READ back into another part of the device buffer
    p.transfer_sync_read(seg, base + (2 << 20), host.addr(), 1 << 20)
        .unwrap();
    g.mirror().fill(2 << 20, 1 << 20, 0);
    g.copy_from_device(2 << 20, 1 << 20).unwrap();
    g.mirror().read(2 << 20, &mut got);
    assert!(got == data, "the READ landed on the device");
}

#[test]
fn a_host_region_cannot_pose_as_gpu_memory() {
    let e = TransferEngine::new(EngineConfig::new(
        &format!("g-{}", std::process::id()),
        TransportKind::Tcp,
    ))
    .unwrap();
    let r = std::sync::Arc::new(netstack::mem::Region::alloc(4096));
    let err = e.register_memory(r, Location::Cuda(0)).unwrap_err().to_string();
    assert!(err.contains("GpuBuffer"), "{err}");
}
