"""``auto`` by measurement: the MoE dispatch and the attention backend a run uses, timed on its own shapes.

Before a run's first compile, each ``"auto"`` execution field (``moe.dispatch``, ``attention.backend``) is
resolved by timing every eligible registered backend on the run's shapes (a MoE layer, or an attention call,
over the tokens of one micro-batch; forward and backward for training): a few calls each after a warm-up call,
the fastest median wins. Each candidate runs as ``LAYERS`` layers run as the model runs its layers
(:func:`eqmoe.autotune.workloads.as_layers`: scanned, rematerialised as the config says), so that what it keeps
for the backward pass costs what it costs in the model. A backend is eligible when it can run the config (its own
check, a trace that does not refuse) and keeps memory in the order of the best: a dispatch backend whose planned
activations exceed ``MEMORY_FACTOR`` times the smallest is not timed, and ``dense`` attention only when a whole
row fits in one tile (``seq <= block_size``); it keeps the probabilities for the backward pass, which the blockwise
kernel recomputes. The timing is :mod:`eqmoe.autotune.timing`'s, the timed programs :mod:`eqmoe.autotune.workloads`'.

The choice and its timings are printed in one line per field, cached per (device kind, shapes, dtype,
candidates) in ``auto_backends.json`` under :func:`eqmoe.cache.cache_root`, and recorded in the run's metadata,
so a resumed run takes the recorded choice and stays exact. A field set to a backend's name is never touched.
``EQMOE_AUTO=rule`` keeps the static rules (:func:`eqmoe.nn.dispatch.backend_name`,
:func:`eqmoe.nn.attention_backends.backend_name`) without timing anything: runs that must not depend on the
machine's timings (the test suite) set it. On a mesh of several devices the rules apply too: the layers then run
sharded, which one device's timing does not describe.
"""

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eqmoe.autotune.timing import ENV, Measurement, cached_or_timed
from eqmoe.autotune.workloads import ATTENTION, BLOCK, DISPATCH, TILES, AttentionWorkload, DispatchWorkload
from eqmoe.cache import cache_root
from eqmoe.config import ModelConfig
from eqmoe.registries import ATTENTION_BACKENDS, DISPATCH_BACKENDS

__all__ = ["ENV", "Measurement", "Resolved", "resolve"]


@dataclass(frozen=True)
class Resolved:
    """A config whose ``auto`` fields name backends, and how each was chosen."""

    config: ModelConfig
    choices: dict[str, str] = field(default_factory=dict)
    measurements: tuple[Measurement, ...] = ()


def resolve(
    config: ModelConfig,
    rows: int,
    seq: int,
    *,
    training: bool = True,
    recorded: dict[str, str] | None = None,
    devices: int = 1,
    cache: Path | None = None,
    report=None,
) -> Resolved:
    """``config`` with its ``auto`` backends chosen for ``rows`` sequences of ``seq`` tokens per device.
    ``recorded``: the choices a run stored (taken as they are); ``devices``: the devices the run spans (above one,
    the rules apply); ``cache``: the cache file (default under :func:`eqmoe.cache.cache_root`); ``report``: where
    each line goes (default: standard error)."""
    recorded = recorded or {}
    report = report or (lambda line: print(line, file=sys.stderr))
    use_rule = os.environ.get(ENV, "measure") == "rule" or devices > 1
    cache = cache or cache_root() / "auto_backends.json"
    measurements = []
    if config.moe is not None and config.moe.dispatch == "auto":
        if DISPATCH in recorded:
            measurements.append(_recorded(DISPATCH, recorded, TILES))
        elif not use_rule:  # the rule applies where the layer runs, as it always has
            measurements.append(cached_or_timed(DispatchWorkload(config, rows * seq, training), cache))
    if _has_softmax_attention(config) and config.attention.backend == "auto":
        if ATTENTION in recorded:
            measurements.append(_recorded(ATTENTION, recorded, BLOCK))
        elif not use_rule:
            measurements.append(cached_or_timed(AttentionWorkload(config, rows, seq, training), cache))
    for measurement in measurements:
        report(measurement.line())
    choices = {name: value for m in measurements for name, value in m.choices().items()}
    return Resolved(_with_choices(config, choices), choices, tuple(measurements))


def _recorded(field: str, recorded: dict[str, str], setting: str) -> Measurement:
    settings = {setting: recorded[setting]} if setting in recorded else {}
    return Measurement(field, recorded[field], "recorded by the run", settings=settings)


def _with_choices(config: ModelConfig, choices: dict[str, str]) -> ModelConfig:
    if DISPATCH in choices:
        DISPATCH_BACKENDS.get(choices[DISPATCH])  # an unknown recorded name raises, naming the registered ones
        moe = dataclasses.replace(config.moe, dispatch=choices[DISPATCH])
        if TILES in choices:
            moe = dataclasses.replace(moe, tiles=tuple(int(t) for t in choices[TILES].split(",")))
        config = dataclasses.replace(config, moe=moe)
    if ATTENTION in choices:
        ATTENTION_BACKENDS.get(choices[ATTENTION])
        attention = dataclasses.replace(config.attention, backend=choices[ATTENTION])
        if BLOCK in choices:
            attention = dataclasses.replace(attention, block_size=int(choices[BLOCK]))
        config = dataclasses.replace(config, attention=attention)
    return config


def _has_softmax_attention(config: ModelConfig) -> bool:
    return any(kind.attention != "gated_deltanet" for kind in config.layers)
