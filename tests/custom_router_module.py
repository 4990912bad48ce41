"""A router strategy from outside eqmoe, registered by importing this module: what ``--import
tests.custom_router_module`` gives ``pretrain`` and ``ablate`` (tests/test_ablate.py)."""

import jax

from eqmoe.nn.router import STRATEGIES, Strategy

NAME = "tempered_softmax_top_k"
TEMPERATURE = 2.0


def tempered_softmax_top_k(logits, config, bias):
    """Softmax of ``logits / TEMPERATURE``, its ``top_k`` largest, renormalised: flatter weights than softmax_top_k
    gives (the selection bias is not used)."""
    probabilities = jax.nn.softmax(logits / TEMPERATURE, axis=-1)
    weights, experts = jax.lax.top_k(probabilities, config.top_k)
    return weights / weights.sum(axis=-1, keepdims=True), experts


# The registry refuses a name twice; a test that unregisters it and imports the module again registers it again.
if NAME not in STRATEGIES:
    STRATEGIES.register(NAME, Strategy(tempered_softmax_top_k))
