"""The option groups every experiment shares: one name, type and help for each, so that ``--tokenizer``,
``--batch-size`` or ``--mesh`` mean the same in every command. A command takes a group by inheriting it (tyro
shows the fields flat) and sets its own defaults by instantiating it. ``tests/test_shared_options.py`` walks
every command's parser to hold this."""

import dataclasses
import importlib
import json
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import tyro

Dtype = Literal["float32", "bfloat16"]

# ``--import A --import B``: the flag is named after the statement, which a field cannot be.
ImportModules = Annotated[tuple[str, ...], tyro.conf.arg(name="import"), tyro.conf.UseAppendAction]


@dataclass(frozen=True)
class DtypeOption:
    dtype: Dtype = "float32"
    """Compute dtype (training keeps float32 parameters and optimizer state; other commands hold the parameters
    in it too)."""


@dataclass(frozen=True)
class PresetOptions:
    preset: str = "qwen3-moe-micro"
    """Model preset (see eqmoe.presets.names()); a starting model given by --init-from-* replaces it."""
    override: tuple[str, ...] = ()
    """Config changes FIELD.PATH=VALUE, e.g. moe.router.top_k=1 norm.ffn_placement=post (values are JSON or text)."""

    def preset_config(self):
        """The preset with ``--override`` applied; a ``ValueError`` naming a bad field or value."""
        from eqmoe import presets
        from eqmoe.config_io import apply_overrides, parse_override

        return apply_overrides(presets.get(self.preset), dict(parse_override(text) for text in self.override))


def import_modules(names: tuple[str, ...]) -> None:
    """Import each module by name (``--import``), so what it registers is there before any config is checked."""
    from experiments._cli import UsageError

    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # the user's module: whatever it raises is a usage error of one line
            frame = traceback.extract_tb(error.__traceback__)[-1]
            where = "" if isinstance(error, ModuleNotFoundError) else f" ({frame.filename}:{frame.lineno})"
            raise UsageError(f"--import {name}: {type(error).__name__}: {error}{where}") from None


@dataclass(frozen=True)
class StartOptions(DtypeOption, PresetOptions):
    """Where a training run starts: a preset, or a trained model, with config changes and plug-in modules."""

    # an --override that changes the architecture is refused by the resume itself, naming the fields; a starting
    # model that moved is checked by its content digest
    changeable_on_resume: ClassVar[frozenset[str]] = frozenset(
        {"dtype", "remat", "scan_unroll", "override", "init_from_hf", "init_from_checkpoint"}
    )

    init_from_hf: Path | None = None
    """Start from this Hugging Face model: a folder (config.json + safetensors, any registered family) or a Hub id
    ORG/NAME[@REVISION]."""
    init_from_checkpoint: Path | None = None
    """Start from this eqmoe checkpoint (experiments.convert output or a run's checkpoints folder)."""
    import_modules: ImportModules = ()
    """Python module to import first (repeat the flag for more), e.g. one registering a router strategy."""
    remat: Literal["none", "dots", "offload", "block", "auto"] = "none"
    """What the backward pass recomputes to save memory: none; dots keeps matmul and kernel outputs; offload moves
    them to host memory; block recomputes each layer unit; auto: the least recomputation whose compiled step fits the
    device's memory."""
    scan_unroll: int = 4
    """A stack of layers repeating its unit at most this many times runs unrolled in its scan (ModelConfig.scan_unroll:
    the same numbers; on a CPU a shallow model's step is faster); deeper ones scan one unit at a time."""

    def execution(self, config):
        """``config`` with ``--dtype``, ``--remat``, ``--scan-unroll`` and float32 parameters."""
        return config.replace(dtype=self.dtype, param_dtype="float32", remat=self.remat, scan_unroll=self.scan_unroll)


@dataclass(frozen=True)
class DispatchOption:
    dispatch: str | None = None
    """MoE dispatch backend: auto or one registered in eqmoe.nn.dispatch.BACKENDS (dense, sorted, ragged_dot,
    capacity; default: the model's own)."""

    def with_dispatch(self, config):
        """``config`` with ``--dispatch`` (as it is without one); a one-line ``UsageError`` for a model without MoE
        layers or a backend that is not registered."""
        from eqmoe.registries import check_names
        from experiments._cli import UsageError

        if self.dispatch is None:
            return config
        if config.moe is None:
            raise UsageError("--dispatch: the model has no MoE layers")
        try:
            config = config.replace(moe=dataclasses.replace(config.moe, dispatch=self.dispatch))
            check_names(config)  # a backend is looked up by name: refuse an unregistered one at the start
        except ValueError as error:
            raise UsageError(f"--dispatch: {error}") from None
        return config


@dataclass(frozen=True)
class LoRAOptions:
    lora_rank: int | None = None
    """Train LoRA adapters of this rank instead of the weights (the base stays frozen; default: no LoRA)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: adapters are scaled by alpha / rank."""
    lora_targets: tuple[str, ...] = ("attention", "experts")
    """What gets adapters: attention, mlp, router, experts, or one matrix such as attention.q or experts.down."""
    lora_dropout: float = 0.0
    """Training-time dropout on the inputs of the attention and dense-FFN adapters (PEFT's lora_dropout)."""
    fp8_base: bool = False
    """With --lora-rank: hold the frozen base of a block-FP8 folder (DeepSeek-V3's published files) as stored, one byte
    per parameter plus a scale per block, dequantized layer by layer inside the step (default: dequantized on load)."""

    def lora(self):
        """The :class:`eqmoe.lora.LoRAConfig` asked for (``None``: no LoRA); a ``ValueError`` naming a bad option."""
        from eqmoe.lora import LoRAConfig

        if self.fp8_base and self.lora_rank is None:
            raise ValueError("--fp8-base needs --lora-rank: a base held in FP8 is never trained, only adapters over it")
        if self.lora_rank is None:
            return None
        try:
            return LoRAConfig(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_dropout)
        except ValueError as error:
            raise ValueError(f"--lora: {error}") from None


