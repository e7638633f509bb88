"""Triton step for fused Adam/AdamW groups on CUDA (``OptimizerConfig(triton_adam_step=True)``).

``TritonAdam.step`` runs ``_fused_adam(w)_``'s arithmetic with the clip divisor read from device
memory and applied inside the update (grads not written: 28 bytes per fp32 element), the step
counters advanced by the kernel, and ``found_inf`` gating it (device-side skips, the deferred
verdict of ``stats._reduce``). ``AdamTable`` is its persistent argument table, kept by the fast
step's per-group cache (``_infra.device_table``). Not bit-identical to torch's kernel (float32
rounding); which groups it takes and why: docs/concepts.md, "The Triton Adam step".
"""

from __future__ import annotations

from contextlib import nullcontext
from operator import is_ as _is
from typing import Any

import torch

from ..._infra.device_table import DeviceTable, addresses, check_all_lists, same_addresses
from ..._infra.kernels import device_helpers, element_offsets, sm_count_of
from ._fast_step import advance_steps

__all__ = ["AdamTable", "TritonAdam", "launch_tuning", "set_launch_tuning"]

# from benchmarks/bench_triton_adam.py --sweep on an H200 (benchmarks/RESULTS.md): 2048 x 8 warps
# was within noise of the best on both shape sets and steady across programs per SM
_BLOCK = 2048
_NUM_WARPS = 8
_PROGRAMS_PER_SM = 16
# Without a kept table (no holder), below this mean number of elements per tensor the host work
# of building the table (about 1 us per tensor on the device machine's host) outweighs the grad
# store the kernel saves (about 1 ns per 1000 fp32 elements at 4 TB/s): torch's kernel runs.
# A kept table has no limit (module docstring).
_MIN_MEAN_NUMEL = 1 << 20
_REDUCE_BLOCK = 1024


def launch_tuning() -> tuple[int, int, int, int]:
    """``(BLOCK, num_warps, programs per SM, min mean numel)`` of the launches: the values above,
    read at each launch (``benchmarks/bench_triton_adam.py`` sweeps them)."""
    return _BLOCK, _NUM_WARPS, _PROGRAMS_PER_SM, _MIN_MEAN_NUMEL


def set_launch_tuning(
    block: int, num_warps: int, programs_per_sm: int, min_mean_numel: int
) -> None:
    """Set what ``launch_tuning`` returns, for the launches that follow (benchmarks only)."""
    global _BLOCK, _NUM_WARPS, _PROGRAMS_PER_SM, _MIN_MEAN_NUMEL
    _BLOCK, _NUM_WARPS, _PROGRAMS_PER_SM = block, num_warps, programs_per_sm
    _MIN_MEAN_NUMEL = min_mean_numel


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_state: dict[str, Any] = {"kernel": None, "failed": False}


def _give_up(exc: Exception) -> None:
    """The kernel failed to compile or launch (a Triton, driver or ptxas this package was not
    tested with): warn once and leave every later step of this process to torch's kernel. A
    launch that raises has enqueued nothing, so the caller's fallback takes the whole step. No
    collective is involved, so a rank that falls back alone cannot hang the others; its update
    then rounds as torch's does (the ranks' params may differ in float32's last bits)."""
    import warnings

    _state["failed"] = True
    warnings.warn(
        f"mfsdp_optim: the Triton Adam/AdamW kernel failed on this device ({type(exc).__name__}: "
        f"{exc}); torch's fused kernel steps these groups from now on. Pass "
        "OptimizerConfig(triton_adam_step=False) to use torch's kernel from the start.",
        RuntimeWarning,
        stacklevel=5,
    )


def _load() -> Any | None:
    if _state["failed"]:
        return None
    if _state["kernel"] is None:
        try:
            import numpy  # noqa: F401  (host tables)
            import triton  # noqa: F401

            _state["kernel"] = _build()
        except Exception:
            _state["failed"] = True
            return None
    return _state["kernel"]


