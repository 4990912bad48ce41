"""The registries of every part a config names, and the one check of those names.

A config is pure data: a router strategy, a dispatch backend or an attention kind is a string there. Each kind of
part is one :class:`~eqmoe.registry.Registry`, created here and filled where the parts are written
(``eqmoe.nn``); :func:`check_names` looks every name a config uses up in its registry, with the part's own
checks, where parts are looked up: when a model is built (``Transformer``), when overrides are applied
(``eqmoe.config_io.apply_overrides``) and when a command starts. Importing ``eqmoe`` imports ``eqmoe.nn``, so the
built-in parts are registered before any config is checked.

=======================  ==================================  =================================================
registry                 config field                        an item is
=======================  ==================================  =================================================
``ATTENTION_KINDS``      ``layers[i].attention``             a module class (``eqmoe.nn.kinds.AttentionKind``)
``FFN_KINDS``            ``layers[i].ffn``                   a module class (``eqmoe.nn.kinds.FFNKind``)
``ATTENTION_BACKENDS``   ``attention.backend`` (+ ``auto``)  ``backend(q, k, v, mask, *, scale, block_size, window,
                                                             sinks)``
``NORM_PLACEMENTS``      ``norm.ffn_placement``              ``eqmoe.nn.block.Placement``
``ROUTER_STRATEGIES``    ``moe.router.strategy``             ``eqmoe.nn.router.Strategy``
``DISPATCH_BACKENDS``    ``moe.dispatch`` (+ ``auto``)       ``eqmoe.nn.dispatch.Backend``
``FFN_ACTIVATIONS``      ``moe.activation``                  ``activation(gate, up, moe_config) -> hidden``
``LOAD_BALANCE``         ``loss.load_balance``               a function of ``RouterStats`` to a scalar
=======================  ==================================  =================================================

An item may carry a ``check``: ``check(config)`` (or ``check(config, layer)`` for a layer's kinds) raising a
``ValueError`` for a config it cannot run.
"""

from __future__ import annotations

from typing import Any

from eqmoe.registry import Registry

ATTENTION_KINDS: Registry[Any] = Registry("attention kind")
FFN_KINDS: Registry[Any] = Registry("FFN kind")
ATTENTION_BACKENDS: Registry[Any] = Registry("attention backend")
NORM_PLACEMENTS: Registry[Any] = Registry("FFN norm placement")
ROUTER_STRATEGIES: Registry[Any] = Registry("router strategy")
DISPATCH_BACKENDS: Registry[Any] = Registry("dispatch backend")
FFN_ACTIVATIONS: Registry[Any] = Registry("FFN activation")
LOAD_BALANCE: Registry[Any] = Registry("load-balance form")


def _item_check(item: Any, *args: Any) -> None:
    check = getattr(item, "check", None)
    if check is not None:
        check(*args)


def check_names(config: Any) -> None:
    """Look up every registered name ``config`` (a ``ModelConfig``) uses and run each part's own check.

    Raises ``ValueError`` in the format of every config error, naming the field, the value and the allowed
    values: ``"layers[3].attention='latnet' is invalid; allowed: gqa | latent"``.
    """
    attention = config.attention
    ATTENTION_BACKENDS.check("AttentionConfig", "backend", attention.backend, extra=("auto",))
    NORM_PLACEMENTS.check("NormConfig", "ffn_placement", config.norm.ffn_placement)
    LOAD_BALANCE.check("LossConfig", "load_balance", config.loss.load_balance)
    if config.moe is not None:
        router = config.moe.router
        ROUTER_STRATEGIES.check("RouterConfig", "strategy", router.strategy)
        FFN_ACTIVATIONS.check("MoEConfig", "activation", config.moe.activation)
        _item_check(ROUTER_STRATEGIES.get(router.strategy), router)
        DISPATCH_BACKENDS.check("MoEConfig", "dispatch", config.moe.dispatch, extra=("auto",))
        if config.moe.dispatch != "auto":
            _item_check(DISPATCH_BACKENDS.get(config.moe.dispatch), config.moe)
    for index, layer in enumerate(config.layers):
        ATTENTION_KINDS.check("ModelConfig", f"layers[{index}].attention", layer.attention)
        FFN_KINDS.check("ModelConfig", f"layers[{index}].ffn", layer.ffn)
        for registry, name in ((ATTENTION_KINDS, layer.attention), (FFN_KINDS, layer.ffn)):
            try:
                _item_check(registry.get(name), config, layer)
            except ValueError as error:
                raise ValueError(f"layers[{index}] ({name}): {error}") from None
