"""Timing ``auto``'s candidates: one workload's candidates timed (or read from the cache), the fastest median chosen."""

import concurrent.futures
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax

ENV = "EQMOE_AUTO"
REPEATS = 3


@dataclass(frozen=True)
class Measurement:
    """How one ``auto`` field was resolved: ``how`` is ``"measured"``, ``"cached"`` or ``"recorded by the run"`` (a
    resumed run's choice); ``seconds`` the median seconds per call of each timed backend; ``skipped`` why
    the others were not timed."""

    field: str
    choice: str
    how: str
    workload: str = ""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    settings: dict[str, str] = dataclasses.field(default_factory=dict)  # e.g. {"moe.tiles": "512,1024,1024"}

    def choices(self) -> dict[str, str]:
        """The execution fields this choice sets: the backend's and, for a kernel timed at several tilings, its
        tiling's."""
        return {self.field: self.choice, **self.settings}

    def line(self) -> str:
        timed = ", ".join(
            f"{name} {seconds * 1e3:.2f} ms" for name, seconds in sorted(self.seconds.items(), key=_by_time)
        )
        setting = "".join(f", {name}={value}" for name, value in self.settings.items())
        parts = [f"auto {self.field} -> {self.choice!r}{setting} ({self.how}"]
        if self.workload:
            parts.append(f" on {self.workload}")
        parts.append(f": {timed}" if timed else "")
        parts.append(")")
        if self.skipped:
            parts.append("; not timed: " + "; ".join(f"{name} ({why})" for name, why in self.skipped.items()))
        return "".join(parts)


def _by_time(item: tuple[str, float]) -> float:
    return item[1]


class Workload:
    """One field's candidates on one shape: ``key`` identifies it in the cache, ``eligible`` says why a candidate
    is not timed (``None``: timed), ``program(label)`` is ``(jitted function, arguments)``. A candidate is a
    backend's name, or ``name[setting]`` for a kernel timed at one of several tilings (:func:`label`)."""

    field: str
    setting: str  # the execution field a candidate's tiling sets
    description: str
    key: dict

    def candidates(self) -> tuple[str, ...]:
        raise NotImplementedError

    def eligible(self, name: str, candidates: tuple[str, ...]) -> str | None:
        return None

    def program(self, label: str):
        raise NotImplementedError

    def measurement(self, label: str, how: str, **details) -> Measurement:
        name, setting = unlabel(label)
        settings = {} if setting is None else {self.setting: setting}
        return Measurement(self.field, name, how, self.description, settings=settings, **details)


def label(name: str, setting: tuple[int, ...] | int) -> str:
    """``gmm[512,1024,1024]``: a backend at one tiling."""
    values = setting if isinstance(setting, tuple) else (setting,)
    return f"{name}[{','.join(str(v) for v in values)}]"


def at_settings(names: tuple[str, ...], kernel: str, settings) -> tuple[str, ...]:
    """``names`` with ``kernel`` in its place once per setting (:func:`label`), the others as they are."""
    return tuple(
        candidate for name in names for candidate in ([label(name, s) for s in settings] if name == kernel else [name])
    )


def unlabel(label: str) -> tuple[str, str | None]:
    name, bracket, setting = label.partition("[")
    return name, setting.rstrip("]") if bracket else None


def off_platform(platforms: tuple[str, ...] | None) -> str | None:
    """Why a kernel made for ``platforms`` is not timed here (``None``: it is)."""
    platform = jax.default_backend()
    if platforms is None or platform in platforms:
        return None
    return f"a {'/'.join(p.upper() for p in platforms)} kernel (interpret mode on {platform.upper()})"


def cached_or_timed(workload: Workload, cache: Path) -> Measurement:
    candidates = workload.candidates()
    device = jax.devices()[0]
    key = json.dumps(
        {
            **workload.key,
            "field": workload.field,
            "device": f"{device.platform}:{device.device_kind}",
            "candidates": candidates,
        },
        sort_keys=True,
    )
    entries = _read_cache(cache)
    entry = entries.get(key)
    if isinstance(entry, dict) and entry.get("choice") in candidates:
        return workload.measurement(entry["choice"], "cached", seconds=entry.get("seconds", {}))
    skipped = {name: why for name in candidates if (why := workload.eligible(name, candidates)) is not None}
    programs = _compiled([name for name in candidates if name not in skipped], workload, skipped)
    seconds = {}
    for name, (function, arguments) in programs.items():  # one at a time: timings must not share the device
        try:
            seconds[name] = time_calls(function, arguments, best=min(seconds.values(), default=None))
        except Exception as error:
            skipped[name] = _why_skipped(error)
    if not seconds:
        raise ValueError(f"auto {workload.field}: no registered backend can run {workload.description}: {skipped}")
    choice = min(seconds, key=seconds.__getitem__)
    _write_cache(cache, {**entries, key: {"choice": choice, "seconds": seconds}})
    return workload.measurement(choice, "measured", seconds=seconds, skipped=skipped)


def _compiled(names: list[str], workload: Workload, skipped: dict[str, str]) -> dict:
    """Each candidate's program, compiled (:func:`compiled_side_by_side`); a candidate that refuses the config, or
    whose program does not fit, goes to ``skipped`` with why."""
    programs = {}
    for name, result in compiled_side_by_side(
        {name: functools.partial(workload.program, name) for name in names}
    ).items():
        if isinstance(result, Exception):
            skipped[name] = _why_skipped(result)
        else:
            programs[name] = result
    return programs


def compiled_side_by_side(makers: dict[str, Callable[[], tuple]]) -> dict[str, tuple | Exception]:
    """Each ``make() -> (jitted function, arguments)`` traced in turn and compiled side by side (XLA compiles on host
    threads, and a TPU host has cores to spare: ten programs cost about the slowest compile, not the sum). Returns
    each name's ``(compiled function, arguments)``, or the exception its making or compiling raised. A plain (not
    jitted) function is left to compile at its first call."""
    results: dict[str, tuple | Exception] = {}
    compiling = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(makers), os.cpu_count() or 1))) as pool:
        for name, make in makers.items():
            try:
                function, arguments = make()
                results[name] = (function, arguments)
                if hasattr(function, "lower"):
                    compiling[name] = pool.submit(function.lower(*arguments).compile)
            except Exception as error:
                results[name] = error
    for name, future in compiling.items():
        try:
            results[name] = (future.result(), results[name][1])
        except Exception as error:
            results[name] = error
    return results


def _why_skipped(error: Exception) -> str:
    """Why a candidate that raised ``error`` is not timed: it refuses this config (its first line), or its program
    does not fit the device; anything else is raised again."""
    if isinstance(error, jax.errors.JaxRuntimeError):  # e.g. XLA:CPU's dense emulation of ragged_dot at 256 experts
        if "RESOURCE_EXHAUSTED" in str(error):
            return "out of memory"
        raise error
    if isinstance(error, ValueError | TypeError | NotImplementedError):
        return str(error).splitlines()[0][:120]
    raise error


def time_calls(function, arguments, *, best: float | None, repeats: int = REPEATS) -> float:
    """Median seconds of ``repeats`` calls after a warm-up (compiling) call; a backend already ten times slower
    than ``best`` after one call is not called again."""
    jax.block_until_ready(function(*arguments))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(function(*arguments))
        times.append(time.perf_counter() - started)
        if best is not None and times[-1] > 10 * best:
            break
    return statistics.median(times)


def _read_cache(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: measure again
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, entries: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(partial, path)
    except OSError as error:  # a read-only cache costs a measurement next time, nothing else
        print(f"auto: could not write {path} ({error})", file=sys.stderr)
