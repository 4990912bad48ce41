"""Where a compiled program's time goes, from XLA's own trace of it (``jax.profiler``) and its optimized HLO.

Each operation the runtime executes is traced with its HLO name; its own time is its traced time less that of the
operations it runs inside it (a loop runs its body's). The HLO says what each operation is:

- its **kind**: ``matmul`` (a dot, alone or in a fusion), ``gather/scatter``, ``sort``, ``data movement`` (copies,
  slices, concatenation, transposes, broadcasts), ``elementwise`` (every other fusion: activations, softmax,
  reductions), ``loop control`` (the time a loop or branch takes beside its body) or ``other``;
- its **FLOPs**, for matmuls: ``2 * prod(result) * prod(contracted dims)`` of each dot it holds;
- its **pass**: in a program that takes a gradient, ``backward`` where JAX's name stack holds ``transpose(``,
  ``forward`` where it holds ``jvp(`` (the differentiated function), else ``update`` (what uses the gradient: the
  optimizer, the parameter update, the step's metrics) or ``unattributed`` (no name: an op XLA made itself, such as
  a loop buffer's zeros or a layout copy); every op of a program without a gradient is ``forward``;
- **where** it comes from: the innermost frame of the Python stack JAX recorded for it that lies in eqmoe or optax
  (``nn/flash.py:_forward``), else the innermost recorded frame.

On a CPU, operations may overlap on the machine's threads, so the own times can add up to more than the wall time.
"""

import collections
import functools
import gzip
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) .*\{$")
_SHAPE = re.compile(r"^[a-z0-9]+\[(?P<dims>[\d,]*)\]")
_MOVEMENT = {
    "copy", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "broadcast", "bitcast",
    "reshape", "pad", "reverse", "iota", "parameter", "constant", "tuple", "get-tuple-element", "bitcast-convert",
    "copy-start", "copy-done",
}  # fmt: skip
_CONTROL = {"while", "conditional", "call"}
KINDS = ("matmul", "elementwise", "gather/scatter", "sort", "data movement", "loop control", "other")


@dataclass(frozen=True)
class Op:
    """One top-level operation of the optimized HLO (what the runtime traces)."""

    name: str
    kind: str
    flops: float  # matmul FLOPs of one execution
    pass_: str
    where: str
    shape: tuple[int, ...] | None = None  # of its result; None for a tuple


@dataclass
class Line:
    """The operations of one kind, pass or origin together: own seconds per call, executions per call, matmul FLOPs
    per call."""

    seconds: float = 0.0
    count: float = 0.0
    flops: float = 0.0


@dataclass
class Profile:
    """A traced program: own seconds per call of every operation, summed by kind, pass and origin."""

    calls: int
    wall_seconds: float  # the median wall time of one call, measured beside the trace
    ops: dict[str, Line] = field(default_factory=dict)
    by_kind: dict[str, Line] = field(default_factory=dict)
    by_pass: dict[str, Line] = field(default_factory=dict)
    by_where: dict[str, Line] = field(default_factory=dict)  # by "origin [kind]"
    info: dict[str, Op] = field(default_factory=dict)

    @property
    def traced_seconds(self) -> float:
        return sum(line.seconds for line in self.by_kind.values())

    def matmul_rate(self) -> float:
        """The matmuls' own FLOP/s: their FLOPs over their own time."""
        line = self.by_kind.get("matmul", Line())
        return line.flops / line.seconds if line.seconds else 0.0


def _shape_of(text: str) -> tuple[int, ...] | None:
    match = _SHAPE.match(text)
    if match is None:
        return None
    return tuple(int(d) for d in match.group("dims").split(",") if d)


def _split_type(rest: str) -> tuple[str, str]:
    """``"f32[2,3]{1,0} dot(%a, %b), ..."`` -> ``("f32[2,3]{1,0}", "dot(%a, %b), ...")``; tuple types nest."""
    if rest.startswith("("):
        depth = 0
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    kind, _, tail = rest.partition(" ")
    return kind, tail


@dataclass
class _Instruction:
    shape: tuple[int, ...] | None
    opcode: str
    operands: list[str]
    attributes: str


def _parse(text: str) -> tuple[dict[str, dict[str, _Instruction]], dict[str, str]]:
    """``(computations, sections)``: each computation's instructions by name, and the text of the
    ``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables."""
    computations: dict[str, dict[str, _Instruction]] = {}
    sections: dict[str, list[str]] = {}
    current, section = None, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = sections.setdefault(line, [])
            continue
        if section is not None and line and not line.startswith("%") and not line.startswith("ENTRY"):
            section.append(line)
            continue
        section = None
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group("name"), {})
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is None or current is None:
            continue
        type_text, body = _split_type(instruction.group("rest"))
        opcode, _, tail = body.partition("(")
        operands_text, _, attributes = tail.partition(")")
        operands = re.findall(r"%([\w.\-]+)", operands_text)
        current[instruction.group("name")] = _Instruction(_shape_of(type_text), opcode, operands, attributes)
    return computations, {name: "\n".join(lines) for name, lines in sections.items()}


