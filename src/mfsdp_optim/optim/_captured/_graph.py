"""The captured step's bookkeeping (``OptimizerConfig(cuda_graph=True)``), testable on CPU.

Map: ``StepGraph`` holds one captured step body and decides at every step whether to replay it,
capture it again or run eagerly (``plan``); ``Inputs`` is what a capture depends on (objects
compared by identity, plain values by equality); ``ScalarSlots`` mirrors per-step Python
scalars (the lr of each param group) in device memory, uploaded without a sync and only when
one changed; ``Counters`` replays the host-side counters a captured body bumps. How a body is
captured and replayed is a runner: ``CudaGraphRunner`` (a ``torch.cuda.CUDAGraph`` on a side
stream, warmed up on that stream first) or ``EagerRunner`` (the body run again at each replay:
the same decisions on CPU, for tests). The wrapper's side (what the inputs are, which steps can
be captured): ``_step``. Contract: docs/concepts.md, "The captured step".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from operator import is_ as _is
from typing import Any

import torch

from ..._infra.comm import staged_for

__all__ = [
    "MIN_REPLAYS",
    "Counters",
    "CudaGraphRunner",
    "EagerRunner",
    "Inputs",
    "ScalarSlots",
    "StepGraph",
]

# a capture whose inputs move again before it was replayed this often is not worth capturing
# again: the step runs eagerly from then on (one warning)
MIN_REPLAYS = 2


class Inputs:
    """What a captured step reads: ``objects`` (tensors, lists, caches) must be the very same
    objects, ``values`` (hyperparameters baked into the graph, versions, flags) equal, each
    of ``lists`` (long lists of objects, e.g. every param's grad) hold the same objects, and
    ``addresses`` (lists of ints: the ``data_ptr()`` of tensors the graph reads) be equal.

    Holding the objects keeps them alive, so an identity match can never name a new object
    that took a freed one's id (or its memory). ``derived``: what the owner builds from these
    inputs once (e.g. the rows of its per-step check), kept here so it dies with them."""

    __slots__ = ("objects", "values", "lists", "addresses", "derived")

    def __init__(
        self,
        objects: list[Any],
        values: tuple[Any, ...],
        lists: Sequence[list[Any]] = (),
        addresses: Sequence[list[int]] = (),
    ):
        self.objects = objects
        self.values = values
        self.lists = list(lists)
        self.addresses = list(addresses)
        self.derived: Any = None

    def same_head(self, other: Inputs) -> bool:
        """``objects`` and ``values`` match (not ``lists``)."""
        return (
            len(self.objects) == len(other.objects)
            and self.values == other.values
            and all(map(_is, self.objects, other.objects))
        )

    def same(self, other: Inputs) -> bool:
        return (
            self.same_head(other)
            and len(self.lists) == len(other.lists)
            and all(
                len(a) == len(b) and all(map(_is, a, b))
                for a, b in zip(self.lists, other.lists, strict=True)
            )
            and self.addresses == other.addresses  # ints: equality is safe
        )


class ScalarSlots:
    """Python scalars mirrored in a 1-D device tensor (one slot each), read by a captured graph.

    ``update(values)`` compares with the host copy and uploads only when one changed: from pinned
    memory, ``non_blocking`` on the current stream (no sync; the caching host allocator keeps the
    staging block until the copy ran), ordered before any work enqueued after it.

    Args:
        values: The initial values.
        device: Where the graph reads them.
        dtype: Their dtype there.
    """

    def __init__(self, values: Sequence[float], device: torch.device, dtype: torch.dtype):
        self.host = [float(v) for v in values]
        self.device = device
        self.dtype = dtype
        self.uploads = 0
        self.tensor = torch.zeros(len(self.host), dtype=dtype, device=device)
        self._views: list[torch.Tensor] = [self.tensor[i] for i in range(len(self.host))]
        self._upload()

    def __len__(self) -> int:
        return len(self.host)

    def slot(self, i: int) -> torch.Tensor:
        """A 0-d view of slot ``i`` (the same tensor object at every call)."""
        return self._views[i]

    def update(self, values: Sequence[float]) -> bool:
        """Make the device copy hold ``values`` (same length); True when it uploaded."""
        new = [float(v) for v in values]
        if new == self.host:  # NaN never equals itself: uploaded every time, still correct
            return False
        if len(new) != len(self.host):
            raise ValueError(f"ScalarSlots holds {len(self.host)} values, got {len(new)}")
        self.host = new
        self._upload()
        return True

    def _upload(self) -> None:
        self.tensor.copy_(staged_for(self.device, self.host, self.dtype), non_blocking=True)
        self.uploads += 1


class Counters:
    """Integer attributes a step body bumps on the host (the wrapper's diagnostics): a capture
    runs the body without its effects, so the bump it made is undone and added again at each
    replay."""

    def __init__(self, fields: Sequence[tuple[Any, str]]):
        self.fields = list(fields)
        self.delta: list[int] = [0] * len(self.fields)
        self._before: list[int] = []

    def begin(self) -> None:
        self._before = [getattr(o, a) for o, a in self.fields]

    def end(self) -> None:
        """After the capture: remember its bumps and undo them."""
        after = [getattr(o, a) for o, a in self.fields]
        self.delta = [x - b for x, b in zip(after, self._before, strict=True)]
        self.undo()

    def undo(self) -> None:
        for (o, a), b in zip(self.fields, self._before, strict=True):
            setattr(o, a, b)

    def replayed(self) -> None:
        for (o, a), d in zip(self.fields, self.delta, strict=True):
            if d:
                setattr(o, a, getattr(o, a) + d)


class EagerRunner:
    """Runs the "captured" body again at each replay (CPU tests of ``StepGraph``'s decisions)."""

    def __init__(self) -> None:
        self.body: Callable[[], Any] | None = None
        self.captures = 0

    def warm(self, body: Callable[[], Any]) -> Any:
        return body()

    def capture(self, body: Callable[[], Any]) -> None:
        self.body = body
        self.captures += 1

    def replay(self) -> Any:
        assert self.body is not None
        return self.body()

    def reset(self) -> None:
        self.body = None


class CudaGraphRunner:
    """A ``torch.cuda.CUDAGraph`` of the body, warmed up and captured on one side stream.

    ``warm`` runs the body eagerly on the side stream (ordered after the current stream's work
    and before its later work): everything the body keeps per stream (kernel tables,
    workspaces) then exists for that stream, so the capture allocates and uploads nothing.
    ``capture`` records the body (nothing runs); its error mode is ``thread_local``, so other
    threads (the NCCL watchdog) may query the device meanwhile. ``replay`` launches the graph on
    the current stream and returns the tensors the capture returned, rewritten by it.

    Args:
        device: The CUDA device.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.graph: Any = None
        self.outputs: Any = None
        self.captures = 0

    def warm(self, body: Callable[[], Any]) -> Any:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                out = body()
        finally:
            current.wait_stream(self.stream)
        for t in out if isinstance(out, tuple) else ():
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(current)  # made on the side stream, used on the current one
        return out

    def capture(self, body: Callable[[], Any]) -> None:
        self.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = body()
            finally:
                graph.capture_end()
        self.graph, self.outputs = graph, out
        self.captures += 1

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs

    def reset(self) -> None:
        self.graph = None
        self.outputs = None


class StepGraph:
    """One captured step and the decision at each step: ``"replay"``, ``"capture"`` or
    ``"eager"`` (``plan``).

    A capture is replayed while its ``Inputs`` hold. When they do not (a grad or a param
    moved, a baked hyperparameter changed, a cache was rebuilt), the step is captured again,
    unless the capture being replaced ran fewer than ``MIN_REPLAYS`` times: then the inputs move
    every step or so, and every later step runs eagerly (``disable``, one warning). A capture
    that fails disables it too, as do two steps in a row that cannot be captured (``blocked``).

    Args:
        runner: ``CudaGraphRunner`` or ``EagerRunner``.
    """

    def __init__(self, runner: Any):
        self.runner = runner
        self.inputs: Inputs | None = None
        self.keep: list[Any] = []  # what the graph reads and nothing else may keep alive
        self.replays = 0  # of the current capture
        self.captures = 0
        self.disabled: str | None = None  # why every step runs eagerly, once it does
        self.blocked_once = False  # the last attempt could not capture: the next one decides

    @property
    def captured(self) -> bool:
        return self.inputs is not None

    def plan(self, still_valid: Callable[[Inputs], bool]) -> str:
        """``"replay"``, ``"capture"`` or ``"eager"`` for this step; ``still_valid(inputs)``
        tells whether the captured inputs still hold (called only when there is a capture)."""
        if self.disabled is not None:
            return "eager"
        if self.inputs is None:
            return "capture"
        if still_valid(self.inputs):
            return "replay"
        replays = self.replays
        self.drop()
        if replays < MIN_REPLAYS:
            self.disable(
                f"its inputs changed after {replays} replay(s) of the last capture: grads or "
                "params that move every step (zero_grad(set_to_none=True), new .grad tensors) "
                "or hyperparameters other than lr that change"
            )
            return "eager"
        return "capture"

    def captured_with(self, inputs: Inputs, keep: list[Any]) -> None:
        """Record a capture that succeeded."""
        self.inputs, self.keep = inputs, keep
        self.replays = 0
        self.captures += 1
        self.blocked_once = False

    def blocked(self, reason: str) -> None:
        """The step just run cannot be captured (``reason``). A change settles in one step (a
        param that moved sends that step through the generic path while the caches are
        rebuilt), so the next step tries again; a second attempt in a row that is blocked
        disables the capture."""
        self.drop()
        if self.blocked_once:
            self.disable(reason)
        self.blocked_once = True

    def replay(self) -> Any:
        self.replays += 1
        return self.runner.replay()

    def drop(self) -> None:
        """Forget the capture (the graph and what it kept alive)."""
        self.runner.reset()
        self.inputs = None
        self.keep = []

    def disable(self, reason: str) -> None:
        """Every later step runs eagerly; warns once with ``reason``."""
        self.drop()
        if self.disabled is None:
            self.disabled = reason
            warnings.warn(
                f"mfsdp_optim: OptimizerConfig(cuda_graph=True): the step is no longer captured, "
                f"{reason}. Every later step runs eagerly (same results, host cost per tensor). "
                "What keeps a capture valid: docs/concepts.md, 'The captured step'.",
                RuntimeWarning,
                stacklevel=4,
            )
