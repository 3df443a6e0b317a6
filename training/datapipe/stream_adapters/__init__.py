"""Adapters that let third-party streaming datasets resume exactly under convoy.

Why adapters: each library keeps a stream's position with its own protocol, called where the
library says, and none of them is convoy's no-argument ``state_dict()`` called in each loader
worker (:mod:`training.datapipe.streams`):

* :mod:`.litdata` — Lightning's ``litdata.StreamingDataset``: ``state_dict(num_samples_yielded,
  num_workers, batch_size)``, computed in the training process (it raises in a loader worker);
* :mod:`.mosaic` — MosaicML's ``streaming.StreamingDataset``: ``state_dict(num_samples,
  from_beginning)`` in the training process; after a resume it deals the rest of one global order
  out again from loader worker 0;
* :mod:`.hf_datasets` — Hugging Face ``datasets.IterableDataset`` (``.map`` augmentation
  included): ``state_dict()`` in each loader worker, where ``datasets`` keeps each worker's shards.

Each module imports its library only when an adapter is built (the libraries are the optional
``streams``/``hf`` extras), so importing convoy never needs them.  What an adapter cannot resume
exactly is refused in one line (:class:`training.config.ConfigError`) before a run exists.
"""
