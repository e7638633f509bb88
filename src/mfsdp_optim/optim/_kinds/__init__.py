"""How each base optimizer class is stepped on sharded params: its update kind.

Map: ``_kind_of`` the kinds (``elementwise``, ``whole_param``, ``cross_param``) and
``kind_of``, which decides a class's kind from the config, the class and the registry;
``_registry`` the verified third-party classes (data only, no import); ``_classify``
``classify_update``, finding a class's kind by stepping it on gloo ranks, with evidence (its
command line: ``optim/_cli.py``). Import the leaf modules (this file imports none of them).
"""
