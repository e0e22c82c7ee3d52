"""lp's backends: ``torch`` (:mod:`.torch`, chunked torch ops, every device) and ``triton``
(:mod:`.triton`, the fused kernels; CUDA, or CPU under Triton's interpreter). The choice
between them is :mod:`.resolve`.

This ``__init__`` imports nothing: its subpackages are named ``torch`` and ``triton``, and
importing a subpackage binds its name in this namespace, where it would shadow the real
``torch`` / ``triton`` of any code here.
"""
