"""The op library: what each op is (catalogue), how it runs (numpy kernels), and the
executor that runs a block."""
