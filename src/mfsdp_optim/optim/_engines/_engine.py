"""One base optimizer's step machinery and every cache the wrapper keeps for it: ``Engine``.

An ``Engine`` owns the param table (``_slots``), the prepare plan (``_preparer``), the fast Adam
lists and Triton tables (``_fast_step``, ``_triton_adam``) and the whole-param plan
(``_whole``). Its one validity rule: a cache is used only while the table's version, the
optimizer's ``state`` mapping and ``param_groups`` are those it was built from and the params
hold the local tensors it saw; ``invalidate()`` drops all of them at once. How the base step
runs (the fast step, the whole-param step or the optimizer's own) is chosen in ``_route``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..._infra.agreement import digest
from ...stats.seam import PRESENCE_PRIME, Buckets
from .._config import OptimizerConfig
from .._hyper import check_param_groups
from .._kinds._kind_of import WHOLE_PARAM, kind_of
from ._base_step import base_step
from ._fast_step import FastAdamStep
from ._preparer import Preparer
from ._route import FAST, WHOLE, Route, detect_precision_aware, route_for, step_engine
from ._slots import SlotTable
from ._triton_adam import TritonAdam

__all__ = ["Engine", "check_disjoint", "frozen_values"]


class Engine:
    """One base optimizer of a ``FullyShardedOptimizer`` (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model_chunks: Sequence[torch.nn.Module],
        config: OptimizerConfig,
        name: str = "",
    ):
        self.optimizer = optimizer
        self.name = name  # "optimizers[i]" where the wrapper has several, for messages
        # host_sync=False: create a first step's state up front, so the fast step (and its
        # device-side skip) runs from the first step instead of a host read deciding it
        self.state_first = not config.host_sync
        self.host_sync = config.host_sync
        self.batched_ns = config.batched_newton_schulz
        self.kind = kind_of(optimizer, config.update_kinds)
        aware, self.decoupled = detect_precision_aware(optimizer)
        if config.precision_aware is not None:
            aware = config.precision_aware
        self.precision_aware = bool(aware)
        self.group = config.grad_stats_group
        self.table = SlotTable(
            optimizer, model_chunks, filter_empty=config.filter_empty_shards, stats_group=self.group
        )
        self.preparer = Preparer()
        self.fast = FastAdamStep()
        self.triton = TritonAdam() if config.triton_adam_step else None
        self.whole_plan: Any = None
        # the last whole-param step under host_sync=False: Muon's device verdict, whether it
        # kept its plan (stepped on the device, capturable), and this rank's own failure
        self._verdict: Any = None
        self._whole_steady = False
        self._whole_error: BaseException | None = None
        self._muon: bool | None = None  # recipe_for(optimizer) == "muon", once asked
        self.route = Route(False, False)
        self.fast_token: object | None = None  # the fast cache this step's grads were put in
        self.fast_steps = 0
        self.clip_folds = 0
        self._checked: list[tuple | None] = []  # the group values the last check passed
        self.disjoint_versions: tuple[int, ...] = ()  # check_disjoint: the tables it passed
        # (table version, each slot's two grad-presence terms, their totals): see presence()
        self._presence: tuple[int, list[tuple[int, int]], tuple[int, int]] = (-1, [], (0, 0))
        self._check_named()
        self._presence_terms()  # here, not in the first step (it reads the meshes' ranks)

    def invalidate(self) -> None:
        """Drop every cached view, list and kernel table (rebuilt at the next step)."""
        self.fast.invalidate()
        self.preparer.plan = None
        if self.whole_plan is not None:  # rebuilt at the next step (kept only to size the
            self.whole_plan.broken = True  # exchanges of peers that keep theirs: _whole._step)

    # ------------------------------------------------------------------------------ prepare

    def check(self) -> None:
        """Validate the param table and the hyperparameters (before any engine changes a
        grad); errors name the base optimizer where there are several."""
        if self.table.sync():
            self.invalidate()
            self._check_named()
        groups = self.optimizer.param_groups
        # the values checked last time, compared by identity (immutable values only: a list or
        # a tensor may change in place): a steady step checks nothing again
        seen = [frozen_values(g) for g in groups]
        last = self._checked
        if (
            len(last) == len(seen)
            and None not in seen
            and all(
                len(a) == len(b) and all(map(operator.is_, a, b))  # type: ignore[arg-type]
                for a, b in zip(last, seen, strict=True)
            )
        ):
            return
        try:
            check_param_groups(groups, self.optimizer.defaults)
        except (TypeError, ValueError) as exc:
            if not self.name:
                raise
            raise type(exc)(f"{self.name}.{exc}") from None
        self._checked = seen

    def _check_named(self) -> None:
        """The whole-param path matches a param's pieces across ranks by its name. Without
        model_chunks the name is the param's position in the groups, which cannot tell two params
        of one shape, dtype and layout apart when ranks list them in different orders (each
        owner would assemble pieces of both): refused, unless the params are known by FQN."""
        if self.kind != WHOLE_PARAM or self.table.model_chunks:
            return
        seen: dict[tuple, str] = {}
        for s in self.table.slots:
            p, mesh = s.param, s.param.device_mesh.mesh
            key = (tuple(p.shape), p.dtype, tuple(mesh.flatten().tolist()), tuple(p.placements))
            if key in seen:
                where = f"{self.name}: " if self.name else ""
                raise ValueError(
                    f"{where}{type(self.optimizer).__name__} takes the whole-param path, which "
                    f"matches each param's pieces across ranks by name, and params {seen[key]!r} "
                    f"and {s.fqn!r} have the same shape {tuple(p.shape)}, dtype and layout: "
                    "without model_chunks they are named by position, so ranks listing them in "
                    "different orders would mix their pieces. Pass model_chunks=[model] (the "
                    "modules whose named_parameters() hold them) so they are known by FQN."
                )
            seen[key] = s.fqn

    def collect(self) -> Buckets:
        """Pick the route, set each slot's work grad and bucket the local shards (after
        ``check()``). Collective-free; grads are not changed (``unscale`` does that)."""
        opt = self.optimizer
        route = route_for(opt, self.kind, precision_aware=self.precision_aware)
        self.route = route
        token, trust = None, False
        if route.fast:
            # a plan recorded over this fast cache vouches for the params' local tensors
            plan = self.preparer.plan
            trust = plan is not None and self.fast.token is not None
            trust = trust and plan.fast_token is self.fast.token  # type: ignore[union-attr]
            if self.state_first and len(opt.state) < len(self.table.slots):
                self._create_first_state()
            token = self.fast.begin(opt, self.table, trust_locals=trust)
        self.fast_token = token
        buckets = self.preparer.collect(
            self.table.slots,
            cast_grads=not self.precision_aware,
            group=self.group,
            fast_token=token,
        )
        if token is not None and trust and not self.preparer.replayed and not self.fast.locals_ok():
            self.fast.invalidate()  # a local tensor was replaced: generic now, rebuilt next
            self.fast_token = None
        return buckets

    def presence(self) -> tuple[int, int]:
        """This rank's two grad-presence sums over the params with a grad this step (after
        ``collect``), for the stats collective's check (``stats._reduce.PRESENCE_PRIME``): per
        param ``h / n`` and, on its lowest mesh rank, ``h``; ``h`` a hash of its name and mesh
        ranks, ``n`` the mesh's size. Terms are made once per table; a replayed collect (every
        grad present) costs nothing."""
        self._presence_terms()
        _, terms, totals = self._presence
        slots = self.table.slots
        if not self.preparer.replayed:
            totals = (0, 0)
            for s, (c, d) in zip(slots, terms, strict=True):
                if s.work_grad is not None:
                    totals = (totals[0] + c, totals[1] + d)
        return totals[0] % PRESENCE_PRIME, totals[1] % PRESENCE_PRIME

    def _presence_terms(self) -> None:
        """Each slot's two presence terms and their totals, made once per table version."""
        version = self.table.version
        if self._presence[0] != version:
            terms = []
            me = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            for s in self.table.slots:
                ranks = s.param.device_mesh.mesh.flatten().tolist()
                h = digest(f"{s.fqn}|{ranks}")[0] % PRESENCE_PRIME
                share = h * pow(len(ranks), PRESENCE_PRIME - 2, PRESENCE_PRIME) % PRESENCE_PRIME
                terms.append((share, h if me == min(ranks) else 0))
            totals = (sum(c for c, _ in terms), sum(d for _, d in terms))
            self._presence = (version, terms, totals)

    def _create_first_state(self) -> None:
        """The state the first step would create (zeros, ``step`` 0), for the params that have
        none; a skipped first step then leaves this state where stock leaves none."""
        from ...checkpoint import materialize_optimizer_state

        materialize_optimizer_state(self.optimizer)
        self.fast.invalidate()

    def skips_on_device(self) -> bool:
        """Whether this step's update can be skipped on the device: the fast Adam step runs and
        every group is fused (torch's fused kernels take ``found_inf``). Elsewhere a skip needs
        a host read of found_inf (see ``docs/concepts.md``). A whole-param engine can where its
        update gates its writes on the device: Muon under ``host_sync=False``."""
        if self.kind == WHOLE_PARAM:
            return self.whole_on_device()
        return (
            self.fast_token is not None
            and self.fast.ready(self.optimizer, self.table)
            and self.fast.skips_on_device()
        )

    def whole_on_device(self) -> bool:
        """Whether this engine's whole-param update keeps its verdict on the device (Muon under
        ``host_sync=False``; the generic path settles on the host through a gloo group)."""
        if self._muon is None:
            from .._whole import recipe_for

            self._muon = recipe_for(self.optimizer) == "muon"
        return self.kind == WHOLE_PARAM and not self.host_sync and self._muon

    def whole_steady(self) -> bool:
        """Whether the last step's whole-param update kept its plan and ran on the device (the
        step a CUDA graph can capture): under ``host_sync=False``, Muon, no plan built."""
        return self._whole_steady

    def take_verdict(self) -> tuple[torch.Tensor | None, BaseException | None]:
        """The last step's device verdict (a 0-d bool: the update was refused on every rank;
        None where the step settles on the host) and this rank's own failure, which the
        wrapper raises once every engine ran; both forgotten here."""
        verdict, error = self._verdict, self._whole_error
        self._verdict, self._whole_error = None, None
        return (None if verdict is None else verdict.bad), error

    def current_grads(self, prepared: bool) -> list[DTensor]:
        """The grads statistics and clipping act on now (the cast copies while prepared)."""
        slots = self.table.slots
        if prepared:
            return [s.work_grad for s in slots if s.work_grad is not None]
        return [s.param.grad for s in slots if s.param.grad is not None]  # type: ignore[misc]

    # --------------------------------------------------------------------------------- step

    def step(self, grad_divisor: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """The base step on the prepared grads, then restore cast grads. ``grad_divisor``: a
        folded clip (``route.fold_clip``), handed to the fused step as its ``grad_scale``;
        ``found_inf``: skip on the device (only where ``skips_on_device()``)."""
        opt, table = self.optimizer, self.table
        try:
            fast_ready = self.fast_token is not None and self.fast.ready(opt, table)
            engine = step_engine(self.kind, fast_ready=fast_ready)
            if engine == FAST:
                keys = self.preparer.work_locals
                devices = {k[0] for k in keys}
                dtypes = {k[1] for k in keys}  # the work grads' dtypes (bucket keys carry them)
                one = next(iter(dtypes)) if len(dtypes) == 1 else None
                self.fast.step(opt, devices, grad_divisor, self.triton, found_inf, one)
                self.fast_steps += 1
            elif engine == WHOLE:
                assert grad_divisor is None, "whole-param: the clip is applied to the grads"
                assert found_inf is None or self.whole_on_device(), "a device skip needs Muon"
                self._whole_step(found_inf)
            else:
                assert found_inf is None, "a device-side skip needs the fast step"
                self.fast.clear()
                base_step(opt, table.slots, decoupled=self.decoupled, grad_scale=grad_divisor)
        finally:
            self.drop_fast()
            self.preparer.restore(table.slots)

    def _whole_step(self, skip: torch.Tensor | None = None) -> None:
        """Each param's update computed on the whole param (``_whole``), its work grad bound as
        ``.grad`` for the call (a cast copy in the param's dtype where the grad's differed).
        Under ``host_sync=False`` the step reads nothing back from the device (``_whole``'s
        verdict); Muon's is kept for ``take_verdict`` with its writes gated also on ``skip``
        (a float32 0/1 device gate), and a failure of this rank's is kept to be raised after
        the other engines ran, as its peers run them."""
        from ..._infra.comm import collective_device
        from .._whole import DeviceVerdict, recipe_for, step_whole_params

        opt = self.optimizer
        # a recipe that computes the update itself (Muon's) never calls the class's step():
        # its hooks and a scheduler's step counter see one step, as the generic path's call does
        emulate = recipe_for(opt) != "generic"
        if emulate:
            for pre in list(opt._optimizer_step_pre_hooks.values()):
                pre(opt, (), {})
        slots = [s for s in self.table.slots if s.work_grad is not None]
        swapped = [s for s in slots if s.saved_grad is not None]
        for s in swapped:
            s.param.grad = s.work_grad
        verdict = None
        if not self.host_sync:
            verdict = DeviceVerdict(collective_device(self.group), skip)
        plan = self.whole_plan
        self._whole_steady = False
        try:
            self.whole_plan = step_whole_params(
                self.optimizer,
                [s.param for s in self.table.slots],
                group=self.group,
                plan_cache=plan,
                names=[s.fqn for s in self.table.slots],
                batched_ns=self.batched_ns,
                verdict=verdict,
            )
            self._whole_steady = self.whole_on_device() and self.whole_plan is plan
        except Exception as exc:
            if verdict is None or not self.whole_on_device():
                raise
            verdict.fail(exc)  # raised by the wrapper once the other engines ran
            self._whole_error = exc
            if verdict.plan is not None:  # built at this step: its peers keep it too
                self.whole_plan = verdict.plan
        finally:
            for s in swapped:
                s.param.grad = s.saved_grad
        if self.whole_on_device():
            self._verdict = verdict
        if emulate and self._whole_error is None:  # a refused step runs no post-hooks
            # what the step() wrapper of torch's LRScheduler records when step() runs
            if getattr(vars(opt).get("step"), "_wrapped_by_lr_sched", False):
                opt._opt_called = True  # type: ignore[attr-defined]
            for post in list(opt._optimizer_step_post_hooks.values()):
                post(opt, (), {})

    def drop_fast(self) -> None:
        """Forget the grads collected for the fast step."""
        self.fast.clear()
        self.fast_token = None

    def drop(self) -> None:
        """Forget the work grads without copying anything back (zero_grad, a failed prepare)."""
        self.preparer.drop(self.table.slots)
        self.drop_fast()

    def skip(self) -> None:
        """A skipped step: restore cast grads, run nothing."""
        self.drop_fast()
        self.preparer.restore(self.table.slots)


def check_disjoint(engines: Sequence[Engine]) -> None:
    """Several base optimizers must hold disjoint params with distinct FQNs: checked at
    construction and again whenever a table was rebuilt (a param appended to a second base
    optimizer after construction would otherwise be stepped by both)."""
    versions = tuple(e.table.version for e in engines)
    if len(engines) < 2 or engines[0].disjoint_versions == versions:
        return
    holder: dict[int, int] = {}
    named: dict[str, int] = {}
    for i, e in enumerate(engines):
        for s in e.table.slots:
            j = holder.setdefault(id(s.param), i)
            if j != i:
                raise ValueError(
                    f"param {s.fqn!r} is in optimizer[{j}] and optimizer[{i}]: several base "
                    "optimizers must hold disjoint params (it would be stepped twice). Remove it "
                    "from one of them; nothing was updated."
                )
            k = named.setdefault(s.fqn, i)
            if k != i:
                raise ValueError(
                    f"optimizers[{k}] and optimizers[{i}] hold two different params both named "
                    f"{s.fqn!r}: names key the checkpoint and the whole-param exchange, so they "
                    "must be unique. Pass model_chunks that hold every param (each named by its "
                    "FQN)."
                )
    engines[0].disjoint_versions = versions


_MUTABLE = (list, dict, set, bytearray, torch.Tensor)


def frozen_values(group: dict[str, Any]) -> tuple | None:
    """The group's hyperparameter values, or None when one may change in place (compared by
    identity from one step to the next: by ``Engine.check`` and the captured step)."""
    values = tuple(v for k, v in group.items() if k != "params")
    return None if any(isinstance(v, _MUTABLE) for v in values) else values
