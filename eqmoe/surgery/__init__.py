"""Model surgery: dense checkpoints upcycled into MoE ones, and a trained MoE's experts pruned or merged from
calibration statistics."""
