"""The runtime's size thresholds that the cost model (`transpiler.cost`, which sits below
the RPC layer) prices by: the malloc thresholds the RPC processes set (`ops.rpc.malloc`)
and the smallest grad a sync pserver sums on arrival (`ops.rpc.arrival_sum`), here so that
both read the same figures."""

# bytes: a buffer whose malloc chunk (its size plus glibc's 16-byte header) is below this
# comes from the heap, so its pages are reused step after step; at or above it, glibc maps
# it fresh (zeroed) and unmaps it when freed. 2047 MB, the largest whole MB mallopt takes
# (an int): a 1 GB param's buffers (exactly 1 << 30 bytes, which the 1 GB threshold before
# this sent to mmap by their header's 16 bytes) are reused; a buffer of 2 GB or more is not.
MMAP_THRESHOLD = (2 << 30) - (1 << 20)
TRIM_THRESHOLD = (2 << 30) - 1  # bytes free at a heap's top before glibc returns them (mallopt takes an int)
# What older glibc (2.26's source, for one) still accepts as an mmap threshold: it refuses
# one above HEAP_MAX_SIZE / 2 (32 MB on 64-bit); glibc 2.36 takes any int. `ops.rpc.malloc`
# falls back to it when the big one is refused.
CAPPED_MMAP_THRESHOLD = 32 << 20
# bytes: a sync pserver sums a trainer's grad this big or bigger as it arrives
# (`ops.rpc.arrival_sum.MIN_BYTES`); a smaller one keeps its `sum` op (the bulk channel's own threshold)
ARRIVAL_SUM_MIN_BYTES = 256 << 10
