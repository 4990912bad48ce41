"""Running on a device mesh with JAX's own SPMD engine: meshes, logical axes and the rules between them.

A mesh has up to four named axes, ``data``, ``fsdp``, ``expert`` and ``tensor`` (``--mesh
data=2,expert=4``). Every parameter and activation dimension has a logical name (``embed``, ``vocab``,
``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``expert_mlp``, ``experts``, ``layers``, ``batch``,
``seq``); :data:`DEFAULT_RULES` maps each to the mesh axes it is split over:

===========  ======================  ============================================================
logical      mesh axes               why
===========  ======================  ============================================================
batch        data, fsdp, expert      every device holds a different slice of the tokens
embed        fsdp                    FSDP: parameters split over fsdp, gathered where used
vocab        tensor                  tensor parallelism of the embedding and the output head
heads        tensor                  attention heads split over tensor
kv_heads     tensor
mlp          tensor                  dense FFN width
expert_mlp   tensor                  each expert's width
experts      expert                  expert parallelism: each device holds E / expert experts
===========  ======================  ============================================================

Everything else (``layers``, ``head_dim``, ``seq``, ``lora_rank`` for adapters' rank, ``latent`` for latent
attention's low ranks, ``linear`` for linear attention's widths and ``conv`` for its kernel, ``norm`` for norm
scales, ``gates`` for the router's per-expert scores, ``fp8_blocks`` for a block-FP8 weight's scale grid where it
spans several weight axes) is replicated.
Each parameter names its logical axes once, in the annotation of the field that declares it
(``wq: Float[Array, "embed heads head_dim"] = param(Role.ATTENTION)``), with a leading ``layers`` axis
added for every stacking; an axis name with no rule is an error. A dimension
whose size the mesh axes do not divide is replicated instead. Rules are overridable
(``--rules embed=,experts=expert``: an empty right side replicates).

The model code stays mesh-free: :func:`activate` makes a mesh current (``jax.set_mesh``) and the few
places that need it ask :func:`current` (the expert-parallel MoE path, the sharding constraints).
"""

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from eqmoe.params import param_info

MESH_AXES = ("data", "fsdp", "expert", "tensor")
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": (),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "latent": (),
    "linear": (),
    "conv": (),
    "mlp": ("tensor",),
    "expert_mlp": ("tensor",),
    "experts": ("expert",),
    "layers": (),
    "lora_rank": (),
    "norm": (),
    "gates": (),
    "fp8_blocks": (),
}
Logical = tuple[str | None, ...]


