"""What a collective does to tensors, below the engine: each kind's steps (:mod:`.kinds`), the wire buffer and
compression (:mod:`.wire`), fusion's buffer, hierarchical allreduce and its shared memory, the reduce ops'
arithmetic, CUDA streams, and the one module that issues c10d calls (:mod:`.c10d`).
"""
