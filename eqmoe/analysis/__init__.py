"""Reports computed from configs and models: parameter counts."""

from eqmoe.analysis.params import ParamRow, count_parameters, parameter_table

__all__ = ["ParamRow", "count_parameters", "parameter_table"]
