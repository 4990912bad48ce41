"""The import graph of ``eqmoe/``: no circle, imports only run downward, and the config is a pure data leaf.

Every ``import`` and ``from ... import`` of every module is read (those inside functions too: a late import that
closes a circle is still a circle), resolved to the module it names, and the graph checked: its strongly
connected components are single modules, and each layer of the design imports only the layers below it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eqmoe"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The eqmoe module ``name`` is, or is in (``eqmoe.nn.gqa.GroupedQueryAttention`` -> ``eqmoe.nn.gqa``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """The eqmoe modules ``module`` imports (anywhere in its body)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # ``from A import b``: the module A.b when there is one, else a name defined in A
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("eqmoe"):
                resolved = _resolve(name)
                if resolved and resolved != module:
                    found.add(resolved)
    return found


GRAPH = {module: imports(module) for module in MODULES}
# the config's pure-data pieces: the checks and the nested configs kept in their own files
CONFIG_PIECES = {
    "eqmoe._checks",
    "eqmoe.attention_config",
    "eqmoe.moe_config",
    "eqmoe.rope_scaling",
    "eqmoe.latent_attention",
    "eqmoe.linear_attention",
}


def _reachable(start: str) -> set[str]:
    seen, pending = set(), [start]
    while pending:
        for target in GRAPH[pending.pop()]:
            if target not in seen:
                seen.add(target)
                pending.append(target)
    return seen


def test_no_module_reaches_itself_through_its_imports():
    circles = sorted(module for module in MODULES if module in _reachable(module))
    assert circles == [], f"modules in import circles: {circles}"


def test_the_config_is_a_pure_data_leaf():
    """eqmoe.config imports no part, registry, loss or model: registered names are checked where parts are
    looked up (eqmoe.registries.check_names), never inside a config's __post_init__."""
    reached = _reachable("eqmoe.config")
    assert reached <= CONFIG_PIECES, reached
    for forbidden in ("eqmoe.nn", "eqmoe.losses", "eqmoe.registry", "eqmoe.registries", "eqmoe.model"):
        assert not any(module == forbidden or module.startswith(forbidden + ".") for module in reached)


# Each layer may import only from the layers listed for it (and itself); a layer's modules are the module or the
# package named.
LAYERS = {
    "eqmoe.data": {"eqmoe.data", "eqmoe.cache", "eqmoe.progress"},
    "eqmoe.params": set(),
    "eqmoe.registry": set(),
    "eqmoe.registries": {"eqmoe.registry"},
    "eqmoe.config": CONFIG_PIECES,
    "eqmoe.parallel": {"eqmoe.params"},
    "eqmoe.nn": {
        "eqmoe.nn",
        "eqmoe.config",
        "eqmoe.params",
        "eqmoe.registries",
        "eqmoe.parallel",
        "eqmoe.rope_scaling",
        "eqmoe.tensor_names",
    },
    "eqmoe.models": {
        "eqmoe.models",
        "eqmoe.config",
        "eqmoe.config_io",
        "eqmoe.registries",
        "eqmoe.registry",
        "eqmoe.tensor_names",
    },
}


def _layer_of(module: str) -> str | None:
    return next((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), None)


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, targets in GRAPH.items():
        layer = _layer_of(module)
        if layer is None:
            continue
        allowed = LAYERS[layer] | {layer}
        for target in targets:
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} -> {target}")
    assert wrong == [], wrong
