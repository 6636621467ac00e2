"""Device-side copies for the connectors (torch; CUDA-asynchronous where a GPU is present).

- ``copy``: whole-block copies between the KV cache and the host slab (``SlabCopier``).
- ``copy2d``: strided 2-D host -> device copies (``cuMemcpy2DAsync`` on CUDA, a torch copy
  elsewhere) for one layer of a run of slots.
- ``decode``: loads of compressed blocks (host slab -> staging -> the Triton decoder).
- ``kv_compress``: the lossless compression of 2-byte KV blocks (``Hi4Codec``).
- ``slab_runs``: runs of slab slots at a constant stride (one copy for many blocks).

Importing the package itself imports nothing.
"""