def _called(attributes: str) -> list[str]:
    """The computations an instruction calls: a fusion's, a loop's body and condition, a branch's."""
    single = re.findall(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)", attributes)
    branches = re.findall(r"branch_computations=\{([^}]*)\}", attributes)
    return single + [name.strip().lstrip("%") for group in branches for name in group.split(",")]


def _dot_flops(instruction: _Instruction, scope: dict[str, _Instruction]) -> float:
    lhs = scope.get(instruction.operands[0]) if instruction.operands else None
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
    if instruction.shape is None or lhs is None or lhs.shape is None or contracting is None:
        return 0.0
    contracted = 1
    for dim in (int(d) for d in contracting.group(1).split(",") if d):
        contracted *= lhs.shape[dim]
    result = 1
    for size in instruction.shape:
        result *= size
    return 2.0 * result * contracted


def _fused(computations, name: str) -> tuple[set[str], float]:
    """The opcodes and the matmul FLOPs inside computation ``name`` and the fusions it calls. Scalar results are left
    out of the opcodes: a slice's clamped start index is arithmetic, but the fusion moves data."""
    opcodes: set[str] = set()
    flops = 0.0
    scope = computations.get(name, {})
    for instruction in scope.values():
        if instruction.shape != ():
            opcodes.add(instruction.opcode)
        if instruction.opcode == "dot":
            flops += _dot_flops(instruction, scope)
        if instruction.opcode == "fusion":
            inner_opcodes, inner_flops = _inside(computations, instruction)
            opcodes |= inner_opcodes
            flops += inner_flops
    return opcodes, flops


def _inside(computations, fusion: _Instruction) -> tuple[set[str], float]:
    """The opcodes and matmul FLOPs of the computations a fusion calls (:func:`_fused` of each)."""
    opcodes: set[str] = set()
    flops = 0.0
    for called in _called(fusion.attributes):
        more, more_flops = _fused(computations, called)
        opcodes |= more
        flops += more_flops
    return opcodes, flops


def _kind(instruction: _Instruction, inside: set[str]) -> str:
    """:data:`KINDS`: what an instruction (with the opcodes of the fusions it calls, ``inside``) mostly does."""
    if instruction.opcode in _CONTROL:
        return "loop control"
    opcodes = (inside | {instruction.opcode}) - {"fusion"}
    target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
    if opcodes & {"dot", "convolution"} or (target and "matmul" in target.group(1)):
        return "matmul"
    if opcodes & {"gather", "scatter"}:
        return "gather/scatter"
    if "sort" in opcodes:
        return "sort"
    if opcodes <= _MOVEMENT:
        return "data movement"
    return "other" if instruction.opcode == "custom-call" else "elementwise"


class _Frames:
    """The Python stacks of the HLO's ``stack_frame_id`` (innermost frame first)."""

    def __init__(self, sections: dict[str, str]):
        def table(name: str) -> dict[int, str]:
            return {
                int(key): value
                for key, _, value in (line.partition(" ") for line in sections.get(name, "").splitlines())
            }

        self.files = {k: v.strip('"') for k, v in table("FileNames").items()}
        self.functions = {k: v.strip('"') for k, v in table("FunctionNames").items()}
        self.locations = table("FileLocations")
        self.frames = table("StackFrames")

    def stack(self, frame_id: int) -> list[str]:
        stack, seen = [], set()
        while frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            frame = dict(re.findall(r"(\w+)=(\d+)", self.frames[frame_id]))
            location = dict(re.findall(r"(\w+)=(\d+)", self.locations.get(int(frame.get("file_location_id", 0)), "")))
            file = self.files.get(int(location.get("file_name_id", 0)), "?")
            function = self.functions.get(int(location.get("function_name_id", 0)), "?")
            stack.append(f"{_short(file)}:{function}")
            parent = int(frame.get("parent_frame_id", 0))
            if parent == frame_id:
                break
            frame_id = parent
        return stack


@functools.cache
def _package_folders() -> tuple[tuple[str, str], ...]:
    """``(name, folder/)`` of eqmoe, optax and equinox where they are installed. A frame is named by the package
    it lies in, never by a folder's name: a checkout called ``eqmoe`` holds tests and experiments, not the package."""
    folders = []
    for name in ("eqmoe", "optax", "equinox"):
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for path in dict.fromkeys((folder, os.path.realpath(folder))):  # the path as imported, and resolved
                folders.append((name, path.rstrip(os.sep) + os.sep))
    return tuple(folders)


def _short(file: str) -> str:
    for name, folder in _package_folders():
        if file.startswith(folder):
            return f"{name}/{Path(file[len(folder) :]).as_posix()}"
    return Path(file).name


