"""The data path: raw image-caption sources (``ingest``), curation (``curate``), the prepare job on Ray Data
(``prepare``), the Lance latent store (``store``), the curriculum of stages and buckets (``curriculum``), the
store's elastic loader (``store_loader``) and the task-agnostic ``Batch`` (``batch``).

It knows no built-in world: the shapes world is ``difftrain.shapes``, and ``difftrain.sources`` picks the
data source a config names.

A *data source* is an iterator that yields, per optimizer step, this data rank's micro-batches of the
step's global batch (a list of ``Batch``) and has ``state_dict`` / ``load_state_dict`` (positions of
batches consumed by the optimizer).
"""
