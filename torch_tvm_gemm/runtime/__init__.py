"""The runtime layer: loading kernels with ``tvm_ffi`` and the TVM runtime library only.

``loader`` (the runtime library, loading a kernel file, torch's thread pool), ``records``
(reading tuning verdicts), ``cache`` (the on-disk kernel cache), ``pack_loader`` (CUDA kernel
packs), ``table`` (the in-memory kernel table, the one entry point: ``get_kernel``),
``output_pool`` (the ops' large CPU outputs, a pool of huge-page blocks).
Nothing here imports the TVM compiler; a missing kernel is built through one request.
"""
