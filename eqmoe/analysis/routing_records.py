"""Per-token routing records: what a model's router chose for every real token in every MoE layer, and the trace
file that holds them.

:class:`RoutingRecorder` runs any :class:`~eqmoe.model.Transformer` on token ids and keeps, from the routing it
returns, for every real token and every MoE layer, the ``top_k`` experts it chose (best first) and their combine
weights: a :class:`RoutingRecords`. :func:`write_trace` writes them as one JSONL or Parquet row per (token, layer);
the analyses of :mod:`eqmoe.analysis.routing_maps` read them.
"""

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eqmoe.config import ModelConfig
from eqmoe.model import Transformer
from eqmoe.nn.router import Routing
from eqmoe.registries import FFN_KINDS

# --- records --------------------------------------------------------------------------------------------------


class RoutingRecords(NamedTuple):
    """Every recorded token's routing in every MoE layer, one row per token (padding left out).

    The experts are the router's choice before capacity drops (what ``RouterStats.expert_counts`` counts);
    ``kept`` says which assignments capacity kept, and ``weights`` is 0 where it did not.
    """

    num_experts: int
    layers: Int[np.ndarray, " layers"]  # model layer number of each MoE layer, as checkpoints number them
    token_ids: Int[np.ndarray, " tokens"]
    sequences: Int[np.ndarray, " tokens"]  # which recorded row the token came from
    positions: Int[np.ndarray, " tokens"]  # RoPE position (restarting at every packed document)
    experts: Int[np.ndarray, "tokens layers k"]  # chosen experts, best first
    weights: Float[np.ndarray, "tokens layers k"]  # their combine weights
    kept: Bool[np.ndarray, "tokens layers k"] | None = None
    losses: Float[np.ndarray, " tokens"] | None = None  # -log p(token | earlier tokens); NaN without a target
    domains: Int[np.ndarray, " tokens"] | None = None  # data domain of each token, -1 when unknown

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])


def concat_records(parts: Sequence[RoutingRecords]) -> RoutingRecords:
    """The records of several batches as one (same model: same layers and experts)."""
    if not parts:
        raise ValueError("concat_records: no records given")
    first = parts[0]
    for part in parts[1:]:
        if part.num_experts != first.num_experts or not np.array_equal(part.layers, first.layers):
            raise ValueError("concat_records: the records come from models with different MoE layers or experts")

    def join(name: str):
        values = [getattr(part, name) for part in parts]
        return None if any(value is None for value in values) else np.concatenate(values)

    fields = {name: join(name) for name in RoutingRecords._fields if name not in ("num_experts", "layers")}
    return RoutingRecords(first.num_experts, first.layers, **fields)


# --- collection: the routing the model's own forward pass returns -----------------------------------------------


def moe_layer_numbers(config: ModelConfig) -> np.ndarray:
    """The model layer number of every routed layer, in order (the order of ``ModelOutput.routing``)."""
    return np.asarray([i for i, layer in enumerate(config.layers) if FFN_KINDS.get(layer.ffn).routed], np.int32)


@eqx.filter_jit
def _losses_and_routing(
    model: Transformer,
    tokens: Int[Array, "batch seq"],
    segment_ids: Int[Array, "batch seq"],
    positions: Int[Array, "batch seq"],
    token_mask: Bool[Array, "batch seq"],
) -> tuple[Float[Array, "batch seq"], Routing]:
    """``-log p(tokens[t] | tokens[<t])`` at every position ``t >= 1`` (0 at ``t = 0``), in float32, and the
    routing of every MoE layer."""
    output = model(tokens, segment_ids=segment_ids, positions=positions, token_mask=token_mask)
    logits = output.logits[:, :-1].astype(jnp.float32)
    target = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(jax.nn.logsumexp(logits, axis=-1) - target, ((0, 0), (1, 0))), output.routing