@dataclass(frozen=True)
class SeqLenOption:
    seq_len: int = 128
    """Tokens per row (longer documents or conversations are cut, and the command says how many)."""


@dataclass(frozen=True)
class ShapeOptions(SeqLenOption):
    batch_size: int = 16
    """Rows per batch (per optimizer step in training; the global batch on a mesh)."""


@dataclass(frozen=True)
class TokenizerOption:
    tokenizer: Path | None = None
    """A Hugging Face tokenizer: a folder (its tokenizer.json, else its tiktoken.model), either file, or a Hub id
    ORG/NAME[@REVISION] (default: the model's own where the command reads a model, else as its description says:
    eqmoe's 260 byte ids for a preset)."""


@dataclass(frozen=True)
class TokenizerOptions(TokenizerOption):
    chat_template: Path | None = None
    """A Jinja chat template file (or a tokenizer_config.json) to render conversations with instead of the
    tokenizer's (or the one the run trained with)."""
    template_var: tuple[str, ...] = ()
    """Template variables KEY=VALUE (VALUE read as JSON when it parses), e.g. enable_thinking=false (Qwen3) or
    reasoning_effort=high (gpt-oss)."""

    def variables(self) -> dict[str, object]:
        """``--template-var`` as a dict; a ``ValueError`` naming a malformed item."""
        variables = {}
        for item in self.template_var:
            key, sep, value = item.partition("=")
            if not sep or not key.isidentifier():
                raise ValueError(
                    f"--template-var {item!r}: expected KEY=VALUE with KEY a name, e.g. enable_thinking=false"
                )
            try:
                variables[key] = json.loads(value)
            except ValueError:
                variables[key] = value
        return variables

    def load(self):
        """The tokenizer with its chat template (eqmoe's byte tokenizer when none is named)."""
        from eqmoe.data import load_tokenizer

        return load_tokenizer(self.tokenizer, chat_template=self.chat_template, template_vars=self.variables())


@dataclass(frozen=True)
class ModelSourceOptions:
    """The trained model a command reads: a Hugging Face model or an eqmoe checkpoint."""

    hf: Path | None = None
    """Hugging Face model: a folder (config.json + safetensors, any registered family) or a Hub id
    ORG/NAME[@REVISION]."""
    checkpoint: Path | None = None
    """eqmoe checkpoint: experiments.convert output or a training run's checkpoints folder."""
    step: int | None = None
    """With --checkpoint: the step to read (default: the latest)."""
    base: Path | None = None
    """With --checkpoint: its base model folder where it has moved (for a checkpoint that holds only what training
    changed; default: where the run read it)."""


@dataclass(frozen=True)
class MeshOptions:
    changeable_on_resume: ClassVar[frozenset[str]] = frozenset(
        {"mesh", "rules", "coordinator", "num_processes", "process_id"}
    )

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

    def build(self):
        """Join the multi-process run if one is asked for, then the mesh (``None``: one device)."""
        from eqmoe import parallel  # here: a command may set the device count before JAX starts

        joined = parallel.initialize_distributed(self.coordinator, self.num_processes, self.process_id)
        if self.mesh is None and not joined:
            return None
        return parallel.make_parallelism(self.mesh or "data=-1", self.rules)


@dataclass(frozen=True)
class JsonOptions:
    json: bool = False
    """Print JSON on stdout (what the command reports, as data) instead of the human-readable view."""


@dataclass(frozen=True)
class JsonFileOptions:
    json_out: Path | None = None
    """Also write the results to this JSON file."""


@dataclass(frozen=True)
class EvalTaskOptions:
    """How lm-evaluation-harness runs its tasks (``experiments.evaluate``, the training commands' ``--eval-tasks``)."""

    include_path: Path | None = None
    """A folder of lm-eval task YAMLs to add to lm-eval's own (local tasks and data)."""
    limit: float | None = None
    """Documents per task (a fraction below 1: that share of each task); default: all."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (default: each task's own)."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (few-shot examples as turns)."""
    eval_batch_size: int = 16
    """Requests per batch (each length bucket is compiled once for this many rows)."""
    max_length: int | None = None
    """Longest input in tokens: longer contexts are cut from the left, perplexity uses windows of this length
    (default: config.json's max_position_embeddings, else 2048)."""


@dataclass(frozen=True)
class EvalOptions(EvalTaskOptions):
    """lm-eval tasks a training run is scored on when it ends (its summary.json's ``lm_eval``)."""

    # scoring the final model changes nothing about training
    changeable_on_resume: ClassVar[frozenset[str]] = frozenset(
        {"eval_tasks", "include_path", "limit", "num_fewshot", "apply_chat_template", "eval_batch_size", "max_length"}
    )

    eval_tasks: tuple[str, ...] = ()
    """lm-eval tasks to score the final model on (needs pip install 'eqmoe[eval]'); local task YAMLs with
    --include-path DIR."""
