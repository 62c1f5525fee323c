"""Tools the benchmarks share: builds of peer code, storage and network emulation, cgroups and measurement helpers
(never imported by the library)."""
