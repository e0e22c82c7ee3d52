"""Tensor-parallel plumbing of lp's ops (vocabulary shards over a ``torch.distributed`` group).

- :mod:`.layout`: the once-per-layout check of the shards across ranks, and its cache.
- :mod:`.collectives`: the forward's all-gather of statistics and the backward's
  all-reduces (``grad_hidden`` partials, the global ``max |W|`` of the fixed-point sum).
- :mod:`.halo`: ``deterministic=True``'s tile ownership and the point-to-point exchange
  of the weight rows (and their gradients) of tiles that cross a shard bound.
"""
