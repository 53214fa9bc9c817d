"""What training reports: the run-logger interface and metrics.jsonl (run_logger), a step's metrics read without stalling the GPU (pending), its memory figures (memory)."""
