"""How each base optimizer class is stepped on sharded params: its *update kind*.

``elementwise``: every element's update reads only that element of the param, grad and state
(torch's SGD, Adam, ...), so stepping local shards is exact. ``whole_param``: the update reads
the whole param (torch's Muon, Adafactor); it is computed on whole params (``_whole``).
``cross_param`` updates read across params (LBFGS) and are refused. ``kind_of`` decides, from
``OptimizerConfig.update_kinds``, then an ``mfsdp_update_kind`` attribute of the optimizer,
then the classes below; a class it does not know takes the exact whole-param path, with one
warning that says how to declare it elementwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

__all__ = ["CROSS_PARAM", "ELEMENTWISE", "KINDS", "WHOLE_PARAM", "check_update_kinds", "kind_of"]

ELEMENTWISE = "elementwise"
WHOLE_PARAM = "whole_param"
CROSS_PARAM = "cross_param"
KINDS = (ELEMENTWISE, WHOLE_PARAM)  # what a user may declare

_O = torch.optim
_ELEMENTWISE_NAMES = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "ASGD",
)
_WHOLE_PARAM_NAMES = ("Muon", "Adafactor")
# apex's and Transformer Engine's FusedAdam: elementwise, known by module and name (optional)
_ACCELERATOR_ADAMS = (("apex.optimizers", "FusedAdam"), ("transformer_engine", "FusedAdam"))
_warned: set[type] = set()


def _torch_classes(names: tuple[str, ...]) -> tuple[type, ...]:
    return tuple(getattr(_O, n) for n in names if hasattr(_O, n))


def _unwrapped_step(cls: type) -> object:
    """``cls.step`` without torch's profiling wrapper (``Optimizer._patch_step_function`` sets
    a wrapped copy on the class of the first instance)."""
    step = cls.step  # type: ignore[attr-defined]
    while hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def check_update_kinds(update_kinds: object) -> dict[type, str]:
    """``OptimizerConfig.update_kinds`` validated: ``{optimizer class: "elementwise" |
    "whole_param"}``."""
    if not isinstance(update_kinds, Mapping):
        raise TypeError(
            f"OptimizerConfig.update_kinds must be a mapping {{optimizer class: kind}}, got "
            f"{type(update_kinds).__name__}"
        )
    out: dict[type, str] = {}
    for cls, kind in update_kinds.items():
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(
                f"OptimizerConfig.update_kinds keys must be torch.optim.Optimizer classes, got "
                f"{cls!r}"
            )
        if kind not in KINDS:
            raise ValueError(
                f"OptimizerConfig.update_kinds[{cls.__name__}] is {kind!r}; it must be one of "
                f"{list(KINDS)}"
            )
        out[cls] = kind
    return out


def kind_of(optimizer: torch.optim.Optimizer, declared: Mapping[type, str]) -> str:
    """The update kind of ``optimizer``'s class (see the module docstring); raises for classes
    that cannot be stepped exactly on sharded params."""
    cls = type(optimizer)
    if cls in declared:
        return declared[cls]
    own = getattr(optimizer, "mfsdp_update_kind", None)
    if own is not None:
        if own not in KINDS:
            raise ValueError(
                f"{cls.__name__}.mfsdp_update_kind is {own!r}; it must be one of {list(KINDS)}"
            )
        return own
    if cls is getattr(_O, "LBFGS", None):
        raise ValueError(
            "torch.optim.LBFGS cannot be wrapped: its update reads across all params (one flat "
            "vector and line search over the whole model), which sharded params cannot give "
            "it exactly. Use it on unsharded params, or another optimizer."
        )
    if cls is getattr(_O, "SparseAdam", None):
        raise ValueError(
            "torch.optim.SparseAdam cannot be wrapped: it needs sparse grads, and FSDP2 params "
            "have dense DTensor grads. Use torch.optim.Adam(W)."
        )
    if cls in _torch_classes(_ELEMENTWISE_NAMES):
        return ELEMENTWISE
    if cls in _torch_classes(_WHOLE_PARAM_NAMES):
        return WHOLE_PARAM
    module = cls.__module__
    if any(module.startswith(m) and cls.__name__ == n for m, n in _ACCELERATOR_ADAMS):
        return ELEMENTWISE
    # a subclass of a known class keeps its base's kind unless it overrides step()
    for base in _torch_classes(_ELEMENTWISE_NAMES + _WHOLE_PARAM_NAMES):
        if issubclass(cls, base) and _unwrapped_step(cls) is _unwrapped_step(base):
            return ELEMENTWISE if base.__name__ in _ELEMENTWISE_NAMES else WHOLE_PARAM
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"mfsdp_optim does not know whether {cls.__qualname__}'s update reads whole params, "
            "so it steps each param on the whole param (exact, with one exchange per step). If "
            "every element's update reads only that element, declare it: "
            f"OptimizerConfig(update_kinds={{{cls.__name__}: 'elementwise'}}) for the "
            "local-shard step.",
            UserWarning,
            stacklevel=4,
        )
    return WHOLE_PARAM
