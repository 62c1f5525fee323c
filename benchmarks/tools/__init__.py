"""Tools the benchmarks use: builds of peer code and emulated hardware (never imported by the library)."""
