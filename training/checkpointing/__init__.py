"""The checkpoint store and what it needs: how a state becomes files and back (``codec``,
``safetensors_io``, ``sharded`` per-rank shards), what a checkpoint directory is and how one is
judged (``verify``; a bad one raises ``errors.CheckpointRejected``, and only that is passed
over), the commit protocol and retention (``store``), and when to checkpoint (``schedule`` in
the loop, ``reliability`` formulas, ``adaptive`` interval)."""
