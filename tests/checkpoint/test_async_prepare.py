"""``prepare_async_save``: the asynchronous save's host buffers made ahead of the first save.

What must hold: the buffers the preparation makes are the ones the first save (and every later
one) copies into, with nothing made twice and never more than one copy of the state held (its
exact size: ``nbytes``); a preparation on a background thread that a save overtakes is waited
for; a preparation never touches the buffers of a save in flight (it waits for it); a failed
preparation leaves the next save to make them itself; what is saved and loaded back is the
copy, bit for bit, as without it. On CPU the buffers are plain memory; page-locking (CUDA) is
checked by the ``cuda``-marked test at the end and measured by ``benchmarks/bench_async_save.py``.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from _checkpoint_helpers import global_params, global_state, same
from hypothesis import given, settings
from hypothesis import strategies as st
from test_async_checkpoint import GATE, GatedWriter, _load_fresh, _state, _trained

from mfsdp_optim.checkpoint import load_checkpoint, prepare_async_save, save_checkpoint


@pytest.fixture(autouse=True)
def _fresh_buffers():
    """Every test starts and ends without kept host buffers (they are per process)."""
    from mfsdp_optim.checkpoint._on_disk import _async, _host_buffers

    _async.settle()
    _host_buffers.release()
    yield
    _async.settle()
    _host_buffers.release()


def _state_bytes(sd) -> int:
    from mfsdp_optim.checkpoint._on_disk._async import _collect

    return sum(t.numel() * t.element_size() for t in _collect(sd)[1])


def _buffer_ptrs() -> dict:
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    with _host_buffers.LOCK:
        return {k: b.tensor.data_ptr() for k, b in _host_buffers._BUFFERS.items()}


def _quiet():
    warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single..."


def test_the_first_save_copies_into_the_prepared_buffers(tmp_path):
    """Prepared (on the caller's thread, then on a background thread): the saves copy into those
    very buffers, one copy of the state's exact size, and write each save's own values."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    live = {"w": torch.arange(12.0).view(3, 4), "v": torch.ones(5), "i": torch.arange(3)}
    sd = {"s": live}
    for background in (False, True):
        _host_buffers.release()
        handle = prepare_async_save(sd, background=background)
        handle.wait(timeout=60)
        assert handle.done() and handle.nbytes == _state_bytes(sd) == _host_buffers.nbytes()
        made = _buffer_ptrs()
        assert len(made) == 2  # float32 and int64
        with warnings.catch_warnings():
            _quiet()
            for i in range(3):
                want = {k: v.clone() for k, v in live.items()}
                path = str(tmp_path / f"{background}-{i}")
                save = save_checkpoint(sd, path, asynchronous=True)
                for v in live.values():
                    v.add_(1)  # training goes on: not in the checkpoint
                save.wait(timeout=60)
                assert _buffer_ptrs() == made and _host_buffers.nbytes() == handle.nbytes
                target = {"s": {k: torch.zeros_like(v) for k, v in want.items()}}
                load_checkpoint(target, path)
                assert all(torch.equal(target["s"][k], v) for k, v in want.items()), i


def test_a_save_that_overtakes_the_preparation_waits_for_it(tmp_path, monkeypatch):
    """The preparation holds the buffers' lock while it makes them: a save started meanwhile
    waits, then finds them made (nothing made twice, one copy held)."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    made = threading.Event()
    go = threading.Event()
    real = _host_buffers._Buffer

    class SlowBuffer(real):  # the preparation's first buffer is slow to make
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if threading.current_thread().name == "mfsdp-async-save-prepare":
                made.set()
                go.wait(30)

    monkeypatch.setattr(_host_buffers, "_Buffer", SlowBuffer)
    sd = {"s": {"w": torch.arange(6.0), "v": torch.ones(4)}}
    handle = prepare_async_save(sd)
    assert made.wait(30) and not handle.done()
    threading.Timer(0.3, go.set).start()  # the save below waits for this
    with warnings.catch_warnings():
        _quiet()
        save_checkpoint(sd, str(tmp_path / "c"), asynchronous=True).wait(timeout=60)
    assert handle.done() and handle.nbytes == _host_buffers.nbytes() == 40
    target = {"s": {"w": torch.zeros(6), "v": torch.zeros(4)}}
    load_checkpoint(target, str(tmp_path / "c"))
    assert torch.equal(target["s"]["w"], torch.arange(6.0))


def test_a_preparation_waits_for_the_save_in_flight_and_holds_one_copy(tmp_path):
    """A save in flight writes from the buffers: a preparation (here for other sizes) waits for
    it before replacing them, and holds the new state's size alone afterwards."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    first = {"s": {"w": torch.arange(8.0)}}
    second = {"s": {"w": torch.arange(20.0)}}
    GATE.clear()
    with warnings.catch_warnings():
        _quiet()
        save = save_checkpoint(
            first, str(tmp_path / "a"), asynchronous=True, writer_cls=GatedWriter
        )
        handle = prepare_async_save(second)
        with pytest.raises(TimeoutError):
            handle.wait(timeout=0.3)  # the write is held: the preparation waits for it
        assert not save.done() and _host_buffers.nbytes() == 32
        GATE.set()
        save.wait(timeout=60)
        handle.wait(timeout=60)
    assert _host_buffers.nbytes() == 80  # the old buffer dropped: one copy
    target = {"s": {"w": torch.zeros(8)}}
    load_checkpoint(target, str(tmp_path / "a"))
    assert torch.equal(target["s"]["w"], torch.arange(8.0))


def test_a_failed_preparation_leaves_the_save_to_make_its_buffers(tmp_path, monkeypatch):
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    real = _host_buffers._Buffer
    failing = {"on": True}

    class Failing(real):
        def __init__(self, *args, **kwargs):
            if failing["on"]:
                raise RuntimeError("injected: cannot page-lock")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_host_buffers, "_Buffer", Failing)
    sd = {"s": {"w": torch.arange(6.0)}}
    handle = prepare_async_save(sd)
    with pytest.raises(RuntimeError, match="cannot page-lock"):
        handle.wait(timeout=60)
    assert _host_buffers.nbytes() == 0
    failing["on"] = False
    with warnings.catch_warnings():
        _quiet()
        save_checkpoint(sd, str(tmp_path / "c"), asynchronous=True).wait(timeout=60)
    assert _host_buffers.nbytes() == 24


