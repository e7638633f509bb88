"""The in-memory side of the checkpoint layer: one rank's sharded optimizer state dict.

Map: ``_build_sharded_state_dict`` the orchestrator of the build, which enters each stage once,
in order: ``_materialize_optimizer_state`` (1: state for a load target, the keys a param this
rank does not hold would get; also ``materialize_optimizer_state``), ``_keyspace`` (2: the
agreed keys, ONE all-reduce), ``_table`` (3: the ``param_to_group_meta`` table,
``GroupMetaTable`` / ``OptimizerStateDict``), ``_layout`` (4: the state DTensors); ``_values``
the leaf they share (how each state value is stored, plain values as checkpoint-safe data).
``_load_sharded_state_dict`` validates a state dict against the live optimizer, agrees, and only
then restores (``load_sharded_state_dicts`` for several); ``_prune_to_checkpoint`` fits a load
target to an older checkpoint's format; ``_torch_state_dict`` converts to and from torch's
``get_optimizer_state_dict`` layout; ``_stateful`` the ``OptimizerStateful`` DCP wrapper.
"""
