"""The compiler layer: the only code that runs the TVM compiler (``import tvm``).

``build`` (spec -> scheduled module -> compiled executable), ``tune`` (MetaSchedule search),
``cuda_pack`` (nvcc, SASS, exporting CUDA libraries), ``pack_writer`` (kernel packs),
``wgmma`` (the Hopper kernel's build). The kernel math (``kernels/``) and schedules
(``schedules/``) it lowers import ``tvm`` only inside their functions.
"""
