"""Golden record of what every parameter is taken to be: its logical axes (sharding), weight decay, mup
scaling, optimizer state vs trained, routed vs shared (parameter counts), for every preset and the
config variants that add parameters. Recorded while these were still guessed from parameter names, so
the declared roles (eqmoe.nn.param) are shown to keep every preset's sharding and optimizer masks.

The record names parameters as they were when every matrix was a bare array field (``attention.wq``,
``ffn.router.weight``); each matrix is now a :class:`eqmoe.nn.Linear` carrying its weight and bias, so its path
gains ``.weight`` / ``.bias``. :data:`RENAMED` spells that renaming out; every role, axis and shape is compared
unchanged.
"""

import dataclasses
import json
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jaxtyping import Array, Float

from eqmoe import parallel, presets
from eqmoe.analysis.params import abstract_model
from eqmoe.config import ModelConfig
from eqmoe.model import Transformer
from eqmoe.nn import Layer, ParamInfo, Role, param, param_info, param_infos
from eqmoe.train.optimizer import OptimizerConfig, decays, make_optimizer
from eqmoe.train.state import init_state

GOLDEN = Path(__file__).parent / "golden" / "param_roles.json"

# The golden record's paths -> today's: each matrix became a Linear holding its weight (and bias).
RENAMED = [
    (re.compile(r"\.attention\.w([qkvo])$"), r".attention.\1.weight"),
    (re.compile(r"\.attention\.b([qkvo])$"), r".attention.\1.bias"),
    (re.compile(r"\.w_(gate|up|down)$"), r".\1.weight"),
    (re.compile(r"\.router\.weight$"), r".router.gate.weight"),
    (re.compile(r"\.shared_gate$"), r".shared_gate.weight"),
]


def renamed(path: str) -> str:
    for pattern, replacement in RENAMED:
        path = pattern.sub(replacement, path)
    return path


def _variants() -> dict[str, ModelConfig]:
    configs = {name: presets.get(name) for name in presets.names()}
    micro = presets.get("qwen3-moe-micro")
    router = dataclasses.replace(micro.moe.router, bias_update_rate=1e-3)
    configs["qwen3-moe-micro+tied"] = micro.replace(tie_embeddings=True)
    configs["qwen3-moe-micro+router-bias"] = micro.replace(moe=dataclasses.replace(micro.moe, router=router))
    dense_first = tuple(("dense", "moe", "moe", "dense"))
    configs["qwen3-moe-micro+dense-layers"] = micro.replace(layers=dense_first)
    attention = dataclasses.replace(micro.attention, bias="qkvo", qk_norm_scope="projection", rotary_dim=8)
    shared = dataclasses.replace(micro.moe, shared_experts=2, shared_expert_dim=32, shared_expert_gate=True)
    configs["qwen3-moe-micro+biases-projection-norm"] = micro.replace(attention=attention)
    configs["qwen3-moe-micro+shared-experts"] = micro.replace(moe=shared)
    return configs


def role_table(config: ModelConfig) -> dict[str, dict]:
    """Per array leaf of the model: shape, logical axes and the flags the optimizer and report derive."""
    model = abstract_model(config)
    optimizer_config = OptimizerConfig()
    table = {}
    for (key_path, leaf), info in zip(jax.tree_util.tree_leaves_with_path(model), param_infos(model), strict=True):
        path = jax.tree_util.keystr(key_path, simple=True, separator=".")
        table[path] = {
            "shape": list(leaf.shape),
            "axes": list(info.axes),
            "decay": decays(optimizer_config, info.role),
            "mup": info.role.hidden_matrix,
            "state": not info.role.trained,
            "routed": info.role.routed,
        }
    return table


def all_tables() -> dict[str, dict]:
    return {name: role_table(config) for name, config in sorted(_variants().items())}


def _mesh_axes(axes: list) -> list[tuple[str, ...]]:
    return [parallel.DEFAULT_RULES.get(axis, ()) if axis else () for axis in axes]


