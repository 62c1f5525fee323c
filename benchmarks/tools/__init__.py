"""Tools the benchmarks share: storage doubles, device emulation and measurement helpers (not part of the library)."""
