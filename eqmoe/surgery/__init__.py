"""Model surgery on trained MoE models: expert pruning and merging from calibration statistics."""
