"""The small format-2 optimizer checkpoint checked in under ``tests/data/ckpt_format2``.

Written by ``build_sharded_state_dict`` + ``save_checkpoint`` of the layout after 0.1.0 (format 2:
one ``(hyperparameters, scalars)`` leaf per FQN under ``param_to_group_meta``, ``state[fqn]``
parameter-shaped tensors only) on 2 gloo CPU ranks, before format 3 replaced it. The model, the
training and the independent reference are those of ``_v010.py`` (four DTensor params, two param
groups, two steps, ``"frozen"`` never stepped); ``tests/checkpoint/test_checkpoint_format.py`` loads
it with the current code, bit for bit. Regenerate (only to reproduce the history; the point of the
fixture is that it is NOT regenerated)::

    PYTHONPATH=src python tests/_format2.py tests/data/ckpt_format2
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _v010 import generate  # noqa: E402

if __name__ == "__main__":
    generate(sys.argv[1], "mfsdp_optim format 2")
