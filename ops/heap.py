"""The malloc thresholds the RPC processes set (`ops.rpc.malloc`), here so that the cost
model (`transpiler.cost`), which sits below the RPC layer, reads the same figures."""

MMAP_THRESHOLD = 1 << 30  # bytes: allocations below come from the heap, so their pages are reused
TRIM_THRESHOLD = (2 << 30) - 1  # bytes free at a heap's top before glibc returns them (mallopt takes an int)
