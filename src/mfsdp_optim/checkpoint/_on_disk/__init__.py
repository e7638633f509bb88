"""The on-disk side of the checkpoint layer: whole checkpoint directories, saved and loaded on
every rank or on none.

Map: ``_save_checkpoint`` (``save_checkpoint``: agree, write, publish) and ``_load_checkpoint``
(``load_checkpoint``: check the checkpoint and the target, agree, load into copies, swap them
in); ``_prepare_async_save`` (``prepare_async_save``); ``_async`` the asynchronous save's copy,
background thread and ``SaveHandle``, over ``_host_buffers`` (its page-locked host memory, kept
for the next save); ``_consensus`` what every rank saves or loads, agreed before DCP runs (ONE
all-reduce of a digest; the detail only when it differs or a rank failed); ``_write`` each
rank's files with DCP's planner and writer, without ``dcp.save``'s collectives, and rank 0's
``.metadata`` from the reports; ``_publish`` the atomic publish of the staging directory;
``_check_checkpoint`` (``check_checkpoint``, ``checkpoint_status``) completeness and checksums;
``_safe`` the reads of ``.metadata`` and of non-tensor items that run no code.

Collectives of ``save_checkpoint``: that all-reduce, one object gather (every rank's writes and
checksums, rank 0's save id), one all-reduce (the publish verdict); the asynchronous save blocks
for the copy and one all-reduce (every rank staged) and runs the other three on its own gloo
group, on the copy. Of ``load_checkpoint``: that all-reduce, one all-reduce (every rank loaded);
DCP's load runs without collectives. The on-disk layout and its guarantees:
docs/reliability.md.
"""