def _where(stack: list[str]) -> str:
    for frame in stack:
        if frame.startswith(("eqmoe/", "optax/")):
            return frame.removeprefix("eqmoe/")
    return stack[0] if stack else "?"


def _metadata(attributes: str) -> tuple[str, int | None]:
    name = re.search(r'op_name="([^"]*)"', attributes)
    frame = re.search(r"stack_frame_id=(\d+)", attributes)
    return (name.group(1) if name else ""), (int(frame.group(1)) if frame else None)


def _pass(op_name: str, differentiated: bool) -> str:
    if not differentiated:
        return "forward"
    if not op_name:  # made by XLA itself (a buffer's zeros, a layout copy): no pass of the program's
        return "unattributed"
    if "transpose(" in op_name:
        return "backward"
    return "forward" if "jvp(" in op_name else "update"


def operations(hlo_text: str) -> dict[str, Op]:
    """Every instruction of the optimized HLO's non-fused computations, by name, with its kind, matmul FLOPs, pass
    and origin."""
    computations, sections = _parse(hlo_text)
    frames = _Frames(sections)
    fused = {name for scope in computations.values() for i in scope.values() if i.opcode == "fusion"
             for name in _called(i.attributes)}  # fmt: skip
    differentiated = "jvp(" in hlo_text  # a gradient's program: its forward ops are traced under jvp
    ops = {}
    for computation, scope in computations.items():
        if computation in fused:
            continue
        for name, instruction in scope.items():
            inside, flops = set(), 0.0
            if instruction.opcode == "fusion":
                inside, flops = _inside(computations, instruction)
            elif instruction.opcode == "dot":
                flops = _dot_flops(instruction, scope)
            op_name, frame_id = _metadata(instruction.attributes)
            where = _where(frames.stack(frame_id) if frame_id is not None else [])
            kind, pass_ = _kind(instruction, inside), _pass(op_name, differentiated)
            ops[name] = Op(name, kind, flops, pass_, where, instruction.shape)
    return ops


def own_times(events: list[dict], names: set[str]) -> dict[str, tuple[int, float]]:
    """``name -> (executions, own seconds)`` of the traced operations named in ``names``: each event's duration less
    that of the events nested in it on the same thread."""
    by_thread: dict[tuple, list[dict]] = collections.defaultdict(list)
    for event in events:
        # the CPU runtime names the operation in the event's arguments, a TPU's op line by the event's own name
        op = (event.get("args") or {}).get("hlo_op") or event.get("name")
        if event.get("ph") == "X" and op in names:
            by_thread[(event.get("pid"), event.get("tid"))].append({**event, "op": op})
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, op name, own microseconds]
        for event in thread_events:
            while stack and stack[-1][0] <= event["ts"]:
                _close(stack.pop(), totals)
            if stack:
                stack[-1][2] -= event["dur"]
            stack.append([event["ts"] + event["dur"], event["op"], event["dur"]])
        while stack:
            _close(stack.pop(), totals)
    return {name: (count, seconds) for name, (count, seconds) in totals.items()}


def _close(entry: list, totals: dict) -> None:
    totals[entry[1]][0] += 1
    totals[entry[1]][1] += max(entry[2], 0.0) / 1e6


def trace_events(call: Callable[[], object], calls: int) -> list[dict]:
    """The trace events of ``calls`` calls of ``call`` (each waited for)."""
    with tempfile.TemporaryDirectory(prefix="eqmoe-profile-") as folder:
        with jax.profiler.trace(folder):
            for _ in range(calls):
                jax.block_until_ready(call())
        files = sorted(Path(folder).rglob("*.trace.json.gz"))
        if not files:
            raise RuntimeError(f"jax.profiler wrote no trace under {folder}")
        with gzip.open(files[-1]) as handle:
            return json.load(handle)["traceEvents"]


def profile(call: Callable[[], object], hlo_text: str, calls: int, wall_seconds: float) -> Profile:
    """``call`` (a compiled program whose optimized HLO is ``hlo_text``) traced over ``calls`` calls, per call."""
    info = operations(hlo_text)
    events = trace_events(call, calls)
    times = own_times(events, set(info))
    if not times:
        timed = collections.Counter(e.get("name") for e in events if e.get("ph") == "X")
        raise RuntimeError(
            f"none of the {len(events)} traced events names one of the program's {len(info)} operations (e.g. "
            f"{sorted(info)[:3]}); the most frequent event names: {[name for name, _ in timed.most_common(8)]}"
        )
    result = Profile(calls=calls, wall_seconds=wall_seconds, info=info)
    for name, (count, seconds) in times.items():
        op = info[name]
        line = Line(seconds / calls, count / calls, op.flops * count / calls)
        result.ops[name] = line
        where = f"{op.where} [{op.kind}]"
        for table, key in ((result.by_kind, op.kind), (result.by_pass, op.pass_), (result.by_where, where)):
            total = table.setdefault(key, Line())
            total.seconds += line.seconds
            total.count += line.count
            total.flops += line.flops
    return result