def mesh_sizes(spec: str) -> dict[str, int]:
    """``"data=2,expert=-1"`` -> ``{"data": 2, "fsdp": 1, "expert": -1, "tensor": 1}``: the sizes as written
    (axes not named are 1, at most one ``-1``), checked before any device is known."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    named = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, equals, value = part.partition("=")
        name = name.strip()
        if not equals or name not in MESH_AXES:
            raise ValueError(
                f"mesh spec {spec!r}: {part!r} is invalid; allowed: AXIS=SIZE with AXIS one of {MESH_AXES}"
            )
        if name in named:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"mesh spec {spec!r}: size {value!r} of {name} is not an integer") from None
        if size == 0 or size < -1:
            raise ValueError(f"mesh spec {spec!r}: size {size} of {name} is invalid; allowed: a positive integer or -1")
        sizes[name] = size
        named.add(name)
    if sum(size == -1 for size in sizes.values()) > 1:
        raise ValueError(f"mesh spec {spec!r}: only one axis may be -1")
    return sizes


def parse_mesh(spec: str, device_count: int) -> dict[str, int]:
    """``"data=2,expert=4"`` -> ``{"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}``. Axes not named are 1;
    one axis may be ``-1``, the devices left over. The sizes must multiply to ``device_count``."""
    sizes = mesh_sizes(spec)
    rest = [name for name, size in sizes.items() if size == -1]
    known = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if device_count % known:
            raise ValueError(f"mesh spec {spec!r}: {known} does not divide the {device_count} devices")
        sizes[rest[0]] = device_count // known
    if math.prod(sizes.values()) != device_count:
        raise ValueError(
            f"mesh spec {spec!r}: {math.prod(sizes.values())} devices named but {device_count} are present "
            "(use -1 on one axis for the rest)"
        )
    return sizes


def parse_rules(text: str) -> dict[str, tuple[str, ...]]:
    """``"embed=,experts=expert+tensor"`` -> the default rules with those entries replaced (an empty right
    side replicates; ``+`` joins mesh axes)."""
    rules = dict(DEFAULT_RULES)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, equals, value = part.partition("=")
        if not equals or name.strip() not in DEFAULT_RULES:
            raise ValueError(
                f"rules {text!r}: {part!r} is invalid; allowed: LOGICAL=AXIS[+AXIS] with LOGICAL one of "
                f"{', '.join(DEFAULT_RULES)}"
            )
        axes = tuple(a.strip() for a in value.split("+") if a.strip())
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise ValueError(f"rules {text!r}: unknown mesh axis {unknown[0]!r}; allowed: {', '.join(MESH_AXES)}")
        rules[name.strip()] = axes
    return rules


@dataclass(frozen=True)
class Parallelism:
    """A mesh and the rules mapping logical axis names to its axes."""

    mesh: Mesh
    rules: dict[str, tuple[str, ...]]

    def size(self, axis: str) -> int:
        return int(self.mesh.shape.get(axis, 1))

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes of size > 1 that ``logical`` is split over."""
        return tuple(a for a in self.rules.get(logical, ()) if self.size(a) > 1) if logical else ()

    def splits(self, x: Any, logical: str) -> bool:
        """Whether ``x``'s leading dimension divides evenly over ``logical``'s mesh axes."""
        return x.shape[0] % math.prod(self.size(a) for a in self.mesh_axes(logical)) == 0

    def spec(self, logical: Logical, shape: tuple[int, ...] | None = None) -> PartitionSpec:
        """The ``PartitionSpec`` of an array with these logical axes. With ``shape``, a dimension the mesh
        axes do not divide is replicated; a mesh axis is used by the first dimension that asks for it."""
        used: set[str] = set()
        parts = []
        for dim, name in enumerate(logical):
            axes = tuple(a for a in self.mesh_axes(name) if a not in used)
            if shape is not None and shape[dim] % math.prod(self.size(a) for a in axes):
                axes = ()
            used.update(axes)
            parts.append(axes[0] if len(axes) == 1 else (axes or None))
        return PartitionSpec(*parts)

    def sharding(self, logical: Logical, shape: tuple[int, ...] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))


def make_parallelism(mesh: str, rules: str = "", devices: list | None = None) -> Parallelism:
    """A :class:`Parallelism` over ``devices`` (default: every device of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(mesh, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    device_mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
    return Parallelism(device_mesh, parse_rules(rules))


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Join a multi-process run (``jax.distributed.initialize``) when a coordinator is given here or in
    ``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``); returns whether it did.
    Must run before anything touches a JAX device. CPU processes talk through gloo collectives."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not coordinator:
        return False
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return True


def from_process_zero(flag: bool) -> bool:
    """Process 0's ``flag``, in every process of the run (a collective: every process calls it at the same point)."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


_ACTIVE: list[Parallelism] = []


@contextlib.contextmanager
def activate(parallelism: Parallelism | None) -> Iterator[Parallelism | None]:
    """Make ``parallelism`` current (and its mesh JAX's) inside the block; ``None`` does nothing."""
    if parallelism is None:
        yield None
        return
    _ACTIVE.append(parallelism)
    try:
        with jax.set_mesh(parallelism.mesh):
            yield parallelism
    finally:
        _ACTIVE.pop()


def current() -> Parallelism | None:
    """The parallelism made current by :func:`activate`, or ``None`` (single device)."""
    return _ACTIVE[-1] if _ACTIVE else None


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray)


def tree_shardings(tree: Any, parallelism: Parallelism) -> Any:
    """A ``NamedSharding`` for every array leaf of ``tree`` (a model, a train state, its abstract shape);
    ``None`` for the other leaves. Parameters (and optimizer state shaped like them) are split by the
    logical axes they declare (:func:`eqmoe.params.param_info`); other arrays are replicated."""

    def sharding(leaf, info):
        if not _is_array(leaf):
            return None
        unknown = [axis for axis in info.axes if axis is not None and axis not in parallelism.rules]
        if unknown:
            raise ValueError(
                f"a {info.role.value} parameter of shape {leaf.shape} names logical axis {unknown[0]!r}, which "
                f"has no sharding rule; rules exist for {', '.join(parallelism.rules)}"
            )
        return parallelism.sharding(info.axes, tuple(leaf.shape))

    return jax.tree.map(sharding, tree, param_info(tree))


