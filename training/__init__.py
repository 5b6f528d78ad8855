"""The training loop's parts, one module each: config schema, device and dtype, optimizer + LR schedule, checkpoints,
metrics, faults, data parallelism, and the loop itself (loop.py)."""
