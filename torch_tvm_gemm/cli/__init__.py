"""Command modules of ``python -m torch_tvm_gemm`` (see ``__main__.py``)."""
