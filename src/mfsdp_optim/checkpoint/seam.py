"""What other code of the package and its tools (benchmarks/, scripts/) need of the checkpoint
layer beyond its public functions: not public API, no stability promised.

Map: for the wrapper layer (``optim``): ``GroupMetaTable`` / ``OptimizerStateDict`` (the
``param_to_group_meta`` table, and the state dict type that turns ``dcp.load``'s tuple back into
one) and ``load_sharded_state_dicts`` (several optimizers' state dicts, one agreement). For the
benchmarks: ``describe_state`` (this rank's keyspace description, what the detailed exchange
would send), ``host_buffer_bytes`` / ``release_host_buffers`` (the asynchronous save's host
buffers, kept between saves), ``page_locker`` (how those buffers are page-locked:
``register(ptr, nbytes, flags)`` / ``unregister(ptr)``, ``gil_free``), ``locked_host_buffer``
(one such buffer, page-locked as a preparation locks them) and
``collective_bytes_sent`` (the bytes handed to the package's object gathers and max all-reduces
so far in this process).
"""

from __future__ import annotations

from .._infra import comm
from ._on_disk._host_buffers import cudart as page_locker
from ._on_disk._host_buffers import locked as locked_host_buffer
from ._on_disk._host_buffers import nbytes as host_buffer_bytes
from ._on_disk._host_buffers import release as release_host_buffers
from ._state_dict._keyspace import describe_state
from ._state_dict._load_sharded_state_dict import load_sharded_state_dicts
from ._state_dict._table import GroupMetaTable, OptimizerStateDict

__all__ = [
    "GroupMetaTable",
    "OptimizerStateDict",
    "collective_bytes_sent",
    "describe_state",
    "host_buffer_bytes",
    "load_sharded_state_dicts",
    "locked_host_buffer",
    "page_locker",
    "release_host_buffers",
]


def collective_bytes_sent() -> int:
    """The bytes this process has handed to the package's object gathers and max all-reduces
    (``_infra.comm``'s counters) so far: the difference around a call is what it sent."""
    return sum(comm.SENT.values())
