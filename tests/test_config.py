"""Config validation, the per-layer kinds and their scanned segments, the HF layer-kind rule and the preset
registry.

An invalid value raises ``ValueError`` from ``__post_init__`` naming ``Class.field=value`` and what is
allowed. Under the test suite's jaxtyping + beartype import hook, a value outside a ``Literal`` is already
refused by the type check on ``__init__`` (a ``TypeError``); the ``ValueError`` that users without the hook get
is checked by running ``__post_init__`` directly and, once, in a fresh interpreter without the hook. A config is
pure data: the names of registered parts (strategies, backends, placements, load-balance forms, attention and
FFN kinds) are checked where parts are looked up (:func:`eqmoe.registries.check_names`, run by the model, by
overrides and by every command), with the same one-line errors.
"""

import dataclasses
import re
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eqmoe import presets
from eqmoe.config import (
    AttentionConfig,
    LayerKind,
    LossConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RouterConfig,
    Segment,
    segments,
)
from eqmoe.models.hf_config import layer_kinds_from_hf
from eqmoe.registries import check_names


def _attention(**changes) -> AttentionConfig:
    return AttentionConfig(**{"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, **changes})


def _router(**changes) -> RouterConfig:
    return RouterConfig(**{"num_experts": 4, "top_k": 2, **changes})


def _moe(**changes) -> MoEConfig:
    return MoEConfig(**{"router": _router(), "expert_dim": 8, **changes})


def _model(**changes) -> ModelConfig:
    return ModelConfig(
        **{
            "vocab_size": 10,
            "embed_dim": 16,
            "attention": _attention(),
            "layers": ("dense", "moe") * 2,
            "mlp_dim": 32,
            "moe": _moe(),
            **changes,
        }
    )


def _assert_names(message: str, owner: str, field: str, value: object, *allowed: str) -> None:
    assert f"{owner}.{field}={value!r}" in message, message
    assert "allowed:" in message, message
    for text in allowed:
        assert text in message, message


def test_valid_configs_construct():
    model = _model()
    assert model.num_layers == 4
    assert model.ffn_kinds() == ("dense", "moe", "dense", "moe")
    assert model.layers[0] == LayerKind(attention="gqa", ffn="dense", window=None)
    assert NormConfig().ffn_placement == "pre"


# --- invalid values -----------------------------------------------------------------------------------


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError) as excinfo:
        _attention(num_heads=6, num_kv_heads=4)
    _assert_names(str(excinfo.value), "AttentionConfig", "num_kv_heads", 4, "a divisor of num_heads=6")


def test_top_k_above_num_experts():
    with pytest.raises(ValueError) as excinfo:
        _router(num_experts=4, top_k=5)
    _assert_names(str(excinfo.value), "RouterConfig", "top_k", 5, "1..num_experts=4")


def test_top_k_equal_to_num_experts_is_allowed():
    assert _router(num_experts=4, top_k=4).top_k == 4


@pytest.mark.parametrize("head_dim", [3, 7, 129])
def test_odd_head_dim(head_dim):
    with pytest.raises(ValueError) as excinfo:
        _attention(head_dim=head_dim)
    _assert_names(str(excinfo.value), "AttentionConfig", "head_dim", head_dim, "even")


_POSITIVE_FIELDS = [
    (_attention, "AttentionConfig", "num_heads"),
    (_attention, "AttentionConfig", "num_kv_heads"),
    (_attention, "AttentionConfig", "head_dim"),
    (_attention, "AttentionConfig", "rope_theta"),
    (NormConfig, "NormConfig", "eps"),
    (_router, "RouterConfig", "num_experts"),
    (_router, "RouterConfig", "top_k"),
    (_moe, "MoEConfig", "expert_dim"),
    (_moe, "MoEConfig", "block_size"),
    (_model, "ModelConfig", "vocab_size"),
    (_model, "ModelConfig", "embed_dim"),
    (_model, "ModelConfig", "init_std"),
]


@pytest.mark.parametrize("value", [0, -2])
@pytest.mark.parametrize(("make", "owner", "field"), _POSITIVE_FIELDS, ids=[f"{o}.{f}" for _, o, f in _POSITIVE_FIELDS])
def test_non_positive_sizes(make, owner, field, value):
    if field in ("rope_theta", "eps", "init_std"):
        value = float(value)
    with pytest.raises(ValueError) as excinfo:
        make(**{field: value})
    _assert_names(str(excinfo.value), owner, field, value, "a positive number")


@pytest.mark.parametrize("name", ["load_balance_weight", "router_z_loss_weight", "output_z_loss_weight"])
def test_negative_loss_weights(name):
    with pytest.raises(ValueError) as excinfo:
        LossConfig(**{name: -0.1})
    _assert_names(str(excinfo.value), "LossConfig", name, -0.1, "a number >= 0")


def test_top2_gating_needs_top_k_2_and_capacity_dispatch_needs_a_factor():
    with pytest.raises(ValueError, match="top_k=3 is invalid; allowed: 2 with strategy='top2_gating'"):
        check_names(_model(moe=_moe(router=_router(num_experts=4, top_k=3, strategy="top2_gating"))))
    with pytest.raises(ValueError, match="MoEConfig.dispatch='capacity'"):
        check_names(_model(moe=_moe(dispatch="capacity")))
    with pytest.raises(ValueError, match="capacity_factor=0.0"):
        _router(capacity_factor=0.0)


# Literal-typed fields: (valid instance, owner, field, bad value, every allowed value).
_CHOICES = [
    (NormConfig, "NormConfig", "stats_dtype", "float64", ("float32", "input")),
    (_attention, "AttentionConfig", "qk_norm", "after_norm", ("none", "before_rope", "after_rope")),
    (_attention, "AttentionConfig", "rope_layout", "sideways", ("half_split", "interleaved")),
    (_model, "ModelConfig", "init", "xavier", ("normal", "fan_in")),
    (_model, "ModelConfig", "tied_logit_scale", "sqrt", ("none", "rsqrt_embed")),
    (_model, "ModelConfig", "dtype", "int8", ("float32", "bfloat16", "float16")),
    (_model, "ModelConfig", "param_dtype", "float64", ("float32", "bfloat16", "float16")),
    (_model, "ModelConfig", "remat", "full", ("none", "dots", "offload", "block", "auto")),
]
_CHOICE_IDS = [f"{owner}.{field}" for _, owner, field, _, _ in _CHOICES]


@pytest.mark.parametrize(("make", "owner", "field", "bad", "allowed"), _CHOICES, ids=_CHOICE_IDS)
def test_unknown_string_post_init_names_allowed_values(make, owner, field, bad, allowed):
    """``__post_init__`` itself: the ValueError a caller without the type-check hook gets."""
    config = make()
    object.__setattr__(config, field, bad)
    with pytest.raises(ValueError) as excinfo:
        config.__post_init__()
    _assert_names(str(excinfo.value), owner, field, bad, " | ".join(allowed))


@pytest.mark.parametrize(("make", "owner", "field", "bad", "allowed"), _CHOICES, ids=_CHOICE_IDS)
def test_unknown_string_is_refused_on_construction(make, owner, field, bad, allowed):
    """Through the constructor: refused either by the hook's type check or by ``__post_init__``."""
    with pytest.raises((ValueError, TypeError)) as excinfo:
        make(**{field: bad})
    message = str(excinfo.value)
    assert field in message
    assert bad in message
    assert all(value in message for value in allowed), message


# Fields naming a registered part: (config with the bad name, owner, field, bad value, every allowed value).
_REGISTERED = [
    (
        lambda: _model(moe=_moe(dispatch="megablox")),
        "MoEConfig",
        "dispatch",
        "megablox",
        ("dense", "sorted", "ragged_dot", "capacity", "gmm", "auto"),
    ),
    (
        lambda: _model(norm=NormConfig(ffn_placement="sandwich")),
        "NormConfig",
        "ffn_placement",
        "sandwich",
        ("pre", "post", "hybrid"),
    ),
    (
        lambda: _model(attention=_attention(backend="flash3")),
        "AttentionConfig",
        "backend",
        "flash3",
        ("blockwise", "dense", "cudnn", "splash", "auto"),
    ),
    (
        lambda: _model(moe=_moe(router=_router(strategy="sigmoid"))),
        "RouterConfig",
        "strategy",
        "sigmoid",
        ("softmax_top_k", "top_k_softmax", "top2_gating"),
    ),
    (
        lambda: _model(loss=LossConfig(load_balance="global")),
        "LossConfig",
        "load_balance",
        "global",
        ("hf_pooled", "axlearn_top1", "maxtext_sequence"),
    ),
    (lambda: _model(layers=(LayerKind(attention="latnet"),)), "ModelConfig", "layers[0].attention", "latnet", ("gqa",)),
    (lambda: _model(layers=("dense", "mixture")), "ModelConfig", "layers[1].ffn", "mixture", ("dense", "moe")),
]


@pytest.mark.parametrize(
    ("make", "owner", "field", "bad", "allowed"), _REGISTERED, ids=[f"{o}.{f}" for _, o, f, _, _ in _REGISTERED]
)
def test_registered_names_are_checked_where_parts_are_looked_up(make, owner, field, bad, allowed):
    """The config is pure data and constructs; the model, overrides and commands refuse the name in one line
    naming the registered ones."""
    from eqmoe.config_io import apply_overrides
    from eqmoe.model import Transformer

    config = make()
    with pytest.raises(ValueError) as excinfo:
        check_names(config)
    _assert_names(str(excinfo.value), owner, field, bad, " | ".join(allowed))
    with pytest.raises(ValueError, match=re.escape(f"{owner}.{field}={bad!r} is invalid")):
        Transformer(config, key=__import__("jax").random.key(0))
    with pytest.raises(ValueError, match=re.escape(f"{owner}.{field}={bad!r} is invalid")):
        apply_overrides(_model(), {})  # a valid config passes ...
        apply_overrides(config, {})  # ... and one naming an unregistered part does not


def test_unknown_strings_raise_value_error_without_the_type_check_hook():
    """In a plain interpreter (how users run eqmoe) every invalid value is a ValueError from __post_init__."""
    script = textwrap.dedent("""
        from eqmoe.config import AttentionConfig, LayerKind, MoEConfig, NormConfig, RouterConfig
        cases = [
            lambda: NormConfig(stats_dtype="float64"),
            lambda: AttentionConfig(4, 2, 8, qk_norm="after_norm"),
            lambda: LayerKind("gqa", "moe", window=0),
        ]
        for case in cases:
            try:
                case()
            except ValueError as error:
                print(error)
            else:
                print("ACCEPTED")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines == [
        "NormConfig.stats_dtype='float64' is invalid; allowed: float32 | input",
        "AttentionConfig.qk_norm='after_norm' is invalid; allowed: none | before_rope | after_rope",
        "LayerKind.window=0 is invalid; allowed: None | a positive number of keys",
    ]


def test_moe_layer_without_moe_config():
    with pytest.raises(ValueError) as excinfo:
        check_names(_model(moe=None))
    _assert_names(str(excinfo.value), "ModelConfig", "moe", None, "a MoEConfig", "'moe'")
    assert "layers[1] (moe)" in str(excinfo.value)


def test_all_dense_model_needs_no_moe_config():
    model = _model(moe=None, layers=("dense",) * 3)
    check_names(model)
    assert model.ffn_kinds() == ("dense",) * 3


@pytest.mark.parametrize("mlp_dim", [None, 0, -8])
def test_dense_layer_without_mlp_dim(mlp_dim):
    with pytest.raises(ValueError) as excinfo:
        check_names(_model(mlp_dim=mlp_dim))
    _assert_names(str(excinfo.value), "ModelConfig", "mlp_dim", mlp_dim, "a positive width", "dense")


def test_all_moe_model_needs_no_mlp_dim():
    config = _model(mlp_dim=None, layers=("moe",) * 2)
    check_names(config)
    assert config.num_layers == 2


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_layer_window_not_positive(window):
    with pytest.raises((ValueError, TypeError)) as excinfo:
        LayerKind(window=window)
    assert "window" in str(excinfo.value)


def test_layer_entries_are_layer_kinds_or_ffn_names():
    from eqmoe.config import layer_kind

    assert _model(layers=(LayerKind(ffn="dense", window=8), "moe")).layers == (
        LayerKind("gqa", "dense", 8),
        LayerKind("gqa", "moe", None),
    )
    assert layer_kind({"ffn": "dense", "window": 8}) == LayerKind("gqa", "dense", 8)  # a checkpoint's dictionary
    with pytest.raises(ValueError, match="LayerKind"):
        layer_kind({"ffn": "dense", "size": 8})


def test_model_without_layers():
    with pytest.raises(ValueError) as excinfo:
        _model(layers=())
    _assert_names(str(excinfo.value), "ModelConfig", "layers", (), "a non-empty tuple of LayerKind")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _model().vocab_size = 3  # type: ignore[misc]


def test_replace_revalidates():
    with pytest.raises(ValueError, match=re.escape("ModelConfig.embed_dim=0")):
        _model().replace(embed_dim=0)


# --- the scanned segments derived from the layers ---------------------------------------------------------


def _units(kinds) -> tuple:
    return tuple((tuple(layer.ffn for layer in segment.unit), segment.repeats) for segment in segments(kinds))


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (["moe"] * 48, ((("moe",), 48),)),
        (["dense", "moe"] * 6, ((("dense", "moe"), 6),)),
        (["dense"] + ["moe"] * 5, ((("dense",), 1), (("moe",), 5))),
        (["moe", "moe", "moe", "dense"], ((("moe",), 3), (("dense",), 1))),
        (["dense"], ((("dense",), 1),)),
        (("moe", "dense"), ((("moe",), 1), (("dense",), 1))),
    ],
    ids=["moe*48", "dense-moe*6", "dense+moe*5", "moe*3+dense", "single", "tuple-input"],
)
def test_segments(kinds, expected):
    assert _units(_model(layers=tuple(kinds)).layers) == expected


def test_alternating_sliding_and_full_layers_are_one_scan():
    sliding, full = LayerKind(window=128), LayerKind()
    (segment,) = segments((sliding, full) * 12)
    assert segment == Segment((sliding, full), 12)


def test_segments_empty():
    with pytest.raises(ValueError, match="at least one layer"):
        segments(())


def _expand(found: tuple[Segment, ...]) -> list:
    return [kind for segment in found for _ in range(segment.repeats) for kind in segment.unit]


@given(st.lists(st.sampled_from(["dense", "moe"]), min_size=1, max_size=30))
def test_segments_round_trip(kinds):
    model = _model(layers=tuple(kinds))
    found = segments(model.layers)
    assert [layer.ffn for layer in _expand(found)] == kinds
    assert all(isinstance(segment, Segment) and segment.repeats >= 1 for segment in found)
    assert len(found) <= len(kinds)
    assert list(model.ffn_kinds()) == kinds
    assert model.num_layers == len(kinds)


# --- Hugging Face layer kinds ---------------------------------------------------------------------------


def _hf_rule(num_layers: int, num_experts: int, sparse_step: int, mlp_only: list[int]) -> list[str]:
    return [
        "moe" if (i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0) else "dense"
        for i in range(num_layers)
    ]


@pytest.mark.parametrize(
    ("num_layers", "num_experts", "sparse_step", "mlp_only", "expected"),
    [
        (4, 8, 1, [], ["moe"] * 4),
        (4, 8, 2, [], ["dense", "moe", "dense", "moe"]),
        (3, 8, 1, [0], ["dense", "moe", "moe"]),
        (6, 8, 3, [5], ["dense", "dense", "moe", "dense", "dense", "dense"]),
        (3, 0, 1, [], ["dense"] * 3),
        (4, 8, 1, [1, 3], ["moe", "dense", "moe", "dense"]),
        (2, 8, 1, [7], ["moe", "moe"]),
    ],
)
def test_layer_kinds_from_hf(num_layers, num_experts, sparse_step, mlp_only, expected):
    assert layer_kinds_from_hf(num_layers, num_experts, sparse_step, mlp_only) == expected
    assert expected == _hf_rule(num_layers, num_experts, sparse_step, mlp_only)


# --- presets --------------------------------------------------------------------------------------------


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError) as excinfo:
        presets.get("nope")
    message = str(excinfo.value)
    assert "'nope'" in message
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-moe-tiny"):
        assert name in message
    assert all(name in message for name in presets.names())


def test_known_preset():
    config = presets.get("qwen3-30b-a3b")
    assert config.layers == (LayerKind("gqa", "moe"),) * 48
    assert segments(config.layers) == (Segment((LayerKind("gqa", "moe"),), 48),)
    assert config.moe.router.num_experts == 128 and config.moe.router.top_k == 8


def test_the_suite_checks_array_shapes():
    """The import hook is on (in every xdist worker too): cos and sin tables of different widths fail the
    annotation check."""
    import jax.numpy as jnp
    import jaxtyping

    from eqmoe.nn.rope import apply_rope

    with pytest.raises(jaxtyping.TypeCheckError):
        apply_rope(jnp.zeros((5, 2, 8)), jnp.zeros((5, 6)), jnp.zeros((5, 4)))
