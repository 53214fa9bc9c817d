"""Processes and devices: torchrun launch and Slurm scripts (launch), torch.distributed set-up (distributed), the device (device), the run-folder lock (run_lock)."""
