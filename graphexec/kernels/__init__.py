"""The model's kernels: the batch-invariant GEMM (split-K tree, tiles), its row-parallel
form, attention, the fused norm / rotary / SwiGLU ops, and the CPU route; `ops.ForwardOps`
picks them per device."""
