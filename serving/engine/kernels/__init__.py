"""The engine's own kernels, and the code that builds, loads or chooses them.

CPU: the C++ decode-attention kernel (`csrc/`, loaded by `cpu_attention.py`) and oneDNN-packed matmul
weights (`cpu_linear.py`). CUDA: FlexAttention over the paged cache (`paged_attention.py`), the Triton kernels
(`triton_kernels.py`) and the custom ops that put them on the model's path (`gpu_kernels.py`).

Weight quantization (`serving/engine/quant.py`) stays beside the loader: it converts weights at load time and
its modules call torch's own int8 and fp8 matmuls, so it defines no kernel of ours.
"""
