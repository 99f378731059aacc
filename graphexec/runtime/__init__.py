"""How the library meets the machine: the one CUDA-graph capture routine, the CPU thread
count, and whether Triton runs under its interpreter. Every room above may use these."""
