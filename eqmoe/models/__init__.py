"""Model families: published presets and checkpoint name maps, each knowing only ``eqmoe.config``."""
