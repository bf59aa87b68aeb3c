"""What training reads: the latent store's tables (``tables``), its elastic loader (``loader``; index and streams in
``streams``), the node-local cache of its fragments (``node_cache``, ``cache_folder``) and the encoded preference
pairs DPO trains on (``pairs``, ``pairs_loader``)."""
