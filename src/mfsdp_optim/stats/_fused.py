"""Optional fused kernels for the stats layer (CUDA + Triton).

``shard_contribution`` has the contract of ``stats._math.shard_contribution()`` and returns
None when no fused kernel applies (CPU tensors, Triton missing, a CUDA graph capture whose
stream has no table for these tensors yet, ``torch.compile`` tracing, an unsupported dtype);
the caller then takes the pure-torch path.
One persistent kernel per bucket over a persistent table (``StatsTable``, kept per device,
stream, dtype and numels; ``_infra.device_table``), float64 accumulation, a deterministic final
reduction by the last program. Design: docs/concepts.md, "The fused stats kernel".
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._infra.caches import keep_alive, register
from .._infra.device_table import DeviceTable, addresses, same_addresses
from .._infra.kernels import device_helpers, element_offsets, sm_count_of

__all__ = [
    "Tuning",
    "fused_available",
    "launch",
    "launch_plan",
    "load_kernel",
    "programs_per_sm",
    "set_programs_per_sm",
    "set_table_cache",
    "set_tuning",
    "shard_contribution",
    "tuning",
]

# Elements per item (one masked or unmasked load per program iteration) and warps per program.
_BLOCK = 2048
_NUM_WARPS = 4
# Upper bound on resident programs per SM used before the first compile tells the register count.
_DEFAULT_PROGRAMS_PER_SM = 4
_REDUCE_BLOCK = 1024
# Neighbouring elements folded (in registers) before they reach the per-lane accumulators.
_FOLD = 4

# P_KIND codes (compile-time constants of the kernel).
_P_INF, _P_ONE, _P_TWO, _P_THREE, _P_HALF, _P_GENERAL = 0, 1, 2, 3, 4, 5

# Table cache: reuse the device copy of the table when the same tensors come back.
TABLE_CACHE_ENABLED = True
_TABLE_CACHE_SIZE = 16

_state: dict[str, Any] = {"triton": None, "kernel": None, "failed": False}
_table_cache: OrderedDict[tuple, StatsTable] = OrderedDict()
_workspaces: dict[tuple[int, int], dict[str, Any]] = {}
_programs_per_sm: dict[tuple, int] = {}
register(_table_cache.clear)
keep_alive(_table_cache)  # a captured graph reads the tables and workspaces
keep_alive(_workspaces)


def _env_disabled() -> bool:
    return os.environ.get("MFSDP_OPTIM_DISABLE_FUSED", "") not in ("", "0")


def _load_triton() -> Any | None:
    """Import triton and build the kernel once; None (for good) if that fails."""
    if _state["failed"]:
        return None
    if _state["kernel"] is not None:
        return _state["kernel"]
    try:
        import numpy  # noqa: F401  (the host-side table; torch does not require numpy)
        import triton  # noqa: F401

        _state["kernel"] = _build_kernel()
    except Exception:  # ImportError, or a Triton too old for the features used
        _state["failed"] = True
        return None
    return _state["kernel"]


def fused_available(device: torch.device | str | None = None) -> bool:
    """Whether the fused kernel can run on ``device`` (default: the current CUDA device)."""
    if _env_disabled() or not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    return _load_triton() is not None


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except ImportError:  # older layouts
        from triton.language.extra.cuda import libdevice  # type: ignore[no-redef]

    first_tensor = device_helpers()["first_tensor"]

    @triton.jit
    def _max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _power(x, p, P_KIND: tl.constexpr):
        # |x|^p per element in float64 (float32 max|x| for p = inf)
        if P_KIND == 0:
            return tl.abs(x.to(tl.float32))
        elif P_KIND == 1:
            return tl.abs(x.to(tl.float32)).to(tl.float64)
        elif P_KIND == 2:
            xd = x.to(tl.float32).to(tl.float64)
            return xd * xd
        elif P_KIND == 3:
            xd = tl.abs(x.to(tl.float32)).to(tl.float64)
            return xd * xd * xd
        elif P_KIND == 4:
            return libdevice.sqrt_rn(tl.abs(x.to(tl.float32)).to(tl.float64))
        else:
            return libdevice.pow(tl.abs(x.to(tl.float32)).to(tl.float64), p)

    @triton.jit
    def _accumulate(acc, v, P_KIND: tl.constexpr, FOLD: tl.constexpr):
        # Fold FOLD neighbouring elements (held by one thread) before adding to the lanes: fewer
        # float64 accumulator registers, more loads in flight.
        v2 = tl.reshape(v, [v.shape[0] // FOLD, FOLD])
        if P_KIND == 0:
            return tl.maximum(acc, tl.reduce(v2, 1, _max_nan), propagate_nan=tl.PropagateNan.ALL)
        else:
            return acc + tl.sum(v2, axis=1)

    @triton.jit
    def _flush(acc, total, t, flags_ptr, P_KIND: tl.constexpr):
        # Reduce one tensor's lanes; flag the tensor if its sum (or max) is not finite.
        if P_KIND == 0:
            s = tl.reduce(acc, 0, _max_nan).to(tl.float64)
            total = tl.maximum(total, s, propagate_nan=tl.PropagateNan.ALL)
        else:
            s = tl.sum(acc, axis=0)
            total = total + s
        if (s * 0.0) != 0.0:  # NaN or inf (x * 0 is 0 for every finite x)
            tl.store(flags_ptr + t, 1)
        return total

    @triton.jit(
        do_not_specialize=["n", "total_items", "items_per_prog", "num_progs", "replication"]
    )
    def _stats_kernel(
        base_ptr,
        table_ptr,
        n,
        total_items,
        items_per_prog,
        num_progs,
        psum_ptr,
        pzero_ptr,
        flags_ptr,
        ticket_ptr,
        out_ptr,
        replication,
        BLOCK: tl.constexpr,
        P_KIND: tl.constexpr,
        COUNT_ZEROS: tl.constexpr,
        ALIGN: tl.constexpr,
        REDUCE_BLOCK: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        pid = tl.program_id(0)
        begin = pid.to(tl.int64) * items_per_prog
        end = tl.minimum(begin + items_per_prog, total_items)
        offs_tab = table_ptr
        numel_tab = table_ptr + n
        cum_tab = table_ptr + 2 * n
        p = tl.load(table_ptr + 3 * n + 1).to(tl.float64, bitcast=True)

        t = first_tensor(cum_tab, n, begin)
        seg_first = tl.load(cum_tab + t)
        seg_end = tl.load(cum_tab + t + 1)
        off = tl.load(offs_tab + t)
        numel = tl.load(numel_tab + t)

        lanes = tl.arange(0, BLOCK)
        if P_KIND == 0:
            acc = tl.zeros([BLOCK // FOLD], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK // FOLD], dtype=tl.float64)
        zacc = tl.zeros([BLOCK // FOLD], dtype=tl.int32)
        total = tl.full([], 0.0, tl.float64)

        for it in range(begin, end):
            if it >= seg_end:
                total = _flush(acc, total, t, flags_ptr, P_KIND)
                if P_KIND == 0:
                    acc = tl.zeros([BLOCK // FOLD], dtype=tl.float32)
                else:
                    acc = tl.zeros([BLOCK // FOLD], dtype=tl.float64)
                t = t + 1
                seg_first = seg_end
                seg_end = tl.load(cum_tab + t + 1)
                off = tl.load(offs_tab + t)
                numel = tl.load(numel_tab + t)
            e0 = (it - seg_first) * BLOCK
            start = off + e0
            if ALIGN > 1:
                start = tl.multiple_of(start, ALIGN)
            ptrs = base_ptr + (start + lanes)
            if e0 + BLOCK <= numel:
                x = tl.load(ptrs)
                acc = _accumulate(acc, _power(x, p, P_KIND), P_KIND, FOLD)
                if COUNT_ZEROS:
                    zacc = zacc + tl.sum(
                        tl.reshape((x == 0).to(tl.int32), [BLOCK // FOLD, FOLD]), axis=1
                    )
            else:
                m = (e0 + lanes) < numel
                x = tl.load(ptrs, mask=m, other=0.0)
                acc = _accumulate(acc, _power(x, p, P_KIND), P_KIND, FOLD)
                if COUNT_ZEROS:
                    zacc = zacc + tl.sum(
                        tl.reshape(((x == 0) & m).to(tl.int32), [BLOCK // FOLD, FOLD]), axis=1
                    )
        if begin < end:
            total = _flush(acc, total, t, flags_ptr, P_KIND)

        tl.store(psum_ptr + pid, total)
        if COUNT_ZEROS:
            tl.store(pzero_ptr + pid, tl.sum(zacc.to(tl.int64), axis=0))
        # Publish this program's partial, then take a ticket; the last one reduces.
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == num_progs - 1:
            r = tl.arange(0, REDUCE_BLOCK)
            fsum = tl.full([], 0.0, tl.float64)
            zsum = tl.full([], 0, tl.int64)
            for s0 in range(0, num_progs, REDUCE_BLOCK):
                mk = (s0 + r) < num_progs
                ps = tl.load(psum_ptr + s0 + r, mask=mk, other=0.0, cache_modifier=".cg")
                if P_KIND == 0:
                    fsum = tl.maximum(
                        fsum, tl.reduce(ps, 0, _max_nan), propagate_nan=tl.PropagateNan.ALL
                    )
                else:
                    fsum = fsum + tl.sum(ps, axis=0)
                if COUNT_ZEROS:
                    pz = tl.load(pzero_ptr + s0 + r, mask=mk, other=0, cache_modifier=".cg")
                    zsum = zsum + tl.sum(pz, axis=0)
            nflag = tl.full([], 0, tl.int32)
            for s0 in range(0, n, REDUCE_BLOCK):
                mk = (s0 + r) < n
                fl = tl.load(flags_ptr + s0 + r, mask=mk, other=0, cache_modifier=".cg")
                nflag = nflag + tl.sum(fl, axis=0)
                tl.store(flags_ptr + s0 + r, tl.zeros([REDUCE_BLOCK], dtype=tl.int32), mask=mk)
            if P_KIND != 0:
                fsum = fsum / replication.to(tl.float64)
            tl.store(out_ptr, fsum)
            tl.store(out_ptr + 1, zsum.to(tl.float64))
            tl.store(out_ptr + 2, nflag.to(tl.float64))
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")

    # The kernel finds its helpers by name in this module's globals (closures are not resolved
    # by every Triton version, nor by its interpreter).
    globals().update(
        tl=tl,
        libdevice=libdevice,
        _max_nan=_max_nan,
        _power=_power,
        _accumulate=_accumulate,
        _flush=_flush,
        first_tensor=first_tensor,
    )
    return _stats_kernel


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _p_kind(norm_type: float) -> int:
    if math.isinf(norm_type):
        return _P_INF
    return {1.0: _P_ONE, 2.0: _P_TWO, 3.0: _P_THREE, 0.5: _P_HALF}.get(norm_type, _P_GENERAL)


def _workspace(device: torch.device, stream: int, n: int, num_progs: int) -> dict[str, Any]:
    """Per (device, stream) buffers; the kernel leaves flags and ticket at zero when it ends, so
    they are zeroed once, at allocation. Keyed by stream so that concurrent calls on different
    streams never share them (a replaced buffer goes back to the same stream's pool)."""
    key = (device.index, stream)
    ws = _workspaces.get(key)
    if ws is None or ws["n"] < n or ws["g"] < num_progs:
        old_n = ws["n"] if ws is not None else 0
        old_g = ws["g"] if ws is not None else 0
        nn, gg = max(n, old_n, 1024), max(num_progs, old_g, 1024)
        ws = {
            "n": nn,
            "g": gg,
            "psum": torch.empty(gg, dtype=torch.float64, device=device),
            "pzero": torch.empty(gg, dtype=torch.int64, device=device),
            "flags": torch.zeros(nn, dtype=torch.int32, device=device),
            "ticket": torch.zeros(1, dtype=torch.int32, device=device),
        }
        _workspaces[key] = ws
    return ws


def _programs(kernel_key: tuple, device: torch.device) -> int:
    return sm_count_of(device) * _programs_per_sm.get(kernel_key, _DEFAULT_PROGRAMS_PER_SM)


def _learn_occupancy(kernel_key: tuple, compiled: Any, device: torch.device) -> None:
    """After the first launch of a variant, size its grid from its register count: as many
    programs as fit on an SM at once, so the grid is one full wave."""
    try:
        props = torch.cuda.get_device_properties(device)
        regs = int(compiled.n_regs)
        warps = int(compiled.metadata.num_warps)
        max_threads = int(getattr(props, "max_threads_per_multi_processor", 2048))
        max_regs = int(getattr(props, "regs_per_multiprocessor", 65536))
        by_threads = max_threads // (warps * 32)
        regs_per_warp = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
        by_regs = (max_regs // max(1, regs_per_warp)) // warps
        _programs_per_sm[kernel_key] = max(1, min(by_threads, by_regs, 32))
    except Exception:
        _programs_per_sm[kernel_key] = _DEFAULT_PROGRAMS_PER_SM


def _norm_bits(norm_type: float) -> Any:
    """The table's norm-type slot: ``p`` as a float64 bit pattern (0 for inf)."""
    import numpy as np

    p = float(norm_type)
    return np.array([p if math.isfinite(p) else 0.0]).view(np.int64)


class StatsTable:
    """The persistent table of one bucket layout (the tensors' numels, in order), kept on the
    device: ``[offsets (n) | numels (n) | cum items (n + 1) | p]`` over the ``n`` non-empty
    tensors, offsets in elements from the first of them.

    It keeps no tensor: at every call ``refresh`` checks the tensors' addresses against the
    ones the offsets were computed from (``device_table.same_addresses``) and the caller has
    matched their numels (the cache key), so everything the kernel reads is re-verified
    against tensors the caller holds; only the offsets (tensors that moved) or the norm type
    are re-uploaded.
    """

    __slots__ = ("keep", "first", "n", "ptrs", "aligned", "total_items", "host", "table")
    keep: list[int]
    first: int
    n: int
    ptrs: list[int]
    aligned: bool
    total_items: int
    host: Any
    table: DeviceTable | None

    @classmethod
    def build(cls, numels: Sequence[int], norm_type: float) -> StatsTable | None:
        """The layout part (numels, cum items, p); None when every tensor is empty. The
        offsets come with the first ``refresh``."""
        import numpy as np

        sizes = np.fromiter(numels, dtype=np.int64, count=len(numels))
        keep = np.flatnonzero(sizes)
        if keep.size == 0:
            return None
        self = cls()
        n = self.n = int(keep.size)
        self.keep, self.first = keep.tolist(), int(keep[0])
        self.ptrs, self.aligned, self.table = [], True, None
        host = self.host = np.zeros(3 * n + 2, dtype=np.int64)
        host[n : 2 * n] = sizes[keep]
        np.cumsum((sizes[keep] + (_BLOCK - 1)) // _BLOCK, out=host[2 * n + 1 : 3 * n + 1])
        host[3 * n + 1] = _norm_bits(norm_type)[0]
        self.total_items = int(host[3 * n])
        return self

    def refresh(self, tensors: Sequence[torch.Tensor], norm_type: float) -> bool:
        """Point the table at ``tensors`` (same numels as built); False when the kernel cannot
        address them (an offset that is not a whole element)."""
        import numpy as np

        n = self.n
        if self.table is None or not same_addresses(tensors, self.ptrs, self.keep):
            ptrs = addresses(tensors)
            kept = np.fromiter((ptrs[i] for i in self.keep), dtype=np.int64, count=n)
            located = element_offsets(kept, tensors[self.first].element_size())
            if located is None:
                return False
            self.ptrs, self.aligned = ptrs, located[1]
            if self.table is None:
                self.host[:n] = located[0]
                self.table = DeviceTable(self.host, tensors[self.first].device)
            else:
                self.table.patch(0, located[0])
        self.table.patch(3 * n + 1, _norm_bits(norm_type))
        return True

    def ready_for(self, tensors: Sequence[torch.Tensor], norm_type: float) -> bool:
        """The device copy already points at ``tensors`` with this norm type: a launch needs
        no upload (what a CUDA graph capture requires)."""
        return (
            self.table is not None
            and same_addresses(tensors, self.ptrs, self.keep)
            and self.host[3 * self.n + 1] == _norm_bits(norm_type)[0]
        )


def _stats_table(
    tensors: Sequence[torch.Tensor],
    norm_type: float,
    device: torch.device,
    stream: int,
    frozen: bool = False,
) -> StatsTable | None:
    """The persistent table for these tensors (cached per device, stream and numels), pointed
    at them; None when the fused kernel cannot take them. ``frozen`` (a CUDA graph capture):
    only a cached table that needs no upload."""
    numels = tuple(map(torch.Tensor.numel, tensors))
    # the dtype too: the offsets are in elements, so a bucket of another element size whose
    # tensors reuse the same addresses must not find these offsets
    key = (device.index, stream, tensors[0].dtype, numels)
    tab = _table_cache.get(key) if TABLE_CACHE_ENABLED else None
    if frozen:
        return tab if tab is not None and tab.ready_for(tensors, norm_type) else None
    if tab is None:
        tab = StatsTable.build(numels, norm_type)
        if tab is None:
            return None
    if not tab.refresh(tensors, norm_type):
        return None
    if TABLE_CACHE_ENABLED:
        _table_cache[key] = tab
        _table_cache.move_to_end(key)
        while len(_table_cache) > _TABLE_CACHE_SIZE:
            _table_cache.popitem(last=False)
    return tab


class _Plan:
    """Everything one launch needs, built on the host from the tensors' addresses and sizes."""

    __slots__ = (
        "base", "table", "n", "total_items", "per_prog", "num_progs", "ws", "replication",
        "p_kind", "zeros", "align", "kernel_key", "device",
    )  # fmt: skip
    base: torch.Tensor
    table: torch.Tensor
    n: int
    total_items: int
    per_prog: int
    num_progs: int
    ws: dict[str, Any]
    replication: int
    p_kind: int
    zeros: bool
    align: int
    kernel_key: tuple
    device: torch.device


def _plan(
    tensors: Sequence[torch.Tensor],
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
    frozen: bool = False,
) -> _Plan | None:
    """Build a launch plan for contiguous tensors of one device and dtype; None if the fused
    kernel cannot take them (then the caller uses the reference path). ``frozen`` (a CUDA
    graph capture): None unless the table and the workspace need no upload or allocation."""
    first = tensors[0]
    device = first.device
    stream = torch.cuda.current_stream(device).cuda_stream
    tab = _stats_table(tensors, norm_type, device, stream, frozen)
    if tab is None:
        return None
    first = tensors[tab.first]
    esize = first.element_size()
    align = 16 // esize if tab.aligned else 1
    total_items = tab.total_items
    n = tab.n
    plan = _Plan()
    plan.device = device
    plan.p_kind = _p_kind(float(norm_type))
    plan.zeros = bool(count_zeros and canonical)
    plan.align = align
    plan.kernel_key = (
        device.index,
        first.dtype,
        plan.p_kind,
        plan.zeros,
        align,
        _BLOCK,
        _NUM_WARPS,
        _FOLD,
    )
    num_progs = min(total_items, _programs(plan.kernel_key, device))
    plan.per_prog = -(-total_items // num_progs)
    plan.num_progs = -(-total_items // plan.per_prog)
    plan.base = first
    plan.n = n
    plan.total_items = total_items
    plan.replication = int(replication)
    assert tab.table is not None
    plan.table = tab.table.tensor
    if frozen:
        ws = _workspaces.get((device.index, stream))
        if ws is None or ws["n"] < n or ws["g"] < plan.num_progs:
            return None
    plan.ws = _workspace(device, stream, n, plan.num_progs)
    return plan


def _launch(kernel: Any, plan: _Plan) -> torch.Tensor:
    """One kernel launch on the current stream; returns the float64 contribution."""
    ws = plan.ws
    out = torch.empty(3, dtype=torch.float64, device=plan.device)
    compiled = kernel[(plan.num_progs,)](
        plan.base,
        plan.table,
        plan.n,
        plan.total_items,
        plan.per_prog,
        plan.num_progs,
        ws["psum"],
        ws["pzero"],
        ws["flags"],
        ws["ticket"],
        out,
        plan.replication,
        BLOCK=_BLOCK,
        P_KIND=plan.p_kind,
        COUNT_ZEROS=plan.zeros,
        ALIGN=plan.align,
        REDUCE_BLOCK=_REDUCE_BLOCK,
        FOLD=_FOLD,
        num_warps=_NUM_WARPS,
    )
    if plan.kernel_key not in _programs_per_sm:
        _learn_occupancy(plan.kernel_key, compiled, plan.device)
    return out


def shard_contribution(
    tensors: Sequence[torch.Tensor],
    *,
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
) -> torch.Tensor | None:
    """The contribution of ``tensors`` (one device and dtype: the caller's bucket) from one fused
    kernel, or None when the fused path does not apply. Same contract and result as
    ``mfsdp_optim.stats._math.shard_contribution()`` up to float64 rounding order, except that
    the result is deterministic and never needs more than one launch."""
    if not tensors:
        return None
    first = tensors[0]
    if first.device.type != "cuda" or first.dtype not in _DTYPES or _env_disabled():
        return None
    if torch.version.cuda is None:  # ROCm builds: not tuned or tested here
        return None
    kernel = _load_triton()
    if kernel is None:
        return None
    if torch.compiler.is_compiling():
        return None
    # under CUDA graph capture only a launch that uploads and allocates nothing outside the
    # graph (an eager call on the capturing stream made the table and the workspace)
    capturing = torch.cuda.is_current_stream_capturing()
    tensors = list(tensors)
    if not all(map(torch.Tensor.is_contiguous, tensors)):
        if capturing:
            return None
        return _mixed_contribution(tensors, norm_type, replication, canonical, count_zeros)
    device = first.device
    with torch.cuda.device(device):
        plan = _plan(tensors, norm_type, replication, canonical, count_zeros, capturing)
        if plan is None:
            return None
        return _launch(kernel, plan)


def _mixed_contribution(
    tensors: list[torch.Tensor],
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
) -> torch.Tensor | None:
    """Fused over the contiguous tensors, the reference path over the strided ones."""
    from ._math import combine_contributions
    from ._math import shard_contribution as reference

    dense = [t for t in tensors if t.is_contiguous() and t.numel() > 0]
    strided = [t for t in tensors if not t.is_contiguous() and t.numel() > 0]
    rows = [
        reference(
            strided,
            norm_type=norm_type,
            replication=replication,
            canonical=canonical,
            count_zeros=count_zeros,
        )
    ]
    if dense:
        fused = shard_contribution(
            dense,
            norm_type=norm_type,
            replication=replication,
            canonical=canonical,
            count_zeros=count_zeros,
        )
        if fused is None:
            return None
        rows.append(fused)
    return combine_contributions(torch.stack(rows), norm_type)


# -- a launch taken apart and the tuning knobs, for benchmarks/bench_stats.py (``stats.kernels``)


class Tuning(NamedTuple):
    """The kernel's compile-time shape (each set of values is a variant of its own).

    Attributes:
        block: Elements per item (one load per program iteration).
        num_warps: Warps per program.
        fold: Neighbouring elements folded in registers before the per-lane accumulators.
    """

    block: int
    num_warps: int
    fold: int


def tuning() -> Tuning:
    """The shape every launch plan takes now."""
    return Tuning(_BLOCK, _NUM_WARPS, _FOLD)


def set_tuning(shape: Tuning) -> None:
    """Make ``shape`` the one that plans built from now on take (a benchmark's sweep)."""
    global _BLOCK, _NUM_WARPS, _FOLD
    _BLOCK, _NUM_WARPS, _FOLD = shape


def set_table_cache(enabled: bool) -> None:
    """Keep the persistent argument tables between calls (the default), or build one per call."""
    global TABLE_CACHE_ENABLED
    TABLE_CACHE_ENABLED = enabled


def load_kernel() -> Any | None:
    """The compiled-on-first-launch Triton kernel, or None where Triton cannot build it."""
    return _load_triton()


def launch_plan(
    tensors: Sequence[torch.Tensor],
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
) -> _Plan | None:
    """A launch plan for contiguous ``tensors`` of one CUDA device and dtype (None where the
    kernel cannot take them); its ``num_progs`` is the grid and ``kernel_key`` the variant."""
    return _plan(tensors, norm_type, replication, canonical, count_zeros)


def launch(kernel: Any, plan: _Plan) -> torch.Tensor:
    """One launch of ``kernel`` (``load_kernel()``) over ``plan`` on the current stream; returns
    the float64 contribution."""
    return _launch(kernel, plan)


def programs_per_sm(kernel_key: tuple) -> int | None:
    """The programs per SM a variant's grid is sized by: learned at its first launch (None
    before)."""
    return _programs_per_sm.get(kernel_key)


def set_programs_per_sm(kernel_key: tuple, programs: int) -> None:
    """Size the grids of the variant ``kernel_key`` by ``programs`` per SM from now on."""
    _programs_per_sm[kernel_key] = programs