def _build() -> Any:
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except ImportError:  # older layouts
        from triton.language.extra.cuda import libdevice  # type: ignore[no-redef]

    first_tensor = device_helpers()["first_tensor"]

    @triton.jit
    def tensor_scalars(
        t, numels, s_base, soffs_ptr, sidx, poffs, goffs, moffs, voffs, lr64, b1, b2
    ):
        # what the update of tensor t needs beside its elements
        numel = tl.load(numels + t)
        step = tl.load(s_base + tl.load(soffs_ptr + tl.load(sidx + t))) + 1.0
        bc1 = (1.0 - libdevice.pow(b1, step.to(tl.float64))).to(tl.float32)
        step_size = (lr64 / bc1.to(tl.float64)).to(tl.float32)
        bc2 = (1.0 - libdevice.pow(b2, step.to(tl.float64))).to(tl.float32)
        bc2_sqrt = libdevice.sqrt_rn(bc2)
        p0 = tl.load(poffs + t)
        g0 = tl.load(goffs + t)
        m0 = tl.load(moffs + t)
        v0 = tl.load(voffs + t)
        return numel, step_size, bc2_sqrt, p0, g0, m0, v0

    @triton.jit
    def update_block(
        p_ptrs, g_ptrs, m_ptrs, v_ptrs, mask, divisor, step_size, bc2_sqrt, b1f, b2f, omb1,
        omb2, decay, wd32, eps32, FULL: tl.constexpr, HAS_DIVISOR: tl.constexpr,
        ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr,
    ):  # fmt: skip
        # one block of elements of one tensor (FULL: every lane in it, ``mask`` not read)
        if FULL:
            p = tl.load(p_ptrs).to(tl.float32)
            g = tl.load(g_ptrs).to(tl.float32)
            m = tl.load(m_ptrs).to(tl.float32)
            v = tl.load(v_ptrs).to(tl.float32)
        else:
            p = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptrs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptrs, mask=mask, other=0.0).to(tl.float32)
        # elementwise math in float32 (float64 per element would make the kernel
        # conversion-bound); divisions and square roots IEEE-rounded
        if HAS_DIVISOR:
            g = libdevice.div_rn(g, divisor)
        if MAXIMIZE:
            g = -g
        if ADAMW:
            p = p - decay * p
        else:
            g = g + p * wd32
        m = b1f * m + omb1 * g
        v = b2f * v + omb2 * g * g
        denom = libdevice.div_rn(libdevice.sqrt_rn(v), bc2_sqrt) + eps32
        p = p - libdevice.div_rn(step_size * m, denom)
        if FULL:
            tl.store(p_ptrs, p.to(p_ptrs.dtype.element_ty))
            tl.store(m_ptrs, m.to(m_ptrs.dtype.element_ty))
            tl.store(v_ptrs, v.to(v_ptrs.dtype.element_ty))
        else:
            tl.store(p_ptrs, p.to(p_ptrs.dtype.element_ty), mask=mask)
            tl.store(m_ptrs, m.to(m_ptrs.dtype.element_ty), mask=mask)
            tl.store(v_ptrs, v.to(v_ptrs.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["n", "n_steps", "total_items", "items_per_prog", "num_progs"])
    def _adam_kernel(
        p_base,
        g_base,
        m_base,
        v_base,
        s_base,
        table_ptr,
        goffs_ptr,
        soffs_ptr,
        hp_ptr,
        n,
        n_steps,
        total_items,
        items_per_prog,
        num_progs,
        divisor_ptr,
        gate_ptr,
        ticket_ptr,
        HAS_DIVISOR: tl.constexpr,
        HAS_GATE: tl.constexpr,
        ADAMW: tl.constexpr,
        MAXIMIZE: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGN: tl.constexpr,
        REDUCE_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        begin = pid.to(tl.int64) * items_per_prog
        end = tl.minimum(begin + items_per_prog, total_items)
        if HAS_GATE:  # found_inf: a skipped update touches nothing and leaves the counters
            skipped = tl.load(gate_ptr) != 0.0
            end = tl.where(skipped, begin, end)
            advance = tl.where(skipped, 0.0, 1.0)
        else:
            advance = 1.0
        # table: [p offs | m offs | v offs | step index | numel | cum items (n + 1)]
        poffs = table_ptr
        moffs = table_ptr + n
        voffs = table_ptr + 2 * n
        sidx = table_ptr + 3 * n
        numels = table_ptr + 4 * n
        cum = table_ptr + 5 * n

        lr64 = tl.load(hp_ptr).to(tl.float64, bitcast=True)
        b1 = tl.load(hp_ptr + 1).to(tl.float64, bitcast=True)
        b2 = tl.load(hp_ptr + 2).to(tl.float64, bitcast=True)
        eps64 = tl.load(hp_ptr + 3).to(tl.float64, bitcast=True)
        wd = tl.load(hp_ptr + 4).to(tl.float64, bitcast=True)
        # float32 copies of the hyperparameters for the elementwise math (the scalar products
        # taken in float64 first, as the fused kernel takes them)
        b1f = b1.to(tl.float32)
        b2f = b2.to(tl.float32)
        omb1 = (1.0 - b1).to(tl.float32)
        omb2 = (1.0 - b2).to(tl.float32)
        decay = (lr64 * wd).to(tl.float32)
        wd32 = wd.to(tl.float32)
        eps32 = eps64.to(tl.float32)
        if HAS_DIVISOR:  # noqa: SIM108 (a Triton kernel: a constexpr branch)
            divisor = tl.load(divisor_ptr)
        else:
            divisor = 1.0  # not read
        lanes = tl.arange(0, BLOCK)

        # per tensor, computed where a program's run of items enters it (not per item: the
        # two float64 pows cost each of the program's threads hundreds of float64
        # instructions): the bias corrections as the fused kernel takes them (float64 pow,
        # kept as float32), the numel and the offsets of the tensor's first element
        t = first_tensor(cum, n, begin)
        seg_first = tl.load(cum + t)
        seg_end = tl.load(cum + t + 1)
        numel, step_size, bc2_sqrt, p0, g0, m0, v0 = tensor_scalars(
            t, numels, s_base, soffs_ptr, sidx, poffs, goffs_ptr, moffs, voffs, lr64, b1, b2
        )

        for it in range(begin, end):
            if it >= seg_end:
                t = t + 1
                seg_first = seg_end
                seg_end = tl.load(cum + t + 1)
                numel, step_size, bc2_sqrt, p0, g0, m0, v0 = tensor_scalars(
                    t, numels, s_base, soffs_ptr, sidx, poffs, goffs_ptr, moffs, voffs, lr64, b1, b2
                )
            e0 = (it - seg_first) * BLOCK
            po = p0 + e0
            go = g0 + e0
            mo = m0 + e0
            vo = v0 + e0
            if ALIGN > 1:
                po = tl.multiple_of(po, ALIGN)
                go = tl.multiple_of(go, ALIGN)
                mo = tl.multiple_of(mo, ALIGN)
                vo = tl.multiple_of(vo, ALIGN)
            # whole blocks unmasked (a mask over a runtime numel keeps Triton from vectorising
            # the loads and stores), the tensor's last partial block masked
            if e0 + BLOCK <= numel:
                update_block(
                    p_base + po + lanes, g_base + go + lanes, m_base + mo + lanes,
                    v_base + vo + lanes, lanes, divisor, step_size, bc2_sqrt, b1f, b2f, omb1,
                    omb2, decay, wd32, eps32, True, HAS_DIVISOR, ADAMW, MAXIMIZE,
                )  # fmt: skip
            else:
                update_block(
                    p_base + po + lanes, g_base + go + lanes, m_base + mo + lanes,
                    v_base + vo + lanes, (e0 + lanes) < numel, divisor, step_size, bc2_sqrt,
                    b1f, b2f, omb1, omb2, decay, wd32, eps32, False, HAS_DIVISOR, ADAMW,
                    MAXIMIZE,
                )  # fmt: skip

        # the last program to finish advances every step counter (nobody reads them after it),
        # by 0 where found_inf skipped the update
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == num_progs - 1:
            r = tl.arange(0, REDUCE_BLOCK)
            for s0 in range(0, n_steps, REDUCE_BLOCK):
                mk = (s0 + r) < n_steps
                so = tl.load(soffs_ptr + s0 + r, mask=mk, other=0)
                cur = tl.load(s_base + so, mask=mk, other=0.0, cache_modifier=".cg")
                tl.store(s_base + so, cur + advance, mask=mk)
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")

    globals().update(
        tl=tl,
        libdevice=libdevice,
        first_tensor=first_tensor,
        tensor_scalars=tensor_scalars,
        update_block=update_block,
    )
    return _adam_kernel


def _offsets(tensors: list[torch.Tensor]) -> tuple[Any, bool] | None:
    """``element_offsets`` of the tensors' addresses: element offsets from the first
    tensor and whether all are 16-byte aligned, or None."""
    import numpy as np

    ptrs = np.fromiter(map(torch.Tensor.data_ptr, tensors), dtype=np.int64, count=len(tensors))
    return element_offsets(ptrs, tensors[0].element_size())


def _hparams(group: dict) -> Any:
    """The group's hyperparameters as float64 bit patterns (int64)."""
    import numpy as np

    beta1, beta2 = group["betas"]
    values = [group["lr"], beta1, beta2, group["eps"], group["weight_decay"]]
    return np.array(values, dtype=np.float64).view(np.int64)


class AdamTable:
    """The launch table of one group's lists, and what decides whether it still fits them.

    Layout (int64): ``[p | m | v | step index | numel | cum (n + 1) | grad offs (n) | step offs
    | hparams (5)]`` over the ``n`` non-empty params (``keep``); offsets in elements from each
    list's first kept tensor (the step offsets from ``steps[0]``). ``build`` returns None when
    the kernel cannot address the static lists (an offset that is not a whole element).

    It holds the static lists and the storages of their tensors (why: docs/concepts.md, "Kernel
    argument tables"); of the grads it keeps only their addresses. The device copy is made by
    the first ``refresh_grads`` (the grad offsets complete it).
    """

    __slots__ = (
        "lists", "storages", "keep", "n", "n_steps", "gptrs", "static_ptrs", "static_aligned",
        "grads_aligned", "total_items", "stream", "host", "table", "goff_at", "hp_at",
    )  # fmt: skip

    lists: tuple[list[torch.Tensor], ...]
    storages: list[Any]
    keep: list[int]
    n: int
    n_steps: int
    gptrs: list[int]
    static_ptrs: list[list[int]]
    static_aligned: bool
    grads_aligned: bool
    total_items: int
    stream: int
    host: Any
    table: DeviceTable | None
    goff_at: int
    hp_at: int

    def __init__(self) -> None:
        self.gptrs = []
        self.grads_aligned = True
        self.static_aligned = True
        self.host = None
        self.table = None
        self.total_items = 0
        self.goff_at = self.hp_at = 0

    @classmethod
    def build(
        cls,
        params: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
        group: dict,
        stream: int,
    ) -> AdamTable | None:
        """The table of these lists, grad offsets still zero (CPU tensors work too: for tests
        of the table logic)."""
        import numpy as np

        numels = np.fromiter(map(torch.Tensor.numel, params), dtype=np.int64, count=len(params))
        keep = np.flatnonzero(numels).tolist()
        self = cls()
        self.lists = (params, exp_avgs, exp_avg_sqs, steps)
        self.storages = [t.untyped_storage() for xs in self.lists for t in xs]
        self.keep = keep
        self.n, self.n_steps, self.stream = len(keep), len(steps), stream
        self.static_ptrs = [addresses(xs) for xs in self.lists]
        if not keep:  # only empty shards: no launch, no table
            return self
        parts, aligned = [], True
        for xs in (params, exp_avgs, exp_avg_sqs):
            r = _offsets([xs[i] for i in keep])
            if r is None:
                return None
            parts.append(r[0])
            aligned &= r[1]
        s_offs = _offsets(steps)
        if s_offs is None:
            return None
        n = self.n
        cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum((numels[keep] + (_BLOCK - 1)) // _BLOCK, out=cum[1:])
        kept = np.asarray(keep, dtype=np.int64)
        goffs = np.zeros(n, dtype=np.int64)  # filled by refresh_grads
        self.host = np.concatenate(
            [*parts, kept, numels[keep], cum, goffs, s_offs[0], _hparams(group)]
        )
        self.static_aligned = aligned
        self.total_items = int(cum[-1])
        self.goff_at, self.hp_at = 6 * n + 1, 7 * n + 1 + len(steps)
        return self

    def fits(self, params: list, exp_avgs: list, exp_avg_sqs: list, steps: list) -> bool:
        """The same list objects (with ``MFSDP_OPTIM_CHECK_ALL_ADDRESSES``: at the same
        addresses too)."""
        if not all(map(_is, self.lists, (params, exp_avgs, exp_avg_sqs, steps))):
            return False
        if check_all_lists():
            pairs = zip(self.lists, self.static_ptrs, strict=True)
            return all(same_addresses(xs, ptrs) for xs, ptrs in pairs)
        return True

    def refresh_grads(self, grads: list[torch.Tensor]) -> bool:
        """Point the table at ``grads``: their offsets are re-uploaded only if an address
        moved; False when the kernel cannot address them (the table is then left as it was)."""
        table = self.table
        if (
            table is not None
            and len(grads) == len(self.gptrs)
            and same_addresses(grads, self.gptrs, self.keep)
        ):
            return True
        r = _offsets([grads[i] for i in self.keep])
        if r is None:
            return False
        self.gptrs = addresses(grads)
        self.grads_aligned = r[1]
        if table is None:
            self.host[self.goff_at : self.goff_at + self.n] = r[0]
            self.table = DeviceTable(self.host, self.lists[0][0].device)
        else:
            table.patch(self.goff_at, r[0])
        return True

    def refresh_hparams(self, group: dict) -> None:
        """Re-upload the hyperparameters if one changed (an lr schedule: every step)."""
        assert self.table is not None
        self.table.patch(self.hp_at, _hparams(group))

    def ready_for(self, grads: list[torch.Tensor], group: dict) -> bool:
        """The device copy already holds these grads' offsets and the group's hyperparameters:
        a launch needs no upload (what a CUDA graph capture requires)."""
        return (
            self.table is not None
            and len(grads) == len(self.gptrs)
            and same_addresses(grads, self.gptrs, self.keep)
            and bool((self.host[self.hp_at :] == _hparams(group)).all())
        )

    def align(self, esize: int) -> int:
        """The ``ALIGN`` constant: 16 bytes in elements when every tensor is 16-byte aligned."""
        return 16 // esize if self.static_aligned and self.grads_aligned else 1


# a holder's table slot when its static lists cannot be taken (so the build is not retried)
_DECLINED: Any = object()


def _stream_of(device: torch.device) -> int:
    """The current stream's handle (0 on CPU: tests of the table logic)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _static_contiguous(*lists: list[torch.Tensor]) -> bool:
    contiguous = torch.Tensor.is_contiguous
    return all(all(map(contiguous, xs)) for xs in lists)


def _grads_ok(grads: list[torch.Tensor], dtype: torch.dtype, vouched: torch.dtype | None) -> bool:
    """Per-step conditions on the grads (they may be new tensors at every step): contiguous and
    of the params' dtype (``vouched``: the caller's word for the dtype of all of them)."""
    if not all(map(torch.Tensor.is_contiguous, grads)):
        return False
    if vouched is not None:
        return vouched == dtype
    return {g.dtype for g in grads} <= {dtype}


class TritonAdam:
    """The kernel's host side. A call with a ``holder`` (the fast step's per-group cache) keeps its
    table there, checks the grads' addresses at each step and re-uploads only what moved
    (``AdamTable``, ``_infra.device_table``); a call without one builds a table for that call."""

    def __init__(self) -> None:
        self._tickets: dict[int, torch.Tensor] = {}
        self.launches = 0  # for tests and diagnostics
        self.builds = 0  # tables built (for tests)

    def kept_tensors(self) -> list[torch.Tensor]:
        """The device tensors the step's launches write besides their tables (one per device):
        what a captured step keeps alive while its graph lives."""
        return list(self._tickets.values())

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available() and torch.version.cuda is not None and _load() is not None

    @staticmethod
    def eligible(group: dict, params: list[torch.Tensor]) -> bool:
        """Group-level conditions (tensor-level ones are checked at each step)."""
        return (
            not group.get("amsgrad")
            and not torch.is_tensor(group["lr"])
            and not any(torch.is_tensor(b) for b in group["betas"])
            and bool(params)
            and params[0].device.type == "cuda"
            and params[0].dtype in _DTYPES
        )

    def step(
        self,
        group: dict,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
        divisor: torch.Tensor | None,
        holder: Any = None,
        grad_dtype: torch.dtype | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> bool:
        """``_fused_adam(w)_`` for one group with the grads divided by ``divisor`` inside the
        update; False (nothing done) when the kernel does not apply.

        ``holder``: an object with a ``triton_table`` attribute that lives exactly as long as
        these very lists (the fast step's ``_GroupCache``); the table is kept there.
        ``grad_dtype``: the caller's word that every grad has this dtype (else checked).
        ``found_inf``: a float32 0/1 tensor on the params' device, read by the kernel: where it
        is 1 the update is skipped and the step counters stay (torch's ``found_inf``).

        Under CUDA graph capture it launches only with a holder's table that needs no upload
        (built and pointed at these grads by an eager step on the capturing stream): the graph
        then reads the table, whose hyperparameters the caller refreshes before each replay."""
        if not self.eligible(group, params) or torch.compiler.is_compiling():
            return False  # eligible first: CPU groups never import Triton
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and (holder is None or params[0].device.index not in self._tickets):
            return False
        kernel = _load()  # None without Triton or numpy
        if kernel is None:
            return False
        if holder is None:
            tab = self._one_off(group, params, grads, exp_avgs, exp_avg_sqs, steps, grad_dtype)
        else:
            tab = self._kept(
                holder, group, params, grads, exp_avgs, exp_avg_sqs, steps, grad_dtype, capturing
            )
        if tab is None:
            return False
        if tab.n == 0:  # only empty shards: nothing to update but the counters
            advance_steps(steps, found_inf)
            return True
        return self._launch(kernel, tab, grads, group, divisor, found_inf)

    def _one_off(
        self, group, params, grads, exp_avgs, exp_avg_sqs, steps, grad_dtype
    ) -> AdamTable | None:
        """A table for this call only (no holder): below ``_MIN_MEAN_NUMEL`` elements per
        tensor its host cost outweighs the kernel's gain, so torch's kernel runs."""
        import numpy as np

        # the size test first: it declines many-small-tensor groups every step, cheaply
        numels = np.fromiter(map(torch.Tensor.numel, params), dtype=np.int64, count=len(params))
        if int(numels.sum()) < _MIN_MEAN_NUMEL * len(params):
            return None
        if not _static_contiguous(params, exp_avgs, exp_avg_sqs):
            return None
        if not _grads_ok(grads, params[0].dtype, grad_dtype):
            return None
        stream = _stream_of(params[0].device)
        tab = AdamTable.build(params, exp_avgs, exp_avg_sqs, steps, group, stream)
        self.builds += 1
        if tab is None or (tab.n and not tab.refresh_grads(grads)):
            return None
        return tab

    def _kept(
        self, holder, group, params, grads, exp_avgs, exp_avg_sqs, steps, grad_dtype, frozen=False
    ) -> AdamTable | None:
        """The holder's table: rebuilt when it does not fit the lists, refreshed for this
        step's grads and hyperparameters. No size limit (the rule in the module docstring).
        ``frozen`` (a capture): only a table that needs neither a build nor an upload."""
        stream = _stream_of(params[0].device)
        tab = holder.triton_table
        if tab is _DECLINED:  # these lists cannot be taken, for as long as they live
            return None
        if (
            tab is None
            or tab.stream != stream
            or not tab.fits(params, exp_avgs, exp_avg_sqs, steps)
        ):
            if frozen:
                return None
            tab = None
            if _static_contiguous(params, exp_avgs, exp_avg_sqs):
                tab = AdamTable.build(params, exp_avgs, exp_avg_sqs, steps, group, stream)
                self.builds += 1
            holder.triton_table = tab if tab is not None else _DECLINED
            if tab is None:
                return None
        if not _grads_ok(grads, params[0].dtype, grad_dtype):
            return None
        if tab.n and frozen:
            return tab if tab.ready_for(grads, group) else None
        if tab.n:
            if not tab.refresh_grads(grads):
                return None
            tab.refresh_hparams(group)
        return tab

    def _launch(
        self,
        kernel: Any,
        tab: AdamTable,
        grads: list,
        group: dict,
        divisor: Any,
        found_inf: Any = None,
    ) -> bool:
        """One launch over the table; False when the kernel cannot be built or launched here
        (``_give_up``: nothing was enqueued, so torch's kernel takes this step and the next)."""
        params, exp_avgs, exp_avg_sqs, steps = tab.lists
        assert tab.table is not None
        first = tab.keep[0]
        p0 = params[first]
        device = p0.device
        dev_table = tab.table.tensor
        n = tab.n
        total_items = tab.total_items
        sms = sm_count_of(device) if device.type == "cuda" else 1  # CPU: Triton's interpreter
        per_prog = -(-total_items // min(total_items, sms * _PROGRAMS_PER_SM))
        num_progs = -(-total_items // per_prog)
        ticket = self._tickets.get(device.index)  # type: ignore[arg-type]
        if ticket is None:
            ticket = self._tickets[device.index] = torch.zeros(  # type: ignore[index]
                1, dtype=torch.int32, device=device
            )
        if divisor is not None:
            divisor = divisor.to(device=device, dtype=torch.float32, non_blocking=True)
        goffs = dev_table[tab.goff_at : tab.goff_at + n]
        soffs = dev_table[tab.goff_at + n : tab.hp_at]
        hparams = dev_table[tab.hp_at :]
        align = tab.align(p0.element_size())
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            try:
                kernel[(num_progs,)](
                    p0,
                    grads[first],
                    exp_avgs[first],
                    exp_avg_sqs[first],
                    steps[0],
                    dev_table,
                    goffs,
                    soffs,
                    hparams,
                    n,
                    tab.n_steps,
                    total_items,
                    per_prog,
                    num_progs,
                    divisor if divisor is not None else steps[0],
                    found_inf if found_inf is not None else steps[0],
                    ticket,
                    HAS_DIVISOR=divisor is not None,
                    HAS_GATE=found_inf is not None,
                    ADAMW=bool(group["decoupled_weight_decay"]),
                    MAXIMIZE=bool(group["maximize"]),
                    BLOCK=_BLOCK,
                    ALIGN=align,
                    REDUCE_BLOCK=_REDUCE_BLOCK,
                    num_warps=_NUM_WARPS,
                )
            except Exception as exc:  # noqa: BLE001  (a Triton that cannot build it here)
                _give_up(exc)
                return False
        self.launches += 1
        return True
