"""GPU kernels (Triton): KV-cache writes and paged attention for decode and prefill."""
