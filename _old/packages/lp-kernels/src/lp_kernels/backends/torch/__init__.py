"""The ``torch`` backend: chunked torch ops, CPU and GPU (:mod:`.linear`, :mod:`.deterministic`)."""