def _rank_prepared_on_some_ranks(root):
    """Rank 0 prepares, rank 1 does not: the preparation itself is local (no collective; the
    state dict it reads is built on every rank), and the saves of both are the usual ones."""
    from mfsdp_optim.checkpoint._on_disk import _async, _host_buffers

    _async.settle()  # this pool process may keep buffers of an earlier test's saves
    _host_buffers.release()
    m = _trained()
    sd = _state(m)  # built on every rank (the build agrees on the keyspace)
    if dist.get_rank() == 0:
        prepare_async_save(sd).wait(timeout=60)
    prepared = _host_buffers.nbytes()
    out = {"prepared": prepared}
    for i in range(2):
        sd = _state(m)
        want = global_state(sd["optimizer"]), global_params(m)
        path = os.path.join(root, f"c{i}")
        save = save_checkpoint(sd, path, asynchronous=True)
        m.step(3 + i)  # training goes on
        save.wait(timeout=60)
        out[f"same{i}"] = same(_load_fresh(path), want)
    out["kept"] = _host_buffers.nbytes()
    _host_buffers.release()
    return out


def test_prepared_on_some_ranks_only(ranks, tmp_path):
    out = ranks(2).run(_rank_prepared_on_some_ranks, str(tmp_path))
    assert out[0]["prepared"] > 0 and out[1]["prepared"] == 0, out
    for o in out:
        assert o["same0"] and o["same1"] and o["kept"] > 0, out
    assert out[0]["kept"] == out[0]["prepared"], out  # the saves reused what was prepared


def _saved_while_training(sd, path: str) -> bool:
    """An asynchronous save of ``sd`` (``{"s": {name: CUDA tensor}}``), its tensors changed in
    place while it runs, waited for and loaded back: whether it holds the values at the call."""
    live = sd["s"]
    want = {k: v.cpu() for k, v in live.items()}
    with warnings.catch_warnings():
        _quiet()
        save = save_checkpoint(sd, path, asynchronous=True)
        for v in live.values():
            v.add_(1)
        save.wait(timeout=120)
    target = {"s": {k: torch.zeros_like(v) for k, v in want.items()}}
    load_checkpoint(target, path)
    return all(torch.equal(target["s"][k], v) for k, v in want.items())


