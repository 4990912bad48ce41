"""Model configuration: frozen dataclasses, validated on construction.

Every field that changes the architecture lives here, so an ablation is one field and a preset is one
value. Validation happens in ``__post_init__`` and raises ``ValueError`` naming the field, the value
given and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from eqmoe._checks import EXECUTION, OBJECTIVE, _check, _one_of, _positive, _whole, execution, objective  # noqa: F401
from eqmoe.attention_config import AttentionConfig
from eqmoe.latent_attention import LatentAttentionConfig  # noqa: F401 (part of the config API)
from eqmoe.linear_attention import LinearAttentionConfig  # noqa: F401 (part of the config API)
from eqmoe.moe_config import LossConfig, MoEConfig, RouterConfig  # noqa: F401 (part of the config API)
from eqmoe.rope_scaling import ROPE_TYPES, RopeScaling  # noqa: F401 (part of the config API)

DType = Literal["float32", "bfloat16", "float16"]
_DTYPES = ("float32", "bfloat16", "float16")


def field_kind(owner: object, name: str) -> str:
    """``"architecture"``, ``"execution"`` or ``"objective"``: the declared kind of field ``name`` of
    the config dataclass (or instance) ``owner``."""
    for item in dataclasses.fields(owner):
        if item.name == name:
            return item.metadata.get("kind", "architecture")
    raise ValueError(f"{getattr(owner, '__name__', type(owner).__name__)} has no field {name!r}")


@dataclass(frozen=True)
class NormConfig:
    """RMSNorm settings and where the FFN's norm sits.

    ``ffn_placement``, a name registered in :data:`eqmoe.registries.NORM_PLACEMENTS`: ``"pre"`` is
    ``x + ffn(norm(x))``; ``"post"`` is ``norm(x + ffn(x))``;
    ``"hybrid"`` is ``x + postnorm(ffn(prenorm(x)))`` (AXLearn's names).
    ``stats_dtype``: the mean square is taken in ``"float32"`` (HF) or in the ``"input"`` dtype (AXLearn).
    ``zero_centered``: every norm's scale is held as its offset from 1, initialised at 0 and applied as ``1 + w``
    in float32 before the cast back (Qwen3-Next's and Qwen3.5's RMSNorm; weight decay pulls the scale to 1).
    """

    eps: float = 1e-6
    ffn_placement: str = "pre"
    stats_dtype: Literal["float32", "input"] = "float32"
    zero_centered: bool = False

    def __post_init__(self):
        _positive("NormConfig", eps=self.eps)
        _one_of("NormConfig", "stats_dtype", self.stats_dtype, ("float32", "input"))


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer is: its attention kind, its FFN kind and the keys its attention may see.

    ``attention`` and ``ffn`` are names registered in :data:`eqmoe.registries.ATTENTION_KINDS` (built in:
    ``"gqa"``, grouped-query attention configured by ``ModelConfig.attention``) and
    :data:`eqmoe.registries.FFN_KINDS` (``"dense"``: a SwiGLU of width ``ModelConfig.mlp_dim``; ``"moe"``: routed
    experts configured by ``ModelConfig.moe``). ``window`` makes the layer's attention sliding: query ``q`` sees
    keys ``k`` with ``q - window < k <= q`` (Hugging Face's ``sliding_attention`` layers); ``None`` sees every
    earlier key. A per-layer list of these is Hugging Face's ``layer_types`` and ``mlp_only_layers`` in one.
    """

    attention: str = "gqa"
    ffn: str = "moe"
    window: int | None = None

    def __post_init__(self):
        for name in ("attention", "ffn"):
            value = getattr(self, name)
            _check(isinstance(value, str) and bool(value), "LayerKind", name, value, "a registered name")
        window = self.window
        _check(
            window is None or (isinstance(window, int) and not isinstance(window, bool) and window > 0),
            "LayerKind",
            "window",
            window,
            "None | a positive number of keys",
        )

    def __str__(self) -> str:
        window = "" if self.window is None else f", window {self.window}"
        return f"{self.attention}/{self.ffn}{window}"


def layer_kind(value: LayerKind | str | dict) -> LayerKind:
    """A :class:`LayerKind` from itself, from an FFN kind's name (``"moe"``: grouped-query attention and routed
    experts) or from a dictionary of its fields."""
    if isinstance(value, LayerKind):
        return value
    if isinstance(value, str):
        return LayerKind(ffn=value)
    if isinstance(value, dict):
        try:
            return LayerKind(**value)
        except TypeError as error:
            raise ValueError(f"LayerKind: {error}") from None
    raise ValueError(f"ModelConfig.layers entry {value!r} is invalid; allowed: a LayerKind, an FFN kind name or a dict")


@dataclass(frozen=True)
class Segment:
    """``repeats`` copies of a repeat unit of layers, run as one ``lax.scan`` (derived from
    ``ModelConfig.layers`` by :func:`segments`, never configured)."""

    unit: tuple[LayerKind, ...]
    repeats: int

    @property
    def num_layers(self) -> int:
        return len(self.unit) * self.repeats


def segments(layers: tuple[LayerKind, ...]) -> tuple[Segment, ...]:
    """Cover a per-layer list with as few scanned segments as possible.

    Greedy from the left: at each position take the unit, repeated at least twice, whose repetitions cover the
    most layers (the shortest such unit on a tie), or else a single layer. Envy's ``("dense", "moe") * 6``
    becomes one segment of 6 repeats of a two-layer unit; ``["dense"] + ["moe"] * 5`` becomes a one-layer
    segment and a 5-repeat one; 24 alternating sliding and full layers are 12 repeats of one unit.
    """
    kinds = tuple(layers)
    if not kinds:
        raise ValueError("segments: at least one layer is needed")
    found = []
    start = 0
    while start < len(kinds):
        best_period, best_repeats = 1, 1
        for period in range(1, (len(kinds) - start) // 2 + 1):
            unit = kinds[start : start + period]
            repeats = 1
            while kinds[start + repeats * period : start + (repeats + 1) * period] == unit:
                repeats += 1
            if repeats >= 2 and period * repeats > best_period * best_repeats:
                best_period, best_repeats = period, repeats
        found.append(Segment(unit=kinds[start : start + best_period], repeats=best_repeats))
        start += best_period * best_repeats
    return tuple(found)


REMATS = ("none", "dots", "offload", "block", "auto")  # least recomputation first; auto: the first that fits


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer LM, one :class:`LayerKind` per layer (its attention and FFN kinds).

    ``layers`` lists the layers in checkpoint order; runs of a repeating unit are stacked and scanned
    (:func:`segments`), so depth costs no compile time. An entry may be written as an FFN kind's name
    (``("moe",) * 48``), which is grouped-query attention with that FFN.
    ``mlp_dim`` is the width of the dense FFN blocks (unused when every block is MoE).
    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the parameters.
    ``scan_layers=False`` unrolls each segment into a Python loop (same numbers, a program and compile time that grow
    with the depth; on a CPU a shallow model's train step is faster, its forward pass slower: README).
    ``scan_unroll``: a segment of at most this many repeats, run without recomputation, runs all of them in one
    iteration of its ``lax.scan`` (``unroll``), a longer one (or one under a recomputing ``remat``) one repeat at a
    time: the same numbers, a program of at most that many units (the quickstart's 4 layers on 2 CPU cores: a 9-16%
    faster step, no longer to compile; :func:`eqmoe.nn.stack.unroll_of`).
    ``remat`` says what the backward pass recomputes (:data:`eqmoe.nn.stack.REMAT_POLICIES`): ``"none"`` keeps every
    activation; ``"dots"`` keeps the matmul and kernel outputs (projections, attention, experts) and recomputes the
    cheap elementwise work between them; ``"offload"`` moves those outputs to host memory and back; ``"block"``
    recomputes each repeat unit from its input; ``"auto"`` is the least recomputation whose compiled step fits the
    device's memory, chosen by the training loop before its first step (:mod:`eqmoe.train.memory_fit`; elsewhere
    ``"none"``).
    ``output_chunk``: in training, the output layer and its loss take this many positions at a time and the backward
    pass recomputes their logits, so a step holds ``[batch, output_chunk, vocab]`` float32 logits (and their gradient)
    rather than ``[batch, seq, vocab]``: at a vocabulary of 152k and 16 x 2048 tokens, 18.5 GiB of logits against
    1.2 GiB in chunks of 128 (:func:`eqmoe.losses.next_token_losses_in_chunks`); ``0`` takes the whole sequence at once.
    ``init``: ``"normal"`` draws every weight from N(0, init_std^2) (HF ``initializer_range``);
    ``"fan_in"`` uses variance 1/fan_in for weights and 1/embed_dim for the embedding (AXLearn).
    ``tied_logit_scale``: with tied embeddings, logits are ``x @ E^T`` (``"none"``) or that times
    ``embed_dim^-0.5`` (``"rsqrt_embed"``, MaxText).
    ``mtp_layers``: multi-token-prediction layers kept after the decoder (DeepSeek-V3's ``num_nextn_predict_layers``,
    :class:`eqmoe.nn.mtp.MTPLayer`); the causal LM's output and loss do not read them. ``mtp_layers_declared``: what a
    ``config.json`` declares when its folder holds fewer (transformers saves ``num_nextn_predict_layers: 1`` and no
    such layer), written back by exports; ``None``: ``mtp_layers``.
    ``family``: the :mod:`eqmoe.models` family whose checkpoint formats read and write this config
    (``"qwen3_moe"``, whose Hugging Face format also holds the generic decoder's defaults, or ``"envy"``).

    Every field here and in the nested configs is one of three kinds, declared where it is defined
    (:func:`field_kind`):

    - **architecture** (no declaration): the parameters and the function they compute, so what a
      checkpoint holds: widths, layers, routing, norms, initialisation, ``param_dtype``, ``family``.
      A ``--resume`` or :meth:`Transformer.with_config` needs these equal
      (:func:`eqmoe.config_io.architecture_differences`).
    - **execution** (:func:`execution`): how that function is computed, the same numbers up to float
      rounding: ``dtype``, ``scan_layers``, ``scan_unroll``, ``remat``, ``output_chunk``, ``moe.dispatch``,
      ``moe.block_size``, ``attention.backend``, ``attention.block_size``.
    - **objective** (:func:`objective`): what training minimises: ``loss`` (every field of it).

    A resumed run may change the execution and objective fields; it continues with the new ones.
    """

    vocab_size: int
    embed_dim: int
    attention: AttentionConfig
    layers: tuple[LayerKind | str, ...]  # read as LayerKind: a name is an FFN kind with grouped-query attention
    mlp_dim: int | None = None
    moe: MoEConfig | None = None
    norm: NormConfig = field(default_factory=NormConfig)
    loss: LossConfig = objective(default_factory=LossConfig)
    tie_embeddings: bool = False
    tied_logit_scale: Literal["none", "rsqrt_embed"] = "none"
    init: Literal["normal", "fan_in"] = "normal"
    init_std: float = 0.02
    dtype: DType = execution("float32")
    # param_dtype is architecture: it is the dtype of the arrays a checkpoint stores (parameters and the
    # optimizer's moments) and of a Hugging Face export. Changing it is a cast of the checkpoint, not
    # another way to run it: restoring float32 master weights as bfloat16 loses the small updates the
    # rest of the run would add. The compute dtype (``dtype``) is execution; sft and pretrain keep
    # param_dtype float32 whatever --dtype says, so their resumes may change --dtype.
    param_dtype: DType = "float32"
    scan_layers: bool = execution(True)
    scan_unroll: int = execution(1)
    remat: Literal["none", "dots", "offload", "block", "auto"] = execution("none")
    mtp_layers: int = 0
    mtp_layers_declared: int | None = execution(None)
    output_chunk: int = execution(0)
    family: str = "qwen3_moe"

    def __post_init__(self):
        _positive("ModelConfig", vocab_size=self.vocab_size, embed_dim=self.embed_dim, init_std=self.init_std)
        _check(bool(self.family), "ModelConfig", "family", self.family, "a registered model family name")
        layers = self.layers if isinstance(self.layers, tuple | list) else ()
        _check(len(layers) > 0, "ModelConfig", "layers", self.layers, "a non-empty tuple of LayerKind")
        object.__setattr__(self, "layers", tuple(layer_kind(layer) for layer in layers))
        _one_of("ModelConfig", "dtype", self.dtype, _DTYPES)
        _one_of("ModelConfig", "param_dtype", self.param_dtype, _DTYPES)
        _one_of("ModelConfig", "remat", self.remat, REMATS)
        _whole("ModelConfig", "output_chunk", self.output_chunk, 0, " (0: the whole sequence at once)")
        _whole("ModelConfig", "scan_unroll", self.scan_unroll, 1, " (1: one repeat per scan iteration)")
        _one_of("ModelConfig", "init", self.init, ("normal", "fan_in"))
        _one_of("ModelConfig", "tied_logit_scale", self.tied_logit_scale, ("none", "rsqrt_embed"))
        mtp = self.mtp_layers
        _whole("ModelConfig", "mtp_layers", mtp, 0)
        _check(
            self.loss.mtp_weight == 0 or mtp > 0,
            "ModelConfig",
            "loss.mtp_weight",
            self.loss.mtp_weight,
            "0 (mtp_layers=0: no multi-token-prediction layer to train)",
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def ffn_kinds(self) -> tuple[str, ...]:
        """The FFN kind of every layer in order, as a checkpoint numbers them."""
        return tuple(layer.ffn for layer in self.layers)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