class RoutingRecorder:
    """Runs ``model`` on batches of token ids and returns every real token's :class:`RoutingRecords`.

    The model's own ``__call__`` returns each MoE layer's routing (``ModelOutput.routing``), so capacity, LoRA
    and aux-loss-free biases route exactly as in training. One recorder compiles once per batch shape, so reuse
    it across batches::

        recorder = RoutingRecorder(model)
        records = concat_records([recorder(tokens) for tokens in batches])
    """

    def __init__(self, model: Transformer):
        self.layers = moe_layer_numbers(model.config)
        if not len(self.layers):
            raise ValueError("the model has no MoE layer: there is no routing to record")
        self.model = model
        self.num_experts = model.config.moe.router.num_experts
        self._rows = 0

    def __call__(
        self,
        tokens: Int[np.ndarray | Array, "batch seq"],
        *,
        segment_ids: Int[np.ndarray | Array, "batch seq"] | None = None,
        positions: Int[np.ndarray | Array, "batch seq"] | None = None,
        token_mask: Bool[np.ndarray | Array, "batch seq"] | None = None,
        domains: Int[np.ndarray, "batch seq"] | None = None,
    ) -> RoutingRecords:
        """The routing of the tokens where ``token_mask`` is true (all by default). ``segment_ids`` and
        ``positions`` describe packed rows as the model takes them; ``domains`` labels each token (-1: none).
        A token's loss is NaN when it starts its row or document (nothing predicts it)."""
        tokens = np.asarray(tokens, np.int32)
        batch, seq = tokens.shape
        mask = np.ones((batch, seq), bool) if token_mask is None else np.asarray(token_mask, bool)
        segments = np.where(mask, 1, 0).astype(np.int32) if segment_ids is None else np.asarray(segment_ids, np.int32)
        if positions is None:
            positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
        positions = np.asarray(positions, np.int32)
        losses, routing = _losses_and_routing(self.model, *map(jnp.asarray, (tokens, segments, positions, mask)))
        losses = np.asarray(losses, np.float32)
        experts, weights, kept = (np.asarray(x) for x in (routing.experts, routing.weights, routing.kept))

        predicted = np.zeros_like(mask)  # a target has a real token of its own document before it
        predicted[:, 1:] = mask[:, 1:] & mask[:, :-1] & (segments[:, 1:] == segments[:, :-1])
        losses = np.where(predicted, losses, np.nan).astype(np.float32)
        flat = mask.reshape(-1)
        rows = np.broadcast_to(self._rows + np.arange(batch, dtype=np.int32)[:, None], (batch, seq))
        self._rows += batch
        return RoutingRecords(
            num_experts=self.num_experts,
            layers=self.layers,
            token_ids=tokens.reshape(-1)[flat],
            sequences=rows.reshape(-1)[flat],
            positions=positions.reshape(-1)[flat],
            experts=np.moveaxis(experts[:, flat], 0, 1).astype(np.int32),
            weights=np.moveaxis(weights[:, flat], 0, 1).astype(np.float32),
            kept=np.moveaxis(kept[:, flat], 0, 1),
            losses=losses.reshape(-1)[flat],
            domains=None if domains is None else np.asarray(domains, np.int32).reshape(-1)[flat],
        )


def collect_routing(model: Transformer, tokens: Int[np.ndarray | Array, "batch seq"], **batch) -> RoutingRecords:
    """:class:`RoutingRecords` of one batch (keyword arguments as :meth:`RoutingRecorder.__call__`)."""
    return RoutingRecorder(model)(tokens, **batch)


# --- the router trace -------------------------------------------------------------------------------------------

TraceFormat = Literal["jsonl", "parquet"]


def trace_columns(records: RoutingRecords) -> dict[str, np.ndarray]:
    """One row per (token, MoE layer), token-major: sequence, token_id, position, layer (model layer number),
    experts ``[rows, k]`` and weights ``[rows, k]``."""
    layers = len(records.layers)
    return {
        "sequence": np.repeat(records.sequences, layers),
        "token_id": np.repeat(records.token_ids, layers),
        "position": np.repeat(records.positions, layers),
        "layer": np.tile(records.layers, records.num_tokens),
        "experts": records.experts.reshape(-1, records.top_k),
        "weights": records.weights.reshape(-1, records.top_k),
    }


def write_trace(records: RoutingRecords, path: str | os.PathLike, format: TraceFormat | None = None) -> Path:
    """Write the :func:`trace_columns` rows to ``path`` as JSON Lines or Parquet (by default from the suffix),
    through a temporary file beside it renamed into place, so a reader never sees half a trace."""
    path = Path(path)
    format = format or ("parquet" if path.suffix == ".parquet" else "jsonl")
    if format not in ("jsonl", "parquet"):
        raise ValueError(f"trace format {format!r} is invalid; allowed: jsonl | parquet")
    columns = trace_columns(records)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        if format == "parquet":
            _write_parquet(columns, Path(temporary))
        else:
            _write_jsonl(columns, Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _write_jsonl(columns: dict[str, np.ndarray], path: Path) -> None:
    scalars = ("sequence", "token_id", "position", "layer")
    with path.open("w", encoding="utf-8") as file:
        for row in zip(*(columns[name].tolist() for name in (*scalars, "experts", "weights")), strict=True):
            file.write(json.dumps(dict(zip((*scalars, "experts", "weights"), row, strict=True))) + "\n")


def _write_parquet(columns: dict[str, np.ndarray], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def lists(values: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), values.shape[1])

    scalars = ("sequence", "token_id", "position", "layer")
    table = pa.table(
        {
            **{name: pa.array(columns[name].astype(np.int32)) for name in scalars},
            "experts": lists(columns["experts"].astype(np.int32)),
            "weights": lists(columns["weights"].astype(np.float32)),
        }
    )
    pq.write_table(table, path)
