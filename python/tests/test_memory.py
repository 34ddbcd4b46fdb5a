"""Memory given by address is checked before it is registered: an address that is not this
process's writable host memory (a closed mmap, a bogus number, a read-only mapping), a CUDA
tensor or location ``cuda:N`` returns -1 with the reason in ``last_error()`` (Mooncake's
convention), never a registration that a later transfer dereferences; a NumPy array's address
registers as before."""

import ctypes
import mmap

import numpy as np
import pytest

import flexns


@pytest.fixture
def engine():
    e = flexns.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield e
    e.close()


def closed_mmap_address(n=1 << 16):
    m = mmap.mmap(-1, n)
    c = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(c)
    del c  # the export must go before the map can close
    m.close()
    return addr


def test_an_unmapped_address_is_minus_one_with_the_reason(engine, caplog):
    for addr, n in [(closed_mmap_address(), 1 << 16), (0x7FFF_FFFF_0000_0000, 4096), (0xF000, 4096)]:
        assert engine.register_memory(addr, n) == -1
        err = engine.last_error()
        assert f"{addr:#x} +{n}: not in this process's host memory" in err, err
        assert "register_memory" in err, err
        assert any(f"{addr:#x} +{n}" in r.getMessage() for r in caplog.records)
    # nothing was registered: the address is not memory a transfer may use
    assert engine.unregister_memory(0xF000) == -1


def test_a_numpy_arrays_address_registers(engine):
    a = np.zeros(1 << 20, dtype=np.uint8)
    b = np.zeros(4096, dtype=np.uint8)
    assert engine.register_memory(a.ctypes.data, a.nbytes) == 0
    assert engine.register_memory(b.ctypes.data, b.nbytes, "cpu:0") == 0
    engine.write_bytes_to_buffer(a.ctypes.data + 10, b"flexns", 6)
    assert bytes(a[10:16]) == b"flexns"
    assert engine.unregister_memory(a.ctypes.data) == 0
    assert engine.unregister_memory(b.ctypes.data) == 0


def test_a_range_past_its_buffer_or_read_only_memory_is_refused(engine):
    a = np.zeros(4096, dtype=np.uint8)
    assert engine.register_memory(a.ctypes.data, 1 << 40) == -1
    assert f"{a.ctypes.data:#x} +{1 << 40}: not" in engine.last_error()
    ro = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
    view = np.frombuffer(ro, dtype=np.uint8)
    assert engine.register_memory(view.ctypes.data, 8192) == -1
    assert "is read-only, and registered memory is written by peers" in engine.last_error(), engine.last_error()
    del view
    ro.close()
    assert engine.register_memory(0, 4096) == -1
    assert "0x0 +4096: address 0" in engine.last_error()


def test_device_memory_and_cuda_locations_are_refused(engine):
    a = np.zeros(4096, dtype=np.uint8)
    assert engine.register_memory(a.ctypes.data, 4096, "cuda:0") == -1
    assert "location cuda:0: this build has no GPU support" in engine.last_error(), engine.last_error()

    class CudaTensor:  # what vLLM hands over: torch's interface, on a GPU
        is_cuda = True

        def data_ptr(self):
            return a.ctypes.data

        def element_size(self):
            return 1

        def numel(self):
            return 4096

        def is_contiguous(self):
            return True

    assert engine.register_memory(CudaTensor()) == -1
    assert "a CUDA tensor: CUDA memory cannot be registered" in engine.last_error()
    assert "SUPPORT_CUDA is False" in engine.last_error()
    with pytest.raises(ValueError, match="location"):
        engine.register_memory(a.ctypes.data, 4096, "tpu:0")


def test_a_batch_with_one_bad_address_registers_none(engine):
    kv = [np.zeros(1 << 16, dtype=np.uint8) for _ in range(3)]
    addrs = [t.ctypes.data for t in kv]
    bogus = closed_mmap_address()
    ret = engine.batch_register_memory(addrs[:2] + [bogus] + addrs[2:], [1 << 16] * 4)
    assert ret == -1
    err = engine.last_error()
    assert "batch_register_memory: buffer 2:" in err and f"{bogus:#x}" in err and "none registered" in err, err
    for a in addrs:
        assert engine.unregister_memory(a) == -1, "a refused batch leaves nothing registered"
    assert engine.batch_register_memory(addrs, [1 << 16] * 3) == 0
    assert engine.batch_unregister_memory(addrs) == 0
