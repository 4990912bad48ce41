"""RoPE scaling as Hugging Face configs carry it (``linear``, ``yarn``, ``llama3``): the validated config value;
:mod:`eqmoe.nn.rope` turns it into frequencies."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from eqmoe._checks import _check, _one_of
from eqmoe._checks import is_number as _is_number

# What each rope type reads besides ``factor`` (transformers' ``_validate_<type>_rope_parameters``):
# (fields it needs, fields it may have).
_ROPE_TYPE_FIELDS = {
    "linear": ((), ()),
    "yarn": (
        ("original_max_position_embeddings",),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    "llama3": (("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
}
ROPE_TYPES = tuple(_ROPE_TYPE_FIELDS)


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE is stretched beyond the context it was trained on, as a Hugging Face ``rope_parameters``
    says it (transformers' ``ROPE_INIT_FUNCTIONS``); ``AttentionConfig.rope_scaling=None`` is plain RoPE.
    :func:`eqmoe.nn.rope.rope_frequencies` turns it into inverse frequencies and a cos/sin scale.

    - ``"linear"``: every frequency divided by ``factor`` (positions interpolated ``factor`` times closer).
    - ``"yarn"``: frequencies that turn fewer than ``beta_slow`` times over ``original_max_position_embeddings``
      divided by ``factor``, those turning more than ``beta_fast`` times kept, a linear ramp between;
      cos and sin multiplied by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or
      ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set). ``factor=None``
      means ``max_position_embeddings / original_max_position_embeddings``.
    - ``"llama3"``: wavelengths above ``original / low_freq_factor`` divided by ``factor``, below
      ``original / high_freq_factor`` kept, a smooth blend between.

    A ``None`` field is one ``config.json`` leaves out, so transformers' default applies and an export
    leaves it out too. ``max_position_embeddings`` is the context the scaled model is meant for (Hugging
    Face's top-level field); only ``yarn`` with ``factor=None`` reads it, it is kept so exports write it back.
    """

    rope_type: Literal["linear", "yarn", "llama3"]
    factor: float | None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def __post_init__(self):
        owner = "RopeScaling"
        _one_of(owner, "rope_type", self.rope_type, ROPE_TYPES)
        needed, optional = _ROPE_TYPE_FIELDS[self.rope_type]
        for item in dataclasses.fields(self):
            name, value = item.name, getattr(self, item.name)
            if value is None:
                _check(name not in needed, owner, name, value, f"a value (rope_type={self.rope_type!r} reads it)")
            elif name not in ("rope_type", "factor", "max_position_embeddings", *needed, *optional):
                _check(False, owner, name, value, f"None (rope_type={self.rope_type!r} does not read it)")
            elif name == "truncate":
                _check(isinstance(value, bool), owner, name, value, "true | false")
            elif name.endswith("max_position_embeddings"):
                _check(isinstance(value, int) and not isinstance(value, bool), owner, name, value, "an integer")
            elif name != "rope_type":
                _check(_is_number(value), owner, name, value, "a number")
        # transformers divides by these (or takes their log); a zero or negative one is never meant
        for name in ("factor", "original_max_position_embeddings", "max_position_embeddings", "attention_factor"):
            value = getattr(self, name)
            _check(value is None or (_is_number(value) and value > 0), owner, name, value, "a positive number")
        # yarn alone derives a missing factor (from max_position_embeddings / original_max_position_embeddings)
        if self.factor is None:
            needs = "a positive number" if self.rope_type != "yarn" else "a positive number, or max_position_embeddings"
            _check(self.rope_type == "yarn" and self.max_position_embeddings is not None, owner, "factor", None, needs)
        if self.rope_type == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            _check(low > 0, owner, "low_freq_factor", low, "a positive number")
            _check(high > low, owner, "high_freq_factor", high, f"a number > low_freq_factor={low}")
