"""Engine memory under tags: release it, re-wake it into the same tensors, verify it.

The only layer besides the reference engine that imports torch. Modules, lowest first:

    measure          RSS, malloc_trim, CUDA allocator and mem_get_info
    checksum         bit-exact tensor checksum on the tensor's own device
    fill             filling released (untouched) host memory: pages faulted in ahead, threads
    safetensors_io   safetensors files: the writer, and a reader that fills existing tensors
    layout           registered tensors grouped by storage (Block), validation
    registry         MemoryRegistry: register, plan, release, rewake (verified)

Neighbours: ``errors``, ``clock`` and ``protocol`` (``MemoryReport``, ``DeviceMemory``) below;
above, the agent drives a ``MemoryRegistry`` from its prepare and restore steps (through its
``MemoryManager`` interface), and the reference engine registers its weights and KV pool and
writes its weights file.
"""

from ckpt_controller.memory.checksum import tensor_checksum
from ckpt_controller.memory.measure import CudaUsage, cuda_used, rss_bytes, trim_host_heap
from ckpt_controller.memory.layout import TagAction
from ckpt_controller.memory.registry import KV_CACHE, WEIGHTS, MemoryRegistry, ReleasePlan
from ckpt_controller.memory.safetensors_io import SafetensorsEntry, SafetensorsFile, save_file

__all__ = [
    "KV_CACHE",
    "WEIGHTS",
    "CudaUsage",
    "MemoryRegistry",
    "ReleasePlan",
    "SafetensorsEntry",
    "SafetensorsFile",
    "TagAction",
    "cuda_used",
    "rss_bytes",
    "save_file",
    "tensor_checksum",
    "trim_host_heap",
]
