"""The wrapper's captured step (``OptimizerConfig(cuda_graph=True)``).

``CapturedStep.run(body)`` is ``step()`` in that mode: it mirrors each group's lr in device
memory, asks ``_graph.StepGraph`` what to do with this step, then

* replays: the Triton tables' hyperparameters refreshed (uploaded only if one changed), the
  graph launched, the host-side effects of a step applied (stage, counters) and the returned
  tensors cloned (a replay rewrites the graph's own);
* captures: one eager step on the graph's side stream (this call's update), the checks that
  it can be captured (``blocker``: if not, the next step tries again, then it runs eagerly),
  then the capture itself (nothing runs);
* or runs the body eagerly.

``inputs()`` lists what a capture reads (checked before every replay): the params, their grads
and both kinds of local tensor (O(params): identity and addresses, in chunks that stay in the
CPU cache), Muon's momentum buffers' local tensors, the optimizer's state mapping, groups and the
hyperparameters baked into the graph (Muon's lr among them), the fast step's caches and Triton
tables, Muon's whole-param plan, the scaler's device tensors and the config. Construction
refuses what can never be captured (``check_setup``).
Why and what a training loop must do: docs/concepts.md, "The captured step".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter
from operator import is_ as _is
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..._infra.comm import collective_device
from ..._infra.device_table import addresses, check_all_lists, same_addresses
from .._agreed import AgreedSlots
from .._config import OptimizerConfig
from .._engines._engine import Engine, frozen_values
from .._engines._route import route_of
from .._engines._triton_adam import AdamTable
from .._grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler
from .._kinds._kind_of import WHOLE_PARAM
from ._graph import Counters, CudaGraphRunner, EagerRunner, Inputs, ScalarSlots, StepGraph

__all__ = ["CapturedStep", "check_setup"]

_grad_of = attrgetter("grad")
_local_of = attrgetter("_local_tensor")
_LR_DTYPE = torch.float32  # torch's fused Adam kernels read a tensor lr as float32
_SCALERS = (type(None), ConstantGradScaler, DynamicGradScaler)


class Wrapper(Protocol):
    """What the captured step reads of the wrapper itself, each time (a test may replace
    them): its public ``config`` and ``grad_scaler``."""

    config: OptimizerConfig
    grad_scaler: GradScaler | None


def _state_locals(e: Any, params: list[Any]) -> list[Any]:
    """The local tensors of the momentum buffers a captured Muon step writes (O(params));
    empty for other engines (the fast step's state is in its own caches)."""
    if e.kind != WHOLE_PARAM:
        return []
    state = e.optimizer.state
    out = []
    for p in params:
        buf = state.get(p, {}).get("momentum_buffer")
        out.append(getattr(buf, "_local_tensor", buf))
    return out


def _whole_blocker(e: Any, name: str) -> str | None:
    """Why a whole-param engine's step just run cannot be captured, or None: only Muon's step
    that kept its plan on the device can (its exchanges' sizes come from that plan alone)."""
    opt = e.optimizer
    if not e.whole_on_device():
        return f"{name} takes the generic whole-param update (its class's own step() runs)"
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or "step" in vars(opt):
        return f"{name} has step hooks or a patched step() (a replay would not run them)"
    if e.preparer.plan is None:
        return f"grads of {name} need a dtype cast, or some of its params have no grad"
    if not e.whole_steady():
        return f"{name} built its whole-param plan at this step (the next step can be captured)"
    for gi, g in enumerate(opt.param_groups):
        if frozen_values(g) is None:
            return f"param group {gi} of {name} holds a tensor or list hyperparameter"
    return None


def check_setup(engines: list[Engine], config: OptimizerConfig) -> torch.device:
    """The one CUDA device every param lives on; ValueError for a setup that cannot be
    captured at all (params off CUDA or on several devices, a grad-stats group whose
    collectives run on the host)."""
    device = None
    for e in engines:
        for s in e.table.slots:
            d = s.param._local_tensor.device
            if d.type != "cuda" or (device is not None and d != device):
                where = "on the CPU" if d.type != "cuda" else f"on {d} while others are on {device}"
                raise ValueError(
                    f"OptimizerConfig(cuda_graph=True) captures the step on one CUDA device, but "
                    f"param {s.fqn!r} is {where}. Keep every param on one CUDA device, or pass "
                    "cuda_graph=False."
                )
            device = d
    if device is None:
        raise ValueError("OptimizerConfig(cuda_graph=True): the optimizer holds no params")
    group = config.grad_stats_group
    if collective_device(group).type != "cuda":
        raise ValueError(
            "OptimizerConfig(cuda_graph=True) captures the grad-stats collective, but the "
            f"grad-stats group's backend ({dist.get_backend(group)!r}) runs it on the host, "
            "which a CUDA graph cannot capture. Use an NCCL group (init_process_group('nccl'), "
            "also for a single process), or pass cuda_graph=False."
        )
    return device


# params per chunk of the pre-replay check: what its passes read of one chunk (about 10 cache
# lines a param: the param, its autograd metadata, the grad, the local tensors and their
# storages) stays in a core's L2 cache from one pass to the next
_CHUNK = 1024


def _chunks(lists: list[list[Any]], grad_ptrs: list[int]) -> list[tuple[Any, ...]]:
    """The captured ``[params, grads, grad_locals, locals_]`` of one engine and the grads' local
    addresses, cut into chunks of ``_CHUNK`` params for ``_unmoved``."""
    params, grads, grad_locals, locals_ = lists
    out = []
    for i in range(0, len(params), _CHUNK):
        j = i + _CHUNK
        out.append(
            (
                params[i:j],
                grads[i:j],
                grads[i:j] + params[i:j],  # whose _local_tensor the second pass reads
                grad_locals[i:j] + locals_[i:j],
                grad_locals[i:j],
                grad_ptrs[i:j],
            )
        )
    return out


def _unmoved(chunks: list[tuple[Any, ...]]) -> bool:
    """Whether every param's ``.grad`` is the captured grad, that grad's and the param's
    ``_local_tensor`` are the captured local tensors (the same objects: same shape and
    strides too) and the grads' local tensors still start at the captured addresses (not
    moved in place by ``set_``, ``.data =`` or ``torch.utils.swap_tensors``).

    Three C-level passes per chunk of ``_chunks``, no Python code per param: a pass over
    thousands of params has several params' cache misses in flight at once (each read is a
    chain of dependent pointers), and the chunk's objects are still in the cache for the next
    pass. One Python loop reading a param's objects together measured faster where they are in
    the cache (about 10% at 3,000 params), slower where they are not (tens of thousands:
    its misses come one at a time). The caller disables torch functions of subclasses
    (``.grad``)."""
    for params, grads, owners, locals_, grad_locals, grad_ptrs in chunks:
        if not (
            all(map(_is, map(_grad_of, params), grads))
            and all(map(_is, map(_local_of, owners), locals_))
            and same_addresses(grad_locals, grad_ptrs)
        ):
            return False
    return True


class CapturedStep:
    """``step()`` of a wrapper with ``cuda_graph=True`` (see the module docstring).

    Args:
        wrapper: The wrapper (its ``config`` and ``grad_scaler``, read at each step).
        engines: The wrapper's engines (its list, not a copy).
        agreement: The wrapper's hyperparameter digests (the stats row's agreed slots).
        stage_of: The wrapper's stage now; ``set_stage``: set it (a replay leaves the stage the
            captured step left).
        runner: Tests only: an ``_graph.EagerRunner`` (CPU params, any group) instead of
            ``check_setup`` and a CUDA graph.
    """

    def __init__(
        self,
        wrapper: Wrapper,
        engines: list[Engine],
        agreement: AgreedSlots,
        *,
        stage_of: Callable[[], Any],
        set_stage: Callable[[Any], None],
        runner: Any = None,
    ):
        self.wrapper = wrapper
        self.engines = engines
        self.agreement = agreement
        self._stage_of, self._set_stage = stage_of, set_stage
        if runner is None:
            self.device = check_setup(engines, wrapper.config)
            runner = CudaGraphRunner(self.device)
        else:
            self.device = engines[0].table.slots[0].param._local_tensor.device
        self.graph = StepGraph(runner)
        fields: list[tuple[Any, str]] = []
        for e in engines:
            fields += [(e, "fast_steps"), (e, "clip_folds"), (e.preparer, "replays")]
            if e.triton is not None:
                fields.append((e.triton, "launches"))
        self.counters = Counters(fields)
        self.after: Any = None  # the stage a captured step leaves

    # ----------------------------------------------------------------------------- the step

    def run(self, body: Any) -> Any:
        """One ``step()`` (after its closure and stage checks): replay, capture or eager."""
        if not self._update_lr():
            return body()  # an lr that is not a finite number >= 0: the eager check refuses it
        # the hyperparameter digest a replay's stats row reads, uploaded if a value changed
        self.agreement.refresh(self.wrapper.config.grad_stats_group)
        graph = self.graph
        action = graph.plan(self.still_valid)
        if action == "replay":
            self._refresh_tables()
            out = graph.replay()
            if not isinstance(graph.runner, EagerRunner):  # (that one ran the body itself)
                self._replayed()
            return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
        if action == "eager":
            return body()
        return self._capture(body)

    def _capture(self, body: Any) -> Any:
        graph = self.graph
        fast_before = [e.fast_steps for e in self.engines]
        out = graph.runner.warm(body)  # this call's step, eagerly, where the capture will run
        reason = self.blocker(fast_before)
        if reason is not None:
            graph.blocked(reason)
            return out
        before = self.inputs()
        self.counters.begin()
        for e in self.engines:
            e.fast.capturing = True
        try:
            graph.runner.capture(body)
        except Exception as exc:  # noqa: BLE001  (whatever failed, the step is done: go eager)
            self.counters.undo()
            graph.disable(f"its capture failed ({type(exc).__name__}: {exc})")
            return out
        finally:
            for e in self.engines:
                e.fast.capturing = False
        self.counters.end()
        after = self.inputs()
        if not before.same(after):
            graph.disable("a cache was rebuilt while the step was captured")
            return out
        self.after = self._stage_of()
        graph.captured_with(after, self._keep_alive())
        return out

    # ------------------------------------------------------------------------ the bookkeeping

    def _replayed(self) -> None:
        """The host-side effects of the step a replay ran: the stage, the counters, and the
        scaler's word that its device copy moved on (what its device update says when it runs
        eagerly: the host fields are stale, copies on other devices too). ``step()`` records
        the returned values as the last step."""
        self.counters.replayed()
        self._set_stage(self.after)
        scaler = self.wrapper.grad_scaler
        if scaler is not None:
            scaler.replayed_on(self.device)

    def _update_lr(self) -> bool:
        """Each group's lr into its device slot (an upload only when one changed). False, and
        nothing uploaded, when an lr is not a float or int in [0, inf) (a replay skips the
        eager step's hyperparameter checks: that step refuses it, nothing updated)."""
        for e in self.engines:
            lrs = [g["lr"] for g in e.optimizer.param_groups]
            if not all(type(v) in (float, int) and 0 <= v < math.inf for v in lrs):
                if any(map(torch.is_tensor, lrs)):  # not captured (blocker): the Python path
                    e.fast.lr_slots = None
                    continue
                return False
            if e.kind == WHOLE_PARAM:  # Muon takes its lr as a number: baked (inputs())
                continue
            slots = e.fast.lr_slots
            if slots is None or len(slots) != len(lrs):
                e.fast.lr_slots = ScalarSlots(lrs, self.device, _LR_DTYPE)
            else:
                slots.update(lrs)
        return True

    def _refresh_tables(self) -> None:
        """The Triton tables' hyperparameters (the lr of a schedule), uploaded if changed."""
        for e in self.engines:
            for gc in e.fast.groups() or ():
                tab = gc.triton_table
                if isinstance(tab, AdamTable) and tab.table is not None:
                    tab.refresh_hparams(gc.group)

    def blocker(self, fast_before: list[int] | None = None) -> str | None:
        """Why the step just run cannot be captured, or None. ``fast_before``: each engine's
        ``fast_steps`` before it (each must have taken the fast step)."""
        w = self.wrapper
        scaler = w.grad_scaler
        if type(scaler) not in _SCALERS:
            return (
                f"a {type(scaler).__name__} is used (only ConstantGradScaler and "
                "DynamicGradScaler update on the device)"
            )
        for i, e in enumerate(self.engines):
            opt = e.optimizer
            name = e.name or type(opt).__name__
            if e.kind == WHOLE_PARAM:
                reason = _whole_blocker(e, name)
                if reason is not None:
                    return reason
                continue
            groups = e.fast.groups()
            stepped = fast_before is None or e.fast_steps == fast_before[i] + 1
            if not e.route.fast or groups is None or not stepped:
                return (
                    f"{name} is not stepped by the Adam/AdamW fast step (torch.optim.Adam or "
                    "AdamW with fused=True in every group, no step hooks)"
                )
            if e.preparer.plan is None:
                return f"grads of {name} need a dtype cast, or some of its params have no grad"
            for gi, (g, gc) in enumerate(zip(opt.param_groups, groups, strict=True)):
                if not g.get("fused"):
                    return f"param group {gi} of {name} is not fused=True"
                if gc.n and gc.device is None:
                    return (
                        f"the params and state of param group {gi} of {name} are not all of "
                        "one device and dtype"
                    )
                if frozen_values(g) is None or e.fast.lr_slots is None:
                    return f"param group {gi} of {name} holds a tensor or list hyperparameter"
        return None

    def still_valid(self, captured: Inputs) -> bool:
        """``inputs().same(captured)`` without building the long lists: the O(groups) part
        first, then per engine the params in chunks (``_unmoved``): every param's grad object,
        that grad's local tensor and the param's local tensor by identity, the grads' local
        addresses (torch's C++ loop where the build has it); under
        ``MFSDP_OPTIM_CHECK_ALL_ADDRESSES`` the params' local addresses too (the per-step
        contract of the eager step's kernel tables)."""
        if not captured.same_head(self.inputs(lists=False)):
            return False
        rows = iter(self._rows_of(captured))
        check_all = check_all_lists()
        # reading .grad of a tensor subclass pays a torch-function dispatch unless disabled
        with torch._C.DisableTorchFunctionSubclass():
            for e in self.engines:
                plan = e.preparer.plan
                if plan is None:  # (also at the capture: the head compared the plan objects)
                    continue
                params, chunks, locals_, local_ptrs, state = next(rows)
                if not (
                    params is plan.params
                    and _unmoved(chunks)
                    and (not check_all or same_addresses(locals_, local_ptrs))
                    and (not state or all(map(_is, _state_locals(e, params), state)))
                ):
                    return False
        return True

    def _rows_of(self, captured: Inputs) -> list[tuple[Any, ...]]:
        """Per engine with a plan, what ``still_valid`` compares, built once per capture from
        its ``Inputs`` (five lists and two address lists per engine): the captured params list,
        its ``_chunks``, the params' local tensors with their addresses and Muon's momentum
        buffers' local tensors. Kept in ``captured.derived`` (it dies with the capture)."""
        if captured.derived is None:
            lists, ptrs = captured.lists, captured.addresses
            captured.derived = [
                (
                    lists[5 * i],
                    _chunks(lists[5 * i : 5 * i + 4], ptrs[2 * i]),
                    lists[5 * i + 3],
                    ptrs[2 * i + 1],
                    lists[5 * i + 4],
                )
                for i in range(len(lists) // 5)
            ]
        return captured.derived

    def inputs(self, lists: bool = True) -> Inputs:
        """What the capture reads (see the module docstring); ``lists``: with every param's
        grad, its local tensor and the param's local tensor, and the local tensors' addresses
        (O(params))."""
        w = self.wrapper
        cfg, scaler = w.config, w.grad_scaler
        objects: list[Any] = [cfg, cfg.grad_stats_group, scaler, self.agreement.buffer]
        long: list[list[Any]] = []
        ptrs: list[list[int]] = []
        values: list[Any] = [
            cfg.clip_grad,
            cfg.norm_type,
            cfg.log_num_zeros_in_grad,
            cfg.triton_adam_step,
        ]
        if scaler is not None:
            objects.extend(scaler.device_tensors(self.device))
            values.append(scaler.needs_unscale())
        for e in self.engines:
            opt, fast, plan = e.optimizer, e.fast, e.preparer.plan
            objects += [opt.state, opt.param_groups, fast.groups(), fast.lr_slots, plan]
            values += [
                len(opt.state),
                e.table.version,
                e.table.current(),
                route_of(opt, precision_aware=e.precision_aware),
            ]
            whole = e.kind == WHOLE_PARAM
            if whole:  # the plan the capture stepped (its exchanges' sizes and positions)
                objects.append(e.whole_plan)
                values.append(getattr(e.whole_plan, "broken", None))
            baked = ("params",) if whole else ("params", "lr")  # Muon's lr is a number
            for g in opt.param_groups:
                objects += [g, g["params"]]
                values.append(tuple(v for k, v in g.items() if k not in baked))
            groups = fast.groups()
            if groups is not None:
                objects.extend([gc.triton_table for gc in groups])
            if plan is not None and lists:  # O(params); a plan means every grad is a DTensor
                with torch._C.DisableTorchFunctionSubclass():
                    grads = list(map(_grad_of, plan.params))
                grad_locals = list(map(_local_of, grads))
                locals_ = list(map(_local_of, plan.params))
                long += [plan.params, grads, grad_locals, locals_, _state_locals(e, plan.params)]
                ptrs += [addresses(grad_locals), addresses(locals_)]
        return Inputs(objects, tuple(values), long, ptrs)

    def _keep_alive(self) -> list[Any]:
        """What the graph reads that caches may drop (tables, workspaces, the verdict slots,
        the device constants of Muon's agreement): held while the capture lives, so no replay
        reads freed memory."""
        from ..._infra.comm import device_constants
        from ...stats.seam import capture_keepalive

        keep: list[Any] = capture_keepalive() + device_constants()
        keep.append(self.agreement.buffer)
        for e in self.engines:
            keep.append(e.fast.groups())
            if e.triton is not None:
                keep.append(e.triton.kept_tensors())
        return keep
