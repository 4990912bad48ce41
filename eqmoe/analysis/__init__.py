"""Reports computed from configs and models: parameter counts, routing statistics, held-out evaluation."""

from eqmoe.analysis.params import ParamRow, count_mtp, count_parameters, parameter_table
from eqmoe.analysis.routing import RoutingSummary, accumulate, normalized_mutual_information, summarize

__all__ = [
    "ParamRow",
    "RoutingSummary",
    "accumulate",
    "count_mtp",
    "count_parameters",
    "normalized_mutual_information",
    "parameter_table",
    "summarize",
]
