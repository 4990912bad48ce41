"""What an attention kind and an FFN kind are: registered parts that own everything about themselves.

A layer kind (:class:`eqmoe.config.LayerKind`) names one attention kind and one FFN kind, registered in
:data:`eqmoe.registries.ATTENTION_KINDS` and :data:`eqmoe.registries.FFN_KINDS`. A kind is a module class:

- it builds its parameters (declared with roles and axes: :class:`eqmoe.nn.Layer`, :class:`eqmoe.nn.Linear`),
- it runs with one signature, the cache an optional input (a kind may switch algorithm when given one),
- it says what its cache is (:meth:`AttentionKind.init_cache`), what it costs (:meth:`plan`), how Hugging Face
  names its tensors (:meth:`AttentionKind.checkpoint_names`) and what config it cannot run (:meth:`check`),
- its :class:`~eqmoe.nn.Linear` fields are LoRA targets named ``adapter_group.field`` (``attention.q``).

Adding a kind is a class and a registration line; nothing else in eqmoe changes::

    @ATTENTION_KINDS.register("latent")
    class LatentAttention(AttentionKind):
        ...
"""

from typing import Any, ClassVar, NamedTuple

from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.config import LayerKind, ModelConfig
from eqmoe.nn._init import Init
from eqmoe.nn.context import Context
from eqmoe.params import Layer
from eqmoe.registries import ATTENTION_KINDS, FFN_KINDS
from eqmoe.tensor_names import TensorName


class PlanShape(NamedTuple):
    """What the planner knows of one device's share of a step."""

    rows: int  # sequences on this device
    seq: int  # tokens per sequence
    bytes: int  # bytes of the compute dtype
    tensor: int = 1  # devices the tensor axis splits widths over
    expert: int = 1  # devices the expert axis splits experts over

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    def split(self, size: int, ways: int | None = None) -> int:
        """``size`` divided over the tensor axis (or ``ways``), whole when it does not divide."""
        ways = self.tensor if ways is None else ways
        return size // ways if size % ways == 0 else size


class Cost(NamedTuple):
    """A part's planner estimate for one layer on one device."""

    activations: float  # bytes per token the backward pass keeps (remat none)
    per_step: float = 0.0  # bytes allocated once per step (a kernel's scratch), not per layer
    flops: float = 0.0  # training (forward + backward) FLOPs per token beyond its parameters' matmuls (scores...)
    cache: float = 0.0  # bytes per token of its decoding cache (in the compute dtype): what grows with the length
    expanded_cache: float = 0.0  # what a cache of every head's keys and values would hold, where the kind keeps less
    state: float = 0.0  # bytes per sequence of a decoding state that does not grow with its length (a recurrence's)


def keys_seen(seq: int, window: int | None, causal: bool) -> float:
    """The keys a query of a ``seq``-token row sees on average: every one (``causal=False``), ``(seq + 1) / 2``
    (causal), or with a sliding ``window`` ``min(t + 1, window)`` averaged over the positions ``t``."""
    if not causal:
        return float(seq)
    if window is None or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


class AttentionKind(Layer):
    """The base of the registered attention kinds (grouped-query attention, :mod:`eqmoe.nn.gqa`, is the first).

    ``__init__(config, layer, *, init, key)`` builds it for ``layer`` (a :class:`LayerKind`) of ``config``;
    ``__call__(x, context, cache=None, key=None) -> (y, cache)`` maps ``[batch, seq, embed]`` to the same shape
    (``cache``: this layer's entry of the decoding cache, written at ``context.cache_index``; the updated entry
    comes back, ``None`` without one; ``key``: training-time randomness such as adapter dropout).
    """

    adapter_group: ClassVar[str] = "attention"
    hf_module: ClassVar[str] = "self_attn"  # the attribute transformers' decoder layers hold it under

    @classmethod
    def build(cls, config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray) -> "AttentionKind":
        """The kind for ``layer`` of ``config`` (its ``__init__``)."""
        return cls(config, layer, init=init, key=key)

    def __call__(
        self, x: Float[Array, "batch seq embed"], context: Context, cache: Any = None, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "batch seq embed"], Any]:
        raise NotImplementedError

    @classmethod
    def init_cache(cls, config: ModelConfig, layer: LayerKind, batch: int, max_len: int, dtype) -> Any:
        """An empty decoding cache of ``max_len`` slots for ``batch`` rows (any pytree of arrays)."""
        raise NotImplementedError(f"attention kind {cls.__name__} has no decoding cache")

    @classmethod
    def plan(cls, config: ModelConfig, layer: LayerKind, shape: PlanShape) -> Cost:
        raise NotImplementedError(f"attention kind {cls.__name__} has no planner estimate")

    @classmethod
    def forward_flops(cls, config: ModelConfig, layer: LayerKind, seq: int, causal: bool = True) -> float:
        """Model FLOPs per token of one forward pass beyond its parameters' matmuls (``2 N`` counts those): the
        scores and values over the keys a query of a ``seq``-token row sees (``causal``: ``(seq + 1) / 2`` on
        average, a window's fewer; ``False``: all ``seq``, what a kernel computing every pair does). A kind without
        its own count is credited a third of its planner's training FLOPs (forward and backward)."""
        return cls.plan(config, layer, PlanShape(1, seq, 4)).flops / 3

    @classmethod
    def checkpoint_names(
        cls, config: ModelConfig, layer: LayerKind, prefix: str, path: tuple, index: tuple[int, ...]
    ) -> list[TensorName]:
        """Its tensors in Hugging Face's names under ``prefix`` (``model.layers.3.self_attn.``), the module at
        ``path`` in the model, slice ``index`` of its stacked leaves."""
        raise ValueError(f"attention kind {cls.__name__} has no Hugging Face checkpoint names")

    @classmethod
    def check(cls, config: ModelConfig, layer: LayerKind) -> None:
        """Raise ``ValueError`` for a config this kind cannot run."""


class FFNKind(Layer):
    """The base of the registered FFN kinds (``dense``: :mod:`eqmoe.nn.mlp`; ``moe``: :mod:`eqmoe.nn.moe`).

    ``build(config, layer, *, init, key)`` makes one; ``__call__(x, context, key=None) -> (y, routing)`` maps
    ``[batch, seq, embed]`` to the same shape, ``routing`` being the layer's :class:`eqmoe.nn.router.Routing`
    (``None`` for an unrouted FFN), from which losses and analyses compute their statistics.
    """

    routed: ClassVar[bool] = False

    @classmethod
    def build(cls, config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray) -> "FFNKind":
        raise NotImplementedError

    @classmethod
    def plan(cls, config: ModelConfig, layer: LayerKind, shape: PlanShape) -> Cost:
        raise NotImplementedError(f"FFN kind {cls.__name__} has no planner estimate")

    @classmethod
    def check(cls, config: ModelConfig, layer: LayerKind) -> None:
        """Raise ``ValueError`` for a config this kind cannot run."""


def build_attention(config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray) -> AttentionKind:
    return ATTENTION_KINDS.get(layer.attention).build(config, layer, init=init, key=key)


def build_ffn(config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray) -> FFNKind:
    return FFN_KINDS.get(layer.ffn).build(config, layer, init=init, key=key)
