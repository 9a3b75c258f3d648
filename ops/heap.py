"""The malloc thresholds the RPC processes set (`ops.rpc.malloc`), here so that the cost
model (`transpiler.cost`), which sits below the RPC layer, reads the same figures."""

# bytes: a buffer whose malloc chunk (its size plus glibc's 16-byte header) is below this
# comes from the heap, so its pages are reused step after step; at or above it, glibc maps
# it fresh (zeroed) and unmaps it when freed. 1536 MB: a 1 GB param's buffers (exactly
# 1 << 30 bytes, which a 1 GB threshold sent to mmap by their header's 16 bytes) are reused,
# and a buffer of 1.5 GB or more is not. Not 2047 MB, the largest whole MB mallopt's int
# takes: with it a 256 MB trainer whose weight is released before its grad is computed
# (`ops.executor.Liveness.released`) peaked at 576 MB instead of 322, and 1025, 1536 and
# 1900 MB all gave 322 (`vs_paddle18.py --ours-only --case wide256`, 2026-11-27; why glibc
# keeps the weight's old chunk apart near 2 GB was not found).
MMAP_THRESHOLD = 3 << 29
TRIM_THRESHOLD = (2 << 30) - 1  # bytes free at a heap's top before glibc returns them (mallopt takes an int)
# What older glibc (2.26's source, for one) still accepts as an mmap threshold: it refuses
# one above HEAP_MAX_SIZE / 2 (32 MB on 64-bit); glibc 2.36 takes any int. `ops.rpc.malloc`
# falls back to it when the big one is refused.
CAPPED_MMAP_THRESHOLD = 32 << 20