def test_parameter_roles_match_the_golden_record():
    """Every leaf of every preset keeps its shape, its decay / mup / state / routed flags, every logical axis
    the record names, and so its sharding under the default rules. Axes the record left unnamed (norm scales
    and the router's stacked and per-expert axes, which were replicated as unknown) may now carry a name,
    provided that name is replicated too."""
    golden = json.loads(GOLDEN.read_text())
    golden = {name: {renamed(path): row for path, row in table.items()} for name, table in golden.items()}
    tables = json.loads(json.dumps(all_tables()))  # tuples and None as JSON holds them
    assert set(golden) <= set(tables)  # presets added since (DeepSeek's) declared their roles from the start
    for name, table in ((name, tables[name]) for name in golden):
        assert sorted(table) == sorted(golden[name]), name
        for path, row in table.items():
            recorded = golden[name][path]
            where = f"{name}: {path}"
            flags = {k: v for k, v in row.items() if k != "axes"}
            assert flags == {k: v for k, v in recorded.items() if k != "axes"}, where
            assert len(row["axes"]) == len(recorded["axes"]), where
            assert all(old in (None, new) for old, new in zip(recorded["axes"], row["axes"], strict=True)), where
            assert _mesh_axes(row["axes"]) == _mesh_axes(recorded["axes"]), where


class _Undeclared(Layer):
    w_in: Float[Array, "embed mlp"]

    def __init__(self):
        self.w_in = jnp.zeros((4, 8))


class _HiddenInTuple(Layer):
    scale: Float[Array, " norm"] = param(Role.NORM)
    extra: tuple

    def __init__(self):
        self.scale = jnp.ones(4)
        self.extra = (jnp.zeros(3),)


class _NoAxes(Layer):
    w: jax.Array = param(Role.MLP)

    def __init__(self):
        self.w = jnp.zeros((4, 8))


class _UnknownAxis(Layer):
    w: Float[Array, "embed widths"] = param(Role.MLP)

    def __init__(self):
        self.w = jnp.zeros((4, 8))


def test_a_parameter_without_a_declared_role_is_refused_when_built():
    with pytest.raises(TypeError, match=r"_Undeclared\.w_in holds an array with no declared role"):
        _Undeclared()
    with pytest.raises(TypeError, match=r"_HiddenInTuple\.extra holds an array with no declared role"):
        _HiddenInTuple()
    with pytest.raises(TypeError, match=r"_NoAxes\.w is declared a parameter but its annotation names no axes"):
        _NoAxes()


def test_an_axis_name_without_a_sharding_rule_is_an_error():
    parallelism = parallel.make_parallelism("data=1", devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="logical axis 'widths', which has no sharding rule"):
        parallel.tree_shardings(_UnknownAxis(), parallelism)


def test_optimizer_moments_carry_their_parameters_roles_and_other_arrays_none():
    """The walker reads roles through any tree holding layers: a train state's Adam moments are
    model-shaped, so they shard like their parameters; counters and keys are not parameters."""
    layers = tuple(("dense", "moe"))
    config = presets.get("qwen3-moe-micro").replace(moe=_biased_moe(), layers=layers, mlp_dim=32)
    model = Transformer(config, key=jax.random.key(0))
    optimizer, _ = make_optimizer(OptimizerConfig(mup_base_dim=32), eqx.filter(model, eqx.is_array), embed_dim=64)
    state = init_state(model, optimizer, key=jax.random.key(1))
    infos = param_info(state)
    model_infos = param_infos(state.model)
    moments = [
        leaf
        for leaf in jax.tree.leaves(infos.opt_state, is_leaf=lambda x: isinstance(x, Layer))
        if isinstance(leaf, Layer)
    ]
    assert moments, "the Adam moments should be model-shaped layers"
    for moment in moments:
        moment_infos = [info for info in jax.tree.leaves(moment) if isinstance(info, ParamInfo)]
        by_role = {(i.role, i.axes) for i in moment_infos}
        assert by_role <= {(i.role, i.axes) for i in model_infos}
    assert infos.step == ParamInfo(None, ())
    assert {i.role for i in model_infos} >= {Role.ROUTER_BIAS, Role.MLP, Role.EXPERT, Role.NORM}
    # the router bias is state: its optimizer label is "state" and its update zero
    labels = jax.tree.leaves(jax.tree.map(lambda i: i.role.trained, param_info(eqx.filter(model, eqx.is_array))))
    assert labels.count(False) == 1


def _biased_moe():
    micro = presets.get("qwen3-moe-micro")
    return dataclasses.replace(micro.moe, router=dataclasses.replace(micro.moe.router, bias_update_rate=1e-3))


if __name__ == "__main__":
    raise SystemExit("the golden record is kept as recorded; its renaming is RENAMED (see the module docstring)")
