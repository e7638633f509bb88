"""torch's step-hook contract around the wrapper's ``step``: ``with_step_hooks``.

``torch.optim.Optimizer`` wraps every optimizer's ``step`` (``profile_hook_step``) to fire the
global and the optimizer's own pre and post hooks; ``with_step_hooks`` does the same without
entering a profiler range at every call (only while a profiler runs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.optim import optimizer as _torch_optim

__all__ = ["with_step_hooks"]


def with_step_hooks(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` under torch's step-hook contract, as ``Optimizer.profile_hook_step`` wraps every
    optimizer's ``step``: the global and the optimizer's own pre hooks (a pre hook may return
    new ``(args, kwargs)``; ``args`` starts with the optimizer), the step,
    ``_optimizer_step_code()`` (the profiler's probe), the own and global post hooks; and,
    while a profiler runs, the same ``record_function`` range (``Optimizer.step#<class>.step``).
    torch's wrapper enters that range at every call, profiling or not: about half of its
    ~10 us, as much as the rest of a captured step's replay over 10 params.

    Marked ``hooked`` so ``_patch_step_function`` keeps it. A subclass that defines its own
    ``step`` gets torch's wrapper around that one, and its ``super().step()`` runs here without
    the hooks (they fire once)."""

    @functools.wraps(step)
    def hooked_step(*args: Any, **kwargs: Any) -> Any:
        opt = args[0]
        if type(opt).step is not hooked_step:  # under a subclass's step: torch fired the hooks
            return step(*args, **kwargs)
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(
                f"Optimizer.step#{type(opt).__name__}.step"
            ):
                return _run_hooked(step, opt, args, kwargs)
        return _run_hooked(step, opt, args, kwargs)

    hooked_step.hooked = True  # type: ignore[attr-defined]
    return hooked_step


def _run_hooked(step: Callable[..., Any], opt: Any, args: tuple, kwargs: dict) -> Any:
    """The pre hooks, ``step``, the profiler's probe and the post hooks (``with_step_hooks``)."""
    global_pre = _torch_optim._global_optimizer_pre_hooks
    own_pre = opt._optimizer_step_pre_hooks
    if global_pre or own_pre:
        for pre_hook in chain(global_pre.values(), own_pre.values()):
            result = pre_hook(opt, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"the optimizer step pre hook {pre_hook!r} returned {result!r}; a step "
                        "pre hook returns None or a tuple (new_args, new_kwargs)"
                    )
                args, kwargs = result
    out = step(*args, **kwargs)
    opt._optimizer_step_code()
    own_post = opt._optimizer_step_post_hooks
    global_post = _torch_optim._global_optimizer_post_hooks
    if own_post or global_post:
        for post_hook in chain(own_post.values(), global_post.values()):
            post_hook(opt, args, kwargs)
    return out
