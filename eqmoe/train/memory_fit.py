"""A train step fits the device's memory before it runs, or the run stops in one line naming settings that fit.

Before the first step the loop compiles the step it will run (the real state and the first batch) and reads XLA's
memory analysis: the bytes the program holds at once are its arguments, its temporaries and the outputs that do not
reuse an argument's buffer (``argument + temp + output - alias``). That is compared with the memory the device has
(``memory_stats()["bytes_limit"]``, 15.75 GiB on a TPU v5e; a CPU reports none, so there only a stated
``--device-memory-gib`` is checked). The compiled program is the one the loop then calls, so nothing is compiled
twice.

``remat="auto"`` compiles the step under each policy of :data:`eqmoe.config.REMATS` (side by side where the host
has the cores) and keeps the first that fits, least recomputation first.
A step that fits under no setting asked for raises :class:`DoesNotFit`: what it needs, what the device has, and what
would fit (another remat policy; the output layer in chunks, ``--override output_chunk=N``, where the logits are what
does not fit; or the same batch in smaller micro-batches with ``--grad-accum``: temporaries shrink with the
micro-batch, arguments do not).
"""

import concurrent.futures
import os
import re
import sys
from collections.abc import Callable
from typing import NamedTuple

import jax

from eqmoe.config import REMATS
from eqmoe.train.state import abstract_state

GIB = 2**30
HEADROOM = 0.97  # of the device's memory: what the runtime itself holds beside the program


class DoesNotFit(ValueError):
    """The step needs more memory than the device has (a one-line message: an expected failure, exit 2)."""


class Need(NamedTuple):
    """The bytes one compiled step holds at once, in XLA's terms."""

    argument: float
    temp: float
    output: float
    alias: float

    @property
    def total(self) -> float:
        return self.argument + self.temp + self.output - self.alias

    def with_micro_batches(self, parts: int) -> float:
        """About what the step would hold with its batch split into ``parts`` micro-batches: the arguments and new
        state stay, the temporaries (activations) shrink with the rows."""
        return self.argument + self.output - self.alias + self.temp / parts


def device_memory(stated_gib: float | None) -> float | None:
    """Bytes a device has for a step: ``stated_gib``, else what the device reports (``None``: it reports none)."""
    if stated_gib is not None:
        return stated_gib * GIB
    stats = jax.local_devices()[0].memory_stats()  # another process's device reports nothing here
    return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def compile_step(step, batch, state) -> tuple[Callable | None, Need]:
    """``(the compiled step, what it holds)`` for these arguments. A compiler that refuses a program larger than the
    device (XLA:TPU's ``RESOURCE_EXHAUSTED ... HLO temporaries (35.83G) exceeds available HBM``) gives no program and
    the temporaries it named beside the arguments' own bytes."""
    return _compiled_need(step.lower(batch, state), batch, state)


def compile_steps(make_step: Callable[[], Callable], batch, states: dict[str, object], fits: Callable) -> dict:
    """:func:`compile_step` of the named states in order up to the first whose step ``fits``; where the host has a
    core for each, all of them compiled side by side instead (a TPU host's 13 cores compile the four remat policies
    in about the time of the slowest; a 2-core CPU compiles no more than it needs)."""
    if (os.cpu_count() or 1) < len(states):
        compiled = {}
        for name, state in states.items():
            compiled[name] = compile_step(make_step(), batch, state)
            if fits(*compiled[name]):
                break
        return compiled
    lowered = {name: make_step().lower(batch, state) for name, state in states.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(lowered)) as pool:
        futures = {name: pool.submit(_compiled_need, program, batch, states[name]) for name, program in lowered.items()}
    return {name: future.result() for name, future in futures.items()}


def _compiled_need(lowered, batch, state) -> tuple[Callable | None, Need]:
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        temporaries = re.search(r"temporaries \(([\d.]+)([KMGT])\)", str(error))
        if "RESOURCE_EXHAUSTED" not in str(error) or temporaries is None:
            raise
        scale = 2 ** (10 * "KMGT".index(temporaries.group(2)) + 10)
        argument = sum(x.nbytes for x in jax.tree.leaves((batch, state)) if hasattr(x, "nbytes"))
        return None, Need(float(argument), float(temporaries.group(1)) * scale, 0.0, 0.0)
    memory = compiled.compiled.memory_analysis()
    need = Need(
        float(memory.argument_size_in_bytes),
        float(memory.temp_size_in_bytes),
        float(memory.output_size_in_bytes),
        float(memory.alias_size_in_bytes),
    )
    return compiled, need


def under_remat(state, remat: str, optimizer, **changes):
    """``state`` with its model run under ``remat`` (and other execution ``changes``, e.g. ``output_chunk``): the same
    arrays, the model's config (static, and repeated in the optimizer state's tree) replaced throughout."""
    model = state.model.with_config(state.model.config.replace(remat=remat, **changes))
    target = abstract_state(lambda: model, optimizer, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(state))


