"""The checkpoint store and what it needs: how a state becomes files and back (``codec``,
``safetensors_io``, ``sharded`` per-rank shards), the commit protocol and retention (``store``),
and when to checkpoint (``reliability`` formulas, ``adaptive`` interval)."""