@pytest.mark.cuda
def test_prepared_buffers_are_page_locked_at_their_exact_size(tmp_path):
    """On CUDA: the prepared buffers are page-locked (registered), hold the state's exact size
    (torch's pinned allocator would round 3 MiB + 4 bytes up to 4 MiB), the first save copies
    into them, and releasing them unlocks the pages."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    live = {"w": torch.randn(768, 1024, device="cuda"), "b": torch.randn(1, device="cuda")}
    sd = {"s": live}
    handle = prepare_async_save(sd)
    handle.wait(timeout=120)
    assert handle.nbytes == 768 * 1024 * 4 + 4 == _host_buffers.nbytes()
    (buf,) = _host_buffers._BUFFERS.values()
    assert buf.tensor.is_pinned() and buf.tensor.numel() == 768 * 1024 + 1
    ptr = buf.tensor.data_ptr()
    assert _saved_while_training(sd, str(tmp_path / "c"))
    assert _host_buffers._BUFFERS[(torch.float32, "cuda")].tensor.data_ptr() == ptr
    kept = buf.tensor
    _host_buffers.release()
    assert not kept.is_pinned()


@pytest.mark.cuda
def test_page_locking_lets_go_of_the_gil():
    """On CUDA: the buffers are page-locked through the loaded libcudart by ctypes, which lets
    go of the GIL, so another Python thread (training, beside a preparation) runs while
    gigabytes are locked. torch's own binding holds the GIL: the other thread would not tick."""
    import time

    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    cudart = _host_buffers.cudart()
    assert cudart.gil_free, "no shared libcudart among the process's libraries"
    buf = torch.empty(1 << 29)  # 2 GiB of pages not yet faulted in: locking takes ~1 s
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    other = threading.Thread(target=tick)
    other.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    err = cudart.register(buf.data_ptr(), buf.numel() * 4, 1)
    t1 = time.perf_counter()
    stop.set()
    other.join()
    try:
        assert err == 0 and buf.is_pinned()
    finally:
        cudart.unregister(buf.data_ptr())
    during = sum(t0 < t < t1 for t in ticks)
    assert t1 - t0 < 0.05 or during >= 0.2 * (t1 - t0) / 0.001, (t1 - t0, during)


