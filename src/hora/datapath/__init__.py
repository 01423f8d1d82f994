"""What a collective does to tensors, below the engine: the call record and the kinds' steps, fusion, hierarchical
allreduce and its shared memory, Adasum, compression, the reduce ops' arithmetic, CUDA streams, and the one module
that issues c10d calls (:mod:`.c10d`).
"""
