"""Captured steps: decode / verify / draft CUDA graphs per batch bucket (``decode``), piecewise
prefill graphs (``prefill``), and the start-up warm-up of prefill kernels (``warmup``)."""
