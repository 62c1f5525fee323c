"""Compute kernels. Each fast path (Triton, numba) has a plain-torch reference beside it computing the same function."""