def test_a_loaded_library_is_found_by_its_file_name():
    """How the page-locking calls find the CUDA runtime torch loaded (``libcudart.so.*`` on a
    CUDA build): by a file name's start among the process's mapped libraries; here torch's own
    CPU library, loaded on every build, the C library, and a name that nothing has."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    found = _host_buffers._loaded("libtorch_cpu")
    assert found is not None and os.path.basename(found).startswith("libtorch_cpu.so")
    assert os.path.isfile(found)
    assert _host_buffers._loaded("libno_such_library_here") is None
    # a library without the page-locking functions (the C library: a symbol looked up through
    # a library's handle is searched in what it links too, which for torch's own libraries on
    # a CUDA build includes the runtime), or none: torch's bindings are used instead
    libc = _host_buffers._loaded("libc")
    assert libc is not None and _host_buffers._ctypes_calls(libc) is None
    assert _host_buffers._ctypes_calls(None) is None
    assert _host_buffers._ctypes_calls("/no/such/libcudart.so.13") is None
    # the name must go on with "." or "-": a longer library's name is not a match
    assert _host_buffers._loaded("libtorch_cp") is None


def test_the_runtime_is_found_under_each_name_a_wheel_gives_it(tmp_path):
    """``libcudart.so.13`` (torch's CUDA 13 wheels, beside it), ``libcudart-<hash>.so.12``
    (wheels that bundle it), a mapping whose file was replaced since (`` (deleted)``), and no
    match for a longer name (``libcudart_static``) or an anonymous mapping."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    def found(*paths: str) -> str | None:
        maps = tmp_path / "maps"
        maps.write_text(
            "".join(f"7f00-7f01 r-xp 00000000 08:01 {i} {p}\n" for i, p in enumerate(paths))
            + "7f02-7f03 rw-p 00000000 00:00 0\n"
        )
        return _host_buffers._loaded("libcudart", str(maps))

    lib = "/x/nvidia/cu13/lib/libcudart.so.13"
    assert found("/usr/lib/libc.so.6", lib) == lib
    assert found("/x/torch/lib/libcudart-9335f6a2.so.12") == "/x/torch/lib/libcudart-9335f6a2.so.12"
    assert found(f"{lib} (deleted)") == lib
    assert found("/x/lib/libcudart_static.so", "/x/lib/libcudartx.so.1") is None
    assert found() is None
    assert _host_buffers._loaded("libcudart", str(tmp_path / "none")) is None


class _FakeRuntime:
    """Stands in for the CUDA runtime's page-locking calls on a machine without a GPU (the
    bookkeeping of a buffer locked in pieces; the real calls are the cuda-marked tests'): it
    keeps the registered ranges, refuses overlapping pages as the driver does, and fails the
    ``fail_at``-th registration."""

    def __init__(self, fail_at: int = -1):
        self.ranges: dict[int, int] = {}
        self.calls = 0
        self.fail_at = fail_at
        self.cleared = 0

    def register(self, ptr: int, n: int, flags: int) -> int:
        from mfsdp_optim.checkpoint._on_disk._host_buffers import _PAGE as page

        self.calls += 1
        if self.calls == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        lo, hi = ptr // page, -(-(ptr + n) // page)
        for p, m in self.ranges.items():
            if lo < -(-(p + m) // page) and p // page < hi:
                return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.ranges[ptr] = n
        return 0

    def unregister(self, ptr: int) -> int:
        return 0 if self.ranges.pop(ptr, None) is not None else 713

    def clear_error(self) -> int:
        self.cleared += 1
        return 0


@pytest.fixture
def fake_runtime(monkeypatch):
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    rt = _FakeRuntime()
    monkeypatch.setattr(_host_buffers, "cudart", lambda: rt)
    monkeypatch.setattr(_host_buffers, "_PIECE_BYTES", 3 * _host_buffers._PAGE)
    return rt


@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.uint8]),
    numel=st.integers(1, 40_000),
)
@settings(max_examples=60, deadline=None)
def test_a_buffer_is_locked_in_whole_pages_none_shared(dtype, numel):
    """Locked in pieces: the buffer starts on a page; its pieces are whole pages, at most
    ``_PIECE_BYTES`` each, one after the other, covering it and no page of anything else (the
    allocation holds the rest of the last page), each registered once; a release unlocks every
    one; two buffers side by side never share a page (the stand-in refuses that as the driver
    does)."""
    import unittest.mock

    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    rt = _FakeRuntime()
    page = _host_buffers._PAGE
    with (
        unittest.mock.patch.object(_host_buffers, "cudart", lambda: rt),
        unittest.mock.patch.object(_host_buffers, "_PIECE_BYTES", 3 * page),
    ):
        bufs = [_host_buffers._Buffer(dtype, numel, locked=True) for _ in range(2)]
        for buf in bufs:
            t = buf.tensor
            assert t.numel() == numel and t.dtype == dtype and t.data_ptr() % page == 0
            nbytes = numel * dtype.itemsize
            assert sum(n for _, n in buf.pieces) == -(-nbytes // page) * page
            ptr = t.data_ptr()
            for p, n in buf.pieces:
                assert p == ptr and n % page == 0 and 0 < n <= 3 * page
                ptr += n
            storage = t.untyped_storage()
            assert ptr <= storage.data_ptr() + storage.nbytes()  # its own allocation
            seams = buf.seams()
            assert seams == [(p - t.data_ptr()) // dtype.itemsize for p, _ in buf.pieces[1:]]
        assert len(rt.ranges) == sum(len(b.pieces) for b in bufs) == rt.calls
        for buf in bufs:
            buf.release()
            assert not buf.locked
        assert rt.ranges == {}


def test_pieces_of_a_given_size_are_whole_pages():
    """A piece size of the caller's (the benchmark's choices) is rounded down to whole pages,
    never below one; the last piece takes the rest, rounded up to its page."""
    from mfsdp_optim.checkpoint._on_disk._host_buffers import _PAGE, _pieces

    sizes = [n for _, n in _pieces(0, 10 * _PAGE - 5, 4 * _PAGE + 100)]
    assert sizes == [4 * _PAGE, 4 * _PAGE, 2 * _PAGE]
    assert [n for _, n in _pieces(_PAGE, 3 * _PAGE, 1)] == [_PAGE] * 3
    assert [p for p, _ in _pieces(_PAGE, 3 * _PAGE, 1)] == [_PAGE, 2 * _PAGE, 3 * _PAGE]


@given(
    seams=st.lists(st.integers(1, 500), max_size=6, unique=True).map(sorted),
    offset=st.integers(0, 400),
    numel=st.integers(0, 200),
)
def test_a_copy_is_cut_where_two_pieces_meet(seams, offset, numel):
    """``_segments``: consecutive ranges that cover the view exactly, each inside one piece (no
    seam strictly inside it), cut at every seam strictly inside the view."""
    from mfsdp_optim.checkpoint._on_disk._host_buffers import _segments

    ranges = _segments(offset, numel, seams)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    inside = [s - offset for s in seams if offset < s < offset + numel]
    assert [b for _, b in ranges[:-1]] == inside
    for a, b in ranges:
        assert not any(a < s - offset < b for s in seams)


def test_copies_into_a_buffer_locked_in_pieces_land_whole(fake_runtime):
    """The staging's copies into a buffer locked in pieces (a few pages each here): every view
    holds its source afterwards, bit for bit, whether it lies in one piece or spans several,
    contiguous or not."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    g = torch.Generator().manual_seed(0)
    sources = [
        torch.randn(3000, generator=g),  # spans a seam (3 pages a piece: 3,072 floats)
        torch.randn(5, generator=g),
        torch.randn(40, 250, generator=g),  # spans two
        torch.randn(300, 20, generator=g).t(),  # not contiguous, spans a seam: copied whole
        torch.randn(7, generator=g),
    ]
    key = (torch.float32, "cuda")
    with _host_buffers.LOCK:
        old = _host_buffers._BUFFERS.get(key)
        total = sum(s.numel() for s in sources)
        _host_buffers._BUFFERS[key] = buf = _host_buffers._Buffer(torch.float32, total, True)
        sizes = [s.numel() for s in sources]
        try:
            assert len(buf.seams()) >= 4
            views = [v.view(s.shape) for v, s in zip(buf.tensor.split(sizes), sources, strict=True)]
            _host_buffers.copy_in(key, views, sources)
            assert all(torch.equal(v, s) for v, s in zip(views, sources, strict=True))
        finally:
            buf.release()
            if old is None:
                _host_buffers._BUFFERS.pop(key)
            else:
                _host_buffers._BUFFERS[key] = old
    assert fake_runtime.ranges == {}


def test_a_failed_piece_leaves_nothing_locked(fake_runtime):
    """The third piece fails: the two locked before it are unlocked, the runtime's error is
    taken off the thread (else the next kernel launch would report it), and the error says
    what to do."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    fake_runtime.fail_at = 3
    with pytest.raises(RuntimeError, match="CUDA error 2.*save synchronously"):
        _host_buffers._Buffer(torch.float32, 10 * _host_buffers._PAGE, True)
    assert fake_runtime.calls == 3 and fake_runtime.ranges == {} and fake_runtime.cleared == 1


@pytest.mark.cuda
def test_pieces_are_page_locked_and_copies_across_them_are_exact(tmp_path, monkeypatch):
    """On CUDA, with pieces of 1 MiB: a prepared buffer of several pieces is page-locked in
    each (torch sees every piece as pinned), a save's copies across the seams are bit for bit
    (loaded back), and releasing the buffer unlocks every piece."""
    from mfsdp_optim.checkpoint._on_disk import _host_buffers

    monkeypatch.setattr(_host_buffers, "_PIECE_BYTES", 1 << 20)
    g = torch.Generator(device="cuda").manual_seed(0)
    live = {
        "a": torch.randn(300_001, device="cuda", generator=g),  # 1.14 MiB: spans a seam
        "b": torch.randn(1000, 1000, device="cuda", generator=g),  # 3.8 MiB: spans four
        "c": torch.randn(3, device="cuda", generator=g),
    }
    sd = {"s": live}
    prepare_async_save(sd).wait(timeout=120)
    (buf,) = _host_buffers._BUFFERS.values()
    assert len(buf.pieces) == 5 and all(
        buf.tensor[(p - buf.tensor.data_ptr()) // 4 :].is_pinned() for p, _ in buf.pieces
    )
    assert _saved_while_training(sd, str(tmp_path / "c"))
    kept = buf.tensor
    _host_buffers.release()
    assert not any(kept[(p - kept.data_ptr()) // 4 :].is_pinned() for p, _ in buf.pieces)
