"""Third-party optimizer classes whose update kind is verified: data only, no import.

``REGISTRY[(module, qualname)] = (kind, why)``, matched against ``cls.__module__`` and
``cls.__qualname__`` of the class and its bases (``_kind_of.kind_of``), so the libraries are never
imported by this package. Every entry is justified by the conformance test
(``tests/optim/test_conformance.py``; the whole run: ``nox -s conformance``), which steps the
class under the wrapper on three layouts against the same class on the unsharded params fed the
very same grads: an ``elementwise`` entry is exact on local shards, a ``whole_param`` one on
whole params; a ``cross_param`` entry differs between one instance over all params and one per
param in plain torch, draws from a global random generator in its step (a stream shared by
every param), or is known to read across params, and is refused at construction;
``refused`` entries are refused for the reason given. Versions checked: pytorch-optimizer
4.1.0, lion-pytorch 0.2.5, torchao 0.18.0 (``docs/optimizers.md`` has the table).
"""

from __future__ import annotations

__all__ = ["NOT_REGISTERED", "REFUSED", "REGISTRY"]

REFUSED = "refused"

_PO = "pytorch_optimizer.optimizer."

_CROSS = {
    # (module, class): what it reads across params
    (_PO + "prodigy", "Prodigy"): "Prodigy's step size d sums over every param",
    (_PO + "dadapt", "DAdaptAdaGrad"): "D-Adaptation's d sums over every param",
    (_PO + "dadapt", "DAdaptAdam"): "D-Adaptation's d sums over every param",
    (_PO + "dadapt", "DAdaptAdan"): "D-Adaptation's d sums over every param",
    (_PO + "dadapt", "DAdaptLion"): "D-Adaptation's d sums over every param",
    (_PO + "dadapt", "DAdaptSGD"): "D-Adaptation's d sums over every param",
    (_PO + "adams", "AdamS"): "its denominator averages the second moments of every param",
    (_PO + "avagrad", "AvaGrad"): "its step size normalises over every param",
    (_PO + "adai", "Adai"): "its beta0 averages the second moments of every param",
    (_PO + "sgd", "ASGD"): "its adaptive step reads the norms of every param",
    (_PO + "lora_rite", "LoRARite"): "it steps LoRA factors as pairs of params",
    (_PO + "ranger21", "Ranger21"): (
        "its weight decay divides by a norm of the second moments summed over every param"
    ),
}
# classes whose step draws from a global random generator: the stream is shared by every
# param, so the values one param draws depend on the params stepped before it, and a rank that
# steps only some params (each param on its owner) draws other values than the unsharded run
_RANDOM = {
    (_PO + "dash", "DASH"): (
        "its step draws power-iteration start vectors from torch's global random generator "
        "for every param in turn, so each param's draws depend on the params stepped before it"
    ),
    (_PO + "psgd", "Kron"): (
        "its step draws random vectors and its update schedule from the global random "
        "generators for every param in turn, so each param's draws depend on the params "
        "stepped before it"
    ),
    (_PO + "gravity", "Gravity"): (
        "its first step draws each param's state from torch's global random generator in "
        "turn, so each param's draws depend on the params stepped before it"
    ),
}

_REFUSED = {
    (_PO + "magma", "Magma"): (
        "it keeps per-param state keyed by id(param) outside optimizer.state (the wrapper cannot "
        "carry it to the rank that steps a whole param) and draws random numbers in its step"
    ),
}

# exact on local shards on every layout of the conformance run (scripts/conformance.py
# --kinds), and no branch on shapes, norms, projections or factors in their source; with any
# option outside the tuning ones changed from its default they take the whole-param path
# (_kind_of._options_changed)
_ELEMENTWISE_NAMES = {
    "adabelief": ("AdaBelief",),
    "adabound": ("AdaBound",),
    "adadelta": ("AdaDelta",),
    "adamax": ("AdaMax",),
    "adamc": ("AdamC",),
    "adamg": ("AdamG",),
    "adamod": ("AdaMod",),
    "adapnm": ("AdaPNM",),
    "adashift": ("AdaShift",),
    "adasmooth": ("AdaSmooth",),
    "adopt": ("ADOPT",),
    "aggmo": ("AggMo",),
    "ano": ("Ano",),
    "bcos": ("BCOS",),
    "diffgrad": ("DiffGrad",),
    "dual_adam": ("DualAdam",),
    "emonavi": ("EmoLynx", "EmoNavi"),
    "exadam": ("EXAdam",),
    "focus": ("FOCUS",),
    "ftrl": ("FTRL",),
    "grams": ("Grams",),
    "grokfast": ("GrokFastAdamW",),
    "kate": ("Kate",),
    "laprop": ("LaProp",),
    "lion": ("Lion",),
    "padam": ("PAdam",),
    "pid": ("PID",),
    "pnm": ("PNM",),
    "qhm": ("QHM",),
    "radam": ("RAdam",),
    "schedulefree": ("ScheduleFreeAdamW", "ScheduleFreeRAdam", "ScheduleFreeSGD"),
    "sgd": ("AccSGD", "SGDW", "SignSGD", "VSGD"),
    "ademamix": ("AdEMAMix", "SimplifiedAdEMAMix"),
    "srmm": ("SRMM",),
    "tiger": ("Tiger",),
    "yogi": ("Yogi",),
}
_ELEMENTWISE: dict[tuple[str, str], str] = {
    (_PO + module, name): "exact on local shards (conformance run)"
    for module, names in _ELEMENTWISE_NAMES.items()
    for name in names
}
_ELEMENTWISE[("lion_pytorch.lion_pytorch", "Lion")] = "exact on local shards (conformance run)"
for _name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
    # each rank quantizes its own local tensor in blocks (torchao's own FSDP2 behaviour): see
    # docs/optimizers.md for what exact means for quantized state
    _ELEMENTWISE[("torchao.optim.adam", _name)] = "exact on local shards below the quantizing size"
# exact on local shards in the conformance run, but their source branches on shapes, norms,
# projections or factor sizes beyond what the run's small params reach: left unknown (the
# exact whole-param path, with a warning) rather than registered
NOT_REGISTERED = {
    "AdaGC": "clips each param by its own grad norm",
    "AdamWSN": "subset norms over rows",
    "Adan": "an optional clip by the norm over every param",
    "AdaNorm": "reads each param's grad norm",
    "APOLLO": "low-rank projection with a rank option",
    "EmoFact": "factored moments for matrices",
    "Fira": "low-rank projection with a rank option",
    "GaLore": "low-rank projection with a rank option",
    "MSVAG": "its source not yet read for shape branches",
    "QHAdam": "its source not yet read for shape branches",
    "SaRA": "a low-rank SVD of matrices",
    "ScalableShampoo": "preconditioners of whole matrices past its start step",
    "SWATS": "switches to SGD on a projection over the whole param",
}
_WHOLE: dict[tuple[str, str], str] = {}

REGISTRY: dict[tuple[str, str], tuple[str, str]] = {
    **{k: ("elementwise", why) for k, why in _ELEMENTWISE.items()},
    **{k: ("whole_param", why) for k, why in _WHOLE.items()},
    **{k: ("cross_param", why) for k, why in _CROSS.items()},
    **{k: ("cross_param", why) for k, why in _RANDOM.items()},
    **{k: (REFUSED, why) for k, why in _REFUSED.items()},
}
