"""The small format-3 optimizer checkpoint checked in under ``tests/data/ckpt_format3``.

Written by ``build_sharded_state_dict`` + ``save_checkpoint`` of format 3 (ONE ``GroupMetaTable``
item under ``param_to_group_meta``, ``state[fqn]`` one DTensor per state key) on 2 gloo CPU ranks,
before format 4 packed each param's state tensors into one. The model, the training and the
independent reference are those of ``_v010.py``; ``tests/checkpoint/test_checkpoint_format.py``
loads it with the current code, bit for bit. Regenerate (only to reproduce the history; the point of
the fixture is that it is NOT regenerated)::

    PYTHONPATH=src python tests/_format3.py tests/data/ckpt_format3
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _v010 import generate  # noqa: E402

if __name__ == "__main__":
    generate(sys.argv[1], "mfsdp_optim format 3")
