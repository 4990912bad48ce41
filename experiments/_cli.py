"""How the experiments' command lines fail: an expected failure is one line on stderr and exit code 2;
anything else (a bug) keeps its traceback."""

import errno
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from eqmoe import parallel

Args = TypeVar("Args")
Result = TypeVar("Result")


class UsageError(Exception):
    """A failure the user can fix (a bad flag combination, a missing input): reported as one line."""


# FloatingPointError: training stopped on a non-finite loss, with the step and term named.
EXPECTED = (UsageError, ValueError, FileNotFoundError, FileExistsError, PermissionError, FloatingPointError)
DISK_ERRNOS = (errno.ENOSPC, errno.EROFS)  # a full or read-only disk under the output folder


def is_expected_failure(error: BaseException) -> bool:
    """Bad input or an unusable output location, as opposed to a bug (which keeps its traceback)."""
    return isinstance(error, EXPECTED) or (isinstance(error, OSError) and error.errno in DISK_ERRNOS)


def guarded(name: str, run: Callable[[Args], Result], args: Args) -> Result | None:
    """``run(args)``; on an expected failure print ``name: message`` (on one line) and return ``None``."""
    try:
        return run(args)
    except Exception as error:
        if not is_expected_failure(error):
            raise
        print(f"{name}: {' '.join(str(error).split())}", file=sys.stderr)
        return None


@dataclass(frozen=True)
class MeshOptions:
    mesh: str | None = None
    """Device mesh, e.g. data=2,expert=4 or fsdp=-1 (default: one device). Axes: data, fsdp, expert, tensor."""
    rules: str = ""
    """Logical-axis rule overrides, e.g. embed=,experts=expert (see eqmoe.parallel.DEFAULT_RULES)."""
    coordinator: str | None = None
    """host:port of process 0 for a multi-process run (or JAX_COORDINATOR_ADDRESS)."""
    num_processes: int | None = None
    """Processes in a multi-process run (or JAX_NUM_PROCESSES)."""
    process_id: int | None = None
    """This process's index in a multi-process run (or JAX_PROCESS_ID)."""

    def build(self) -> parallel.Parallelism | None:
        """Join the multi-process run if one is asked for, then the mesh (``None``: one device)."""
        joined = parallel.initialize_distributed(self.coordinator, self.num_processes, self.process_id)
        if self.mesh is None and not joined:
            return None
        return parallel.make_parallelism(self.mesh or "data=-1", self.rules)


def parse_template_vars(items: tuple[str, ...]) -> dict[str, object]:
    """``KEY=VALUE`` pairs; a VALUE that parses as JSON (``true``, ``3``, ``"x"``) is that value, else the text."""
    variables = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--template-var {item!r}: expected KEY=VALUE with KEY a name, e.g. enable_thinking=false")
        try:
            variables[key] = json.loads(value)
        except ValueError:
            variables[key] = value
    return variables


@dataclass(frozen=True)
class TokenizerOptions:
    tokenizer: Path | None = None
    """A Hugging Face tokenizer folder or its tokenizer.json; the folder's chat template (tokenizer_config.json or
    chat_template.jinja) and generation_config.json come with it (default: bytes, 260 ids, built-in ChatML)."""
    chat_template: Path | None = None
    """A Jinja chat template file (or a tokenizer_config.json) to render conversations with instead."""
    template_var: tuple[str, ...] = ()
    """Template variables KEY=VALUE (VALUE read as JSON when it parses), e.g. enable_thinking=false."""

    def load(self):
        """The tokenizer with its chat template."""
        from eqmoe.data import load_tokenizer

        variables = parse_template_vars(self.template_var)
        return load_tokenizer(self.tokenizer, chat_template=self.chat_template, template_vars=variables)
