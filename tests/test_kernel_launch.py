"""The kernel parameters cuda_build.launch hands the driver (cuLaunchKernel's kernelParams): each argument's
bytes in its slot, as CuPy's own conversion (cuda_build._arg) gives them; TensorMaps by address; the buffer
reused per sequence of argument kinds; bad arguments refused with the value named; TMA tensor maps made once per
shape and copied for new addresses. CPU only but for the driver's tensor maps: the launch itself runs in the GPU
tests (every kernel goes through it)."""
import ctypes
import struct

import numpy as np
import pytest
import torch

from qwen35_fast.kernels import cuda_build as cb


def _slot(p, i, n=8) -> bytes:
    return ctypes.string_at(p.ptrs[i], n)


ARGS = (torch.zeros(4), None, np.int32(-5), np.int64(-(2 ** 40) - 3), np.uint64(2 ** 63 + 5), np.float32(1.5), 7, 2.25,
        True, np.int32(2 ** 31 - 1), np.float64(0.1))


def test_each_argument_packs_as_cupy_would_pass_it():
    p = cb.pack_params(ARGS)
    for i, a in enumerate(ARGS):
        want = cb._arg(a).tobytes()  # the numpy scalar CuPy receives today: its bytes are the parameter's
        assert _slot(p, i, len(want)) == want, (i, a)
    assert _slot(p, 0) == ARGS[0].data_ptr().to_bytes(8, "little")
    assert _slot(p, 2) == (-5).to_bytes(4, "little", signed=True) + bytes(4)  # 4-byte values: the low half
    assert _slot(p, 10) == np.float64(0.1).tobytes()  # a double (numpy.float64 is a Python float too)


def test_each_call_packs_its_own_values_whatever_types_came_before():
    """What each argument becomes is kept per tuple of argument types: an optional tensor given or None, a
    tensor subclass (a Parameter), other values of known types, all land in their slots."""
    a, b = torch.zeros(3), torch.nn.Parameter(torch.zeros(5))
    for args in ((a, None, np.int32(1)), (None, a, np.int32(2)), (b, a, np.int32(3)), (a, None, np.int32(4))):
        p = cb.pack_params(args)
        for i, x in enumerate(args):
            assert _slot(p, i, len(cb._arg(x).tobytes())) == cb._arg(x).tobytes(), (args, i)


def test_tensor_maps_pass_by_address():
    tm = cb.TensorMap.zero()
    p = cb.pack_params((np.int32(3), tm, torch.zeros(2)))
    assert p.ptrs[1] == tm.addr and tm.addr % 64 == 0
    assert _slot(p, 0, 4) == (3).to_bytes(4, "little")
    tm2 = cb.TensorMap.zero()
    q = cb.pack_params((np.int32(4), tm2, torch.zeros(2)))
    assert q is p and q.ptrs[1] == tm2.addr and _slot(q, 0, 4) == (4).to_bytes(4, "little")


def test_buffer_reused_per_kinds_and_rewritten_whole():
    a = cb.pack_params((np.int32(1), np.int64(2), 3.0))
    first = ctypes.string_at(a.ptrs[0], 24)
    b = cb.pack_params((np.int32(9), np.int64(8), 7.0))
    assert b is a and ctypes.string_at(b.ptrs[0], 24) != first
    assert _slot(b, 1) == (8).to_bytes(8, "little") and _slot(b, 2, 4) == np.float32(7.0).tobytes()
    c = cb.pack_params((np.int64(9), np.int32(8)))
    assert c is not a


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(OverflowError, match="2147483648"):
        cb.pack_params((2 ** 31,))
    cb.pack_params((np.int32(1), 5))  # these types' packing known: a value past int32 is still named
    with pytest.raises(OverflowError, match="2147483648"):
        cb.pack_params((np.int32(1), 2 ** 31))
    with pytest.raises(TypeError, match="str"):
        cb.pack_params(("x",))
    with pytest.raises(TypeError, match="int16"):
        cb.pack_params((np.int16(1),))


