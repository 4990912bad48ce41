"""Golden record of what every parameter is taken to be: its logical axes (sharding), weight decay, mup
scaling, optimizer state vs trained, routed vs shared (parameter counts), for every preset and the
config variants that add parameters. Recorded before parameters declare their own roles, so that change
can show it keeps every preset's sharding and optimizer masks.

    python -m tests.test_param_roles     # rewrite tests/golden/param_roles.json (review the diff)
"""

import dataclasses
import json
from pathlib import Path

import jax

from eqmoe import parallel, presets
from eqmoe.analysis.params import abstract_model
from eqmoe.config import ModelConfig, segments_from_kinds
from eqmoe.train.optimizer import OptimizerConfig, is_mup_scaled, is_norm_scale, is_router_bias

GOLDEN = Path(__file__).parent / "golden" / "param_roles.json"


def _variants() -> dict[str, ModelConfig]:
    configs = {name: presets.get(name) for name in presets.names()}
    micro = presets.get("qwen3-moe-micro")
    router = dataclasses.replace(micro.moe.router, bias_update_rate=1e-3)
    configs["qwen3-moe-micro+tied"] = micro.replace(tie_embeddings=True)
    configs["qwen3-moe-micro+router-bias"] = micro.replace(moe=dataclasses.replace(micro.moe, router=router))
    dense_first = segments_from_kinds(("dense", "moe", "moe", "dense"))
    configs["qwen3-moe-micro+dense-layers"] = micro.replace(layers=dense_first)
    return configs


def role_table(config: ModelConfig) -> dict[str, dict]:
    """Per array leaf of the model: shape and everything the package derives from its path today."""
    decays = OptimizerConfig().decay_norms
    table = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(abstract_model(config)):
        path = jax.tree_util.keystr(key_path, simple=True, separator=".")
        table[path] = {
            "shape": list(leaf.shape),
            "axes": list(parallel.param_axes(key_path, tuple(leaf.shape))),
            "decay": decays or not is_norm_scale(key_path),
            "mup": is_mup_scaled(key_path),
            "state": is_router_bias(key_path),
            "routed": ".experts." in f".{path}.",
        }
    return table


def all_tables() -> dict[str, dict]:
    return {name: role_table(config) for name, config in sorted(_variants().items())}


def test_parameter_roles_match_the_golden_record():
    golden = json.loads(GOLDEN.read_text())
    tables = json.loads(json.dumps(all_tables()))  # tuples and None as JSON holds them
    assert sorted(tables) == sorted(golden)
    for name, table in tables.items():
        assert table == golden[name], name


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(all_tables(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
