"""The ``triton`` backend: fused logits and softmax statistics (CUDA, or CPU under
``TRITON_INTERPRET=1``). :mod:`.function` holds the default path's autograd Function and
the docstring that draws its data flow; :mod:`.deterministic` the TP-invariant one."""
