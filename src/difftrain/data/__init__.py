"""The data path, in two parts that share only the ``Batch`` (``batch``) and the curriculum of stages and buckets
(``curriculum``):

- ``prepare``: the offline job that turns raw image-caption sources into the latent store: reading sources
  (``prepare.ingest``, with tar and file references in ``prepare.refs``), curation (``prepare.curate``,
  ``prepare.curation_ops``, ``prepare.near_dup``), the Ray Data plan (``prepare.plan``) and the job itself
  (``prepare.job``). It runs before training and never inside it.
- ``store``: what training reads: the Lance tables' layout and cache keys (``store.tables``), the elastic loader
  (``store.loader``, with its index and streams in ``store.streams``), the node-local fragment cache
  (``store.node_cache``, ``store.cache_folder``) and the encoded preference pairs (``store.pairs``,
  ``store.pairs_loader``).

It knows no built-in world: the shapes world is ``difftrain.shapes``, and ``difftrain.sources`` picks the
data source a config names.

A *data source* is an iterator that yields, per optimizer step, this data rank's micro-batches of the
step's global batch (a list of ``Batch``) and has ``state_dict`` / ``load_state_dict`` (positions of
batches consumed by the optimizer).
"""
