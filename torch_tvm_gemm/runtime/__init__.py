"""The runtime layer: loading kernels with ``tvm_ffi`` and the TVM runtime library only.

``loader`` (the runtime library, loading a kernel file, torch's thread pool), ``records``
(reading tuning verdicts), ``cache`` (the on-disk kernel cache), ``pack_loader`` (CUDA kernel
packs), ``table`` (the in-memory kernel table, the one entry point: ``get_kernel``),
``huge_pages`` (the ops' large outputs, advised as transparent huge pages).
Nothing here imports the TVM compiler; a missing kernel is built through one request.
"""
