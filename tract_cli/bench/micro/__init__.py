"""Micro-benchmarks (`tract microbench`, and the GPU data path): one part of the system at a time, against its reference."""
