"""Parallel layouts: process groups (groups.py), data parallelism, tensor-parallel layers."""
