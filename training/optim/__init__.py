"""The optimizer (adamw) and the learning-rate schedule (schedule)."""