def fit(
    state, optimizer, make_step: Callable[[], Callable], batch, *, stated_gib: float | None, rows: int, grad_accum: int
):
    """``(state, step)``: the state under the remat policy the step runs with and the step to call, compiled for
    ``batch`` when a memory limit is known (else the jitted step, as it is). ``rows``: the rows of one micro-batch
    (``--batch-size``); ``grad_accum``: the micro-batches a step takes. Raises :class:`DoesNotFit`."""
    limit = device_memory(stated_gib)
    config = state.model.config
    asked = config.remat
    if limit is None:
        if asked == "auto":
            print(
                "auto remat -> 'none' (the device reports no memory limit; --device-memory-gib states one)",
                file=sys.stderr,
            )
            state = under_remat(state, "none", optimizer)
        return state, make_step()
    candidates = [r for r in REMATS if r != "auto"] if asked == "auto" else [asked]
    trials = {remat: under_remat(state, remat, optimizer) for remat in candidates}

    def fits(step, need) -> bool:
        return step is not None and need.total <= HEADROOM * limit

    compiled = compile_steps(make_step, batch, trials, fits)
    needs = {}
    for remat in compiled:  # least recomputation first
        trial, (step, need) = trials[remat], compiled[remat]
        needs[remat] = need
        if fits(step, need):
            if asked == "auto":
                tried = ", ".join(f"{name} {n.total / GIB:.2f} GiB" for name, n in needs.items())
                print(
                    f"auto remat -> {remat!r} (compiled step: {tried}; device {limit / GIB:.2f} GiB)", file=sys.stderr
                )
            return trial, step
    raise DoesNotFit(_refusal(asked, needs, limit, state, optimizer, make_step, batch, rows, grad_accum))


def _refusal(asked, needs, limit, state, optimizer, make_step, batch, rows, grad_accum) -> str:
    """The one line: what the step needs, what the device has, what fits."""
    need = needs[asked if asked != "auto" else "none"]
    fits = []
    if asked != "auto":  # the other policies, compiled (a cheaper one may fit where the one asked does not)
        others = {r: under_remat(state, r, optimizer) for r in REMATS if r not in ("auto", asked)}
        compiled = compile_steps(make_step, batch, others, lambda _, need: need.total <= HEADROOM * limit)
        needs.update({remat: need for remat, (_, need) in compiled.items()})
        for remat in compiled:
            if needs[remat].total <= HEADROOM * limit:
                fits.append(f"--remat {remat} ({needs[remat].total / GIB:.2f} GiB)")
                break
    chunked = _output_in_chunks(asked, needs, limit, state, optimizer, make_step, batch, grad_accum)
    if chunked:
        fits.append(chunked)
    leanest = min(needs, key=lambda name: needs[name].total)
    for parts in (p for p in range(2, rows + 1) if rows % p == 0):
        if needs[leanest].with_micro_batches(parts) <= HEADROOM * limit:
            remat = "" if leanest == "none" else f"--remat {leanest} "
            about = needs[leanest].with_micro_batches(parts) / GIB
            fits.append(
                f"{remat}--batch-size {rows // parts} --grad-accum {grad_accum * parts} (about {about:.2f} GiB)"
            )
            break
    what = "nothing here: a smaller model or more devices" if not fits else " or ".join(fits)
    policy = "under every remat policy" if asked == "auto" else f"with --remat {asked}"
    return (
        f"the train step needs {need.total / GIB:.2f} GiB {policy} (arguments {need.argument / GIB:.2f}, temporaries "
        f"{need.temp / GIB:.2f}) but the device has {limit / GIB:.2f} GiB; fits: {what}"
    )


# Output positions at a time suggested where a step's logits are what does not fit (a wide vocabulary: 152k x 16 x
# 2048 tokens hold 18.5 GiB of float32 logits, as much again for their gradient)
OUTPUT_CHUNK = 256


def _output_in_chunks(asked, needs, limit, state, optimizer, make_step, batch, grad_accum) -> str | None:
    """``--override output_chunk=N (X GiB)`` where the step under the policy asked (``none`` for ``auto``) fits with its
    output layer taken in chunks; compiled only where the float32 logits and their gradient could make up what is
    missing."""
    config = state.model.config
    rows, seq = batch.tokens.shape
    chunk = min(OUTPUT_CHUNK, max(1, seq // 8))
    remat = asked if asked != "auto" else "none"
    logits = 8 * rows // grad_accum * seq * config.vocab_size
    if config.output_chunk or chunk >= seq or logits < needs[remat].total - HEADROOM * limit:
        return None
    trial = under_remat(state, remat, optimizer, output_chunk=chunk)
    step, need = compile_step(make_step(), batch, trial)
    if step is None or need.total > HEADROOM * limit:
        return None
    policy = "" if asked != "auto" else "--remat none "
    return f"{policy}--override output_chunk={chunk} ({need.total / GIB:.2f} GiB)"
