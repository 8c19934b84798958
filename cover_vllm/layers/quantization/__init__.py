"""The quantized weight formats and the matmuls that run them: codes and scales, activation
codes and w8a8's input rotation (format.py), the weight-only kernels and the quantized storage
of one projection group (kernels.py), and the W8A8 kernels (w8a8_kernels.py). Turning a model's
projections into these and loading them is models/quantization.py."""