def test_programmatic_launch_config_has_the_drivers_layout():
    """cuLaunchKernelEx's CUlaunchConfig (seven uint32, the stream at 32, the attributes at 40, their count at
    48; 56 bytes) and CUlaunchAttribute (the id, 4 bytes of padding, a 64-byte value: 72 bytes), with the one
    attribute programmatic stream serialization (id 6) set to 1; Card.programmatic from the build target."""
    assert ctypes.sizeof(cb._LaunchConfig) == 56 and ctypes.sizeof(cb._LaunchAttr) == 72
    assert (cb._LaunchConfig.stream.offset, cb._LaunchConfig.attrs.offset, cb._LaunchConfig.num_attrs.offset) == (32, 40, 48)
    assert cb._LaunchAttr.value.offset == 8
    c = cb._programmatic_config((3, 2, 1), (128, 1, 1), 4096, 0xABC0)
    raw = ctypes.string_at(ctypes.addressof(c), 28)
    assert np.frombuffer(raw, np.uint32).tolist() == [3, 2, 1, 128, 1, 1, 4096]
    assert c.stream == 0xABC0 and c.num_attrs == 1
    attr = ctypes.string_at(ctypes.addressof(c.attrs.contents), 72)
    assert attr[:4] == (6).to_bytes(4, "little") and attr[8:12] == (1).to_bytes(4, "little") and not any(attr[12:])
    assert cb._programmatic_config((1, 1, 1), (32, 1, 1), 0, 1) is c  # one per thread, refilled
    assert [cb.Card(a, 1, 1, 1).programmatic for a in ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120", "compute_100")] \
        == [False, False, False, True, True, True]


def test_driver_functions_are_looked_up_once_with_their_types(monkeypatch):
    """_driver_function: the library's function with an int result and the argument types given, kept after
    the first lookup; None (kept too) where the library or the function is missing. (The C library's labs
    stands in for the driver here: the same ctypes calls.)"""
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    opened = []
    monkeypatch.setattr(cb, "_driver_library", lambda: opened.append(1) or libc)
    monkeypatch.setattr(cb, "_driver_fns", {})
    f = cb._driver_function("labs", (ctypes.c_long,))
    assert f(-7) == 7 and f.argtypes == (ctypes.c_long,) and f.restype is ctypes.c_int  # as for a CUresult
    assert cb._driver_function("labs", (ctypes.c_long,)) is f and opened == [1]
    assert cb._driver_function("no_such_function_here", ()) is None
    assert cb._driver_function("no_such_function_here", ()) is None and len(opened) == 2


def test_a_driver_that_refuses_programmatic_launches_gets_plain_ones(monkeypatch):
    """launch(..., programmatic=True) goes through cuLaunchKernelEx on a card that takes it; where the driver
    refuses that launch and a plain one works, the device gets plain launches from then on; a launch that fails
    either way raises and changes nothing; a card without it, programmatic off, or a kernel built for an older
    target than 9.0 (whose grid_wait is empty) launches plainly."""
    calls = []
    answers = {"ex": [], "plain": []}

    def fake(kind):
        def f(*a):
            calls.append(kind)
            return answers[kind].pop(0) if answers[kind] else 0
        return f
    stream = type("S", (), {"ptr": 7})()
    kern = type("K", (), {"ptr": 9})()
    fn = type("F", (), {"kernel": kern})()
    monkeypatch.setattr(cb, "_current_stream", lambda: (0, stream))
    monkeypatch.setattr(cb, "_driver_launch", lambda: fake("plain"))
    monkeypatch.setattr(cb, "_driver_launch_ex", lambda: fake("ex"))
    monkeypatch.setattr(cb, "_plain_only", set())
    monkeypatch.setattr(cb, "_kernels", {})
    card = {"arch": "sm_90a"}
    monkeypatch.setattr(cb, "card_of", lambda dev: cb.Card(card["arch"], 132, 1, 1))

    def go(programmatic=True):
        calls.clear()
        cb.launch(fn, (1,), (32,), (np.int32(1),), programmatic=programmatic)
        return list(calls)

    assert go() == ["ex"] and go(False) == ["plain"]
    monkeypatch.setattr(cb, "PROGRAMMATIC", False)
    assert go() == ["plain"]
    monkeypatch.setattr(cb, "PROGRAMMATIC", True)
    answers["ex"], answers["plain"] = [1], [700]  # both fail: an error, programmatic launches kept
    with pytest.raises(RuntimeError, match="CUresult 700"):
        go()
    assert cb._plain_only == set() and go() == ["ex"]
    answers["ex"] = [1]  # only the programmatic one fails: plain launches from now on
    assert go() == ["ex", "plain"] and cb._plain_only == {0}
    assert go() == ["plain"]
    cb._plain_only.clear()
    card["arch"] = "sm_86"
    assert go() == ["plain"]
    card["arch"] = "sm_90a"  # a kernel built for compute_80 (its grid_wait empty) on a card that takes them
    old = type("F", (), {"kernel": kern})()
    monkeypatch.setitem(cb._targets, id(old), "compute_80")
    calls.clear()
    cb.launch(old, (1,), (32,), (np.int32(1),), programmatic=True)
    assert calls == ["plain"] and go() == ["ex"]


@pytest.mark.parametrize("static, dynamic, allowed", [(0, 48 * 1024, None), (32, 48 * 1024, 48 * 1024),
                                                      (0, 48 * 1024 + 16, 48 * 1024 + 16), (1024, 40 * 1024, None)])
def test_a_kernel_is_allowed_its_dynamic_shared_memory_past_48_kb_with_its_static_part(monkeypatch, static, dynamic,
                                                                                      allowed):
    """The fused add + norm gemv at its largest K asks exactly 48 KB of dynamic shared memory beside 32 bytes of
    static: past 48 KB in all, the launch fails unless the kernel is allowed the dynamic part (only a dynamic part
    above 48 KB was)."""
    stream = type("S", (), {"ptr": 7})()
    kern = type("K", (), {"ptr": 9})()
    fn = type("F", (), {"kernel": kern, "shared_size_bytes": static, "max_dynamic_shared_size_bytes": None})()
    monkeypatch.setattr(cb, "_current_stream", lambda: (0, stream))
    monkeypatch.setattr(cb, "_driver_launch", lambda: lambda *a: 0)
    monkeypatch.setattr(cb, "_kernels", {})
    monkeypatch.setitem(cb._targets, id(fn), "sm_80")
    cb.launch(fn, (1,), (32,), (np.int32(1),), shared_mem=dynamic)
    assert fn.max_dynamic_shared_size_bytes == allowed


def test_a_kernels_shared_memory_allowance_is_set_once_and_never_lowered(monkeypatch):
    """The allowance is a driver call (cuFuncSetAttribute) and the static size a query: a launch asking no more
    dynamic shared memory than an earlier one of the kernel on that device makes neither, so a smaller launch
    after a larger one keeps the larger allowance; a larger one raises it."""
    stream = type("S", (), {"ptr": 7})()
    asked, allowed = [], []

    class Fn:
        kernel = type("K", (), {"ptr": 9})()

        @property
        def shared_size_bytes(self):
            asked.append(1)
            return 32

        max_dynamic_shared_size_bytes = property(lambda self: allowed[-1] if allowed else None,
                                                 lambda self, n: allowed.append(n))
    fn = Fn()
    monkeypatch.setattr(cb, "_current_stream", lambda: (0, stream))
    monkeypatch.setattr(cb, "_driver_launch", lambda: lambda *a: 0)
    monkeypatch.setattr(cb, "_kernels", {})
    monkeypatch.setitem(cb._targets, id(fn), "sm_80")
    for smem in (0, 60 * 1024, 60 * 1024, 50 * 1024, 0):
        cb.launch(fn, (1,), (32,), (np.int32(1),), shared_mem=smem)
    assert allowed == [60 * 1024] and len(asked) == 1
    cb.launch(fn, (1,), (32,), (np.int32(1),), shared_mem=70 * 1024)
    assert allowed == [60 * 1024, 70 * 1024] and fn.max_dynamic_shared_size_bytes == 70 * 1024
    small = Fn()  # under 48 KB in all: nothing to allow, and the static size asked once
    monkeypatch.setitem(cb._targets, id(small), "sm_80")
    allowed.clear()
    asked.clear()
    for _ in range(3):
        cb.launch(small, (1,), (32,), (np.int32(1),), shared_mem=16 * 1024)
    assert allowed == [] and len(asked) == 1


def _fake_map_driver(monkeypatch) -> list:
    """cuTensorMapEncodeTiled and cuTensorMapReplaceAddress stood in for by Python functions: a map's bytes are its
    address (8 bytes) and its dims, strides, box and promotion; the calls are recorded."""
    calls = []

    def encode(addr, dtype, rank, ptr, dims, strides, box, elem, interleave, swizzle, promotion, fill):
        calls.append("encode")
        body = struct.pack(f"<Q{rank}Q{rank - 1}Q{rank}Ii", ptr, *dims[:rank], *strides[:rank - 1], *box[:rank],
                           promotion)
        ctypes.memmove(addr, body.ljust(128, b"\0"), 128)
        return 0

    def replace(addr, ptr):
        calls.append("replace")
        ctypes.memmove(addr, struct.pack("<Q", ptr), 8)
        return 0

    monkeypatch.setattr(cb, "_encode_tiled", encode)
    monkeypatch.setattr(cb, "_driver_fns", {"cuTensorMapReplaceAddress": replace})
    monkeypatch.setattr(cb, "_maps", {})
    monkeypatch.setattr(cb, "_shapes", {})
    return calls


def test_a_new_address_of_a_known_shape_copies_its_map_with_the_address_replaced(monkeypatch):
    """tensor_map: a shape's first map is encoded; another address of it copies that map and has the driver replace
    the address (the bytes an encode would give); an address seen before gets its map back; a new box encodes."""
    calls = _fake_map_driver(monkeypatch)
    x, y = torch.zeros(64, 64), torch.zeros(64, 64)
    shape = ((64, 64), (256,), (64, 64))
    mx = cb.tensor_map(x, *shape)
    my = cb.tensor_map(y, *shape)
    assert calls == ["encode", "replace"]
    direct = cb.TensorMap(y.data_ptr(), *shape)
    assert ctypes.string_at(my.addr, 128) == ctypes.string_at(direct.addr, 128) != ctypes.string_at(mx.addr, 128)
    assert cb.tensor_map(y, *shape) is my and cb.tensor_map(x, *shape) is mx and calls[2:] == ["encode"]
    cb.tensor_map(y, (64, 64), (256,), (32, 64))
    assert calls[3:] == ["encode"]


def test_a_refused_address_replacement_names_the_address(monkeypatch):
    _fake_map_driver(monkeypatch)
    cb._driver_fns["cuTensorMapReplaceAddress"] = lambda addr, ptr: 1  # CUDA_ERROR_INVALID_VALUE
    m = cb.TensorMap(4096, (64, 64), (256,), (64, 64))
    with pytest.raises(ValueError, match=r"cuTensorMapReplaceAddress failed \(CUresult 1\) for address 0x1008"):
        m.at(4104)


@pytest.mark.gpu
def test_the_drivers_replaced_address_gives_the_bytes_of_an_encode():
    """On the GPU's driver: a map copied with its address replaced is byte for byte the map encoded for that
    address (every wgmma kernel's operands take this path once the allocator hands out a new address)."""
    x = torch.zeros(4, 96, 8, 128, dtype=torch.bfloat16, device="cuda")
    for dims, strides, box, promotion in (((128, 8, 96, 4), (256, 2048, 196608), (64, 1, 64, 1), 2),
                                          ((64, 4096), (128,), (64, 64), 2), ((72, 512), (144,), (64, 64), 0)):
        first = cb.TensorMap(x.data_ptr(), dims, strides, box, promotion)
        for off in (1 << 10, 3 << 12, 1 << 20):
            direct = cb.TensorMap(x.data_ptr() + off, dims, strides, box, promotion)
            assert ctypes.string_at(first.at(x.data_ptr() + off).addr, 128) == ctypes.string_at(direct.addr, 128)
