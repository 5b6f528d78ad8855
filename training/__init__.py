"""The training loop's parts, one module each: config schema, optimizer + LR schedule, checkpoints, metrics, loop."""
