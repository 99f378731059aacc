"""How the library meets the machine: the one CUDA-graph capture routine, the CPU thread
count, whether Triton is installed (`triton_import`: a stand-in where it has no wheels) and
whether it runs under its interpreter. Every room above may use these."""
