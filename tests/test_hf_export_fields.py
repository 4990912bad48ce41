"""Export never drops a decoder field silently: for every Hugging Face family and every architecture field at a
value other than its default, ``config_to_hf`` either refuses naming a changed field, or writes a config.json
that reads back as a config of the same function."""

import dataclasses

import pytest

from eqmoe import presets
from eqmoe.config_io import apply_overrides
from eqmoe.models import FAMILIES

# One or more non-default values of every architecture field a family might or might not express (the widths,
# depth, vocabulary and RoPE base are written by every family and covered by the family tests).
CHANGES = {
    "attention.rope_layout": [{"attention.rope_layout": "interleaved"}],
    "attention.qk_norm": [{"attention.qk_norm": "none"}, {"attention.qk_norm": "after_rope"}],
    "attention.qk_norm_scope": [{"attention.qk_norm": "before_rope", "attention.qk_norm_scope": "projection"}],
    "attention.rotary_dim": [{"attention.rotary_dim": 64}],
    "attention.bias": [{"attention.bias": "qkv"}, {"attention.bias": "qkvo"}],
    "attention.clip_qkv": [{"attention.clip_qkv": 4.0}],
    "moe.router.strategy": [
        {"moe.router.strategy": "softmax_top_k"},
        {"moe.router.strategy": "top_k_softmax"},
        {"moe.router.strategy": "sigmoid_top_k", "moe.router.bias_update_rate": 0.001},
    ],
    "moe.router.renormalize": [{"moe.router.renormalize": False}, {"moe.router.renormalize": True}],
    "moe.router.capacity_factor": [{"moe.router.capacity_factor": 2.0}],
    "moe.router.bias_update_rate": [{"moe.router.bias_update_rate": 0.002}],
    "moe.router.routed_scaling_factor": [{"moe.router.routed_scaling_factor": 2.5}],
    "moe.router.expert_groups": [{"moe.router.expert_groups": 4, "moe.router.expert_groups_kept": 2}],
    "moe.shared_experts": [{"moe.shared_experts": 2}, {"moe.shared_experts": 1, "moe.shared_expert_gate": True}],
    "moe.shared_expert_dim": [{"moe.shared_experts": 1, "moe.shared_expert_dim": 96}],
    "norm.ffn_placement": [{"norm.ffn_placement": "post"}, {"norm.ffn_placement": "hybrid"}],
    "norm.stats_dtype": [{"norm.stats_dtype": "input"}],
    "tied_logit_scale": [{"tie_embeddings": True, "tied_logit_scale": "rsqrt_embed"}],
}
CASES = [
    (family.name, field, index)
    for _, family in FAMILIES.items()
    if family.hf_model_type is not None
    for field, changes in CHANGES.items()
    for index in range(len(changes))
]


def _same_function(config):
    """``config`` with what config.json does not distinguish made canonical: several shared experts are one SwiGLU
    of their summed width (the same parameters and function), and ``bias_update_rate`` is how eqmoe trains the
    selection bias, which no config.json holds (a reader gives its family's default)."""
    moe = config.moe
    if moe is None:
        return config
    if moe.shared_experts:
        moe = dataclasses.replace(moe, shared_experts=1, shared_expert_dim=moe.shared_width)
    return config.replace(moe=dataclasses.replace(moe, router=dataclasses.replace(moe.router, bias_update_rate=0.0)))


def _smallest_preset(family) -> str:
    return min(family.presets, key=lambda name: family.presets[name].embed_dim * family.presets[name].num_layers)


@pytest.mark.parametrize(("family_name", "field", "index"), CASES)
def test_export_refuses_or_keeps_every_field(family_name, field, index):
    family = dict(FAMILIES.items())[family_name]
    base = presets.get(_smallest_preset(family))
    overrides = CHANGES[field][index]
    try:
        config = apply_overrides(base, overrides)
    except ValueError:
        pytest.skip(f"{overrides} is not a valid change of {family_name}'s preset")
    if config == base:
        pytest.skip("already the preset's value")
    try:
        written = family.config_to_hf(config)
    except ValueError as error:
        message = str(error)
        assert "\n" not in message
        assert any(path in message for path in overrides) or "layers" in message, message
        return
    read_back = family.config_from_hf(written, "config.json")
    assert _same_function(read_back) == _same_function(config.replace(dtype=base.dtype))
