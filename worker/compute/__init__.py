"""The tinygrad backend: a stage's blocks and KV caches on a device (model.py), the matmul kernels that read
weights in their file's precision (linear.py), compiled kernels kept on disk (kernel_cache.py), and the
Slice a worker drives (slice.py). Only this wing imports tinygrad."""