def shard(tree: Any, parallelism: Parallelism | None) -> Any:
    """``tree`` with every array leaf placed by :func:`tree_shardings` (unchanged without a parallelism)."""
    if parallelism is None:
        return tree
    shardings = tree_shardings(tree, parallelism)
    return jax.tree.map(lambda leaf, s: leaf if s is None else jax.device_put(leaf, s), tree, shardings)


def abstract_sharded(tree: Any, parallelism: Parallelism) -> Any:
    """``tree``'s array leaves as ``jax.ShapeDtypeStruct`` carrying their sharding: a restore target that
    places a checkpoint straight onto the mesh, whatever mesh it was saved from."""
    shardings = tree_shardings(tree, parallelism)
    return jax.tree.map(
        lambda leaf, s: leaf if s is None else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
        tree,
        shardings,
    )


def array_from_slices(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, read: Callable[[tuple[slice, ...]], np.ndarray]
) -> jax.Array:
    """A global array placed by ``sharding`` whose shards ``read(index)`` supplies (``index``: the global slice of one
    device, as for ``jax.make_array_from_callback``). Unlike that function, which gathers every addressable shard on
    the host before placing any, each distinct slice is read, placed on the devices that hold it and released before
    the next: the host holds one slice at a time."""
    groups: dict[tuple, tuple[tuple[slice, ...], list]] = {}
    for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
        key = tuple((s.start, s.stop, s.step) for s in index)  # slices are unhashable before Python 3.12
        groups.setdefault(key, (index, []))[1].append(device)
    shards = []
    for index, devices in groups.values():
        local = read(index)
        placed = [jax.device_put(local, device) for device in devices]
        jax.block_until_ready(placed)  # a transfer still in flight would keep its host slice alive
        shards += placed
        del local
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards)


def constrain(tree: Any) -> Any:
    """Inside ``jit``: pin every array leaf of ``tree`` to its rule sharding (no-op without a parallelism)."""
    parallelism = current()
    if parallelism is None:
        return tree
    shardings = tree_shardings(tree, parallelism)
    return jax.tree.map(
        lambda leaf, s: leaf if s is None else jax.lax.with_sharding_constraint(leaf, s), tree, shardings
    )


def constrain_activation(x: jax.Array, logical: Logical) -> jax.Array:
    """Inside ``jit``: pin an activation to the sharding of its logical axes (no-op without a parallelism)."""
    parallelism = current()
    if parallelism is None:
        return x
    return jax.lax.with_sharding_constraint(x, parallelism.sharding(logical, tuple(x.shape)))


def global_batch(local_rows: np.ndarray, parallelism: Parallelism | None, logical: Logical = ("batch", "seq")):
    """A global array from this process's rows of the batch (rows split over processes in order), sharded by
    ``logical``; on one device just the array."""
    if parallelism is None:
        return jax.numpy.asarray(local_rows)
    sharding = parallelism.sharding(logical)
    return jax.make_array_from_process_local_data(sharding, np.asarray(local_rows))


def replicated_batch(rows: np.ndarray, parallelism: Parallelism | None, logical: Logical = ("batch", "seq")):
    """A global array of ``rows``, which every process holds in full (held-out data), sharded by ``logical``."""
    if parallelism is None:
        return jax.numpy.asarray(rows)
    rows = np.asarray(rows)
    sharding = parallelism.sharding(logical, rows.shape)
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def drawn_on_host(make: Callable[[], Any]) -> Any:
    """``make()`` (a model's initialisation) run on the host's CPU, its arrays then put on the default device. An
    accelerator compiles each eager operation as a program of its own (a TPU spent 10 of the quickstart's 14 s of
    building its model compiling some fifty), a CPU runs them at once; and a seed draws the same parameters on every
    kind of device."""
    if jax.default_backend() == "cpu":
        return make()
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS names no cpu
        return make()
    with jax.default_device(cpu):
        made = make()

    def put(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.device_put(leaf, jax.devices()[0])
        return jax.device_put(np.asarray(leaf))  # uncommitted, on the default device, as an eager draw there was

    return jax.tree.map(put, made)


def to_host(tree: Any) -> Any:
    """Every array leaf as NumPy. A value replicated over processes (a loss, router statistics) is read
    from this process's copy, so every process can log it. All leaves are copied in one go (``jax.device_get``
    starts every copy before waiting on any): read one by one, a step's 22 terms cost 10 ms on a TPU, 16 s of
    the 1,600-step quickstart."""

    def local(leaf):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return leaf.addressable_data(0)
        return leaf

    return jax.device_get(jax.tree.map(local, tree))
