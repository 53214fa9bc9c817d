"""Numeric precision: bf16/fp16/fp32 autocast and loss scaling (mixed), float8 matmuls (fp8)."""
