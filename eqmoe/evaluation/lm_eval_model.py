"""eqmoe models in lm-evaluation-harness: ``lm_eval.simple_evaluate(model="eqmoe", model_args="hf=DIR")``.

Importing this module registers :class:`EqmoeLM` as ``eqmoe`` in lm-eval's model registry. It follows lm-eval's
transformers backend (``HFLM``) request by request, so the two agree on the same folder:

- ``loglikelihood``: lm-eval tokenizes context and continuation (``TemplateLM._encode_pair``); the context is cut
  from the left to ``max_length`` as ``HFLM`` cuts it, and the batch is scored by :mod:`eqmoe.evaluation.scoring`
  (sorted by length, right padding the model ignores, a compiled program per length bucket).
- ``loglikelihood_rolling`` (perplexity): lm-eval's own rolling windows of ``max_length`` tokens
  (``get_rolling_token_windows`` + ``make_disjoint_window``), every window of every document in one batched pass.
- ``generate_until``: :func:`eqmoe.inference.generate` on left-padded batches, greedy unless the task samples, at
  most ``max_gen_toks`` new tokens; the text is decoded without special tokens and cut at the task's stop sequences.
  A row stops early on the folder's eos ids and on any token whose text holds a stop sequence (what follows it is
  cut anyway).
- the tokenizer is the model folder's (as transformers encodes plain text: with its post-processor's special
  tokens), and ``--apply_chat_template`` renders with its chat template (or the one the run trained with).
"""

import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from eqmoe import parallel
from eqmoe.checkpoints.source import ModelSource, folder_tokenizer, load_source
from eqmoe.data import ByteTokenizer, HFTokenizer
from eqmoe.data.tokenizer import check_tokenizer_fits
from eqmoe.evaluation.scoring import bucket_length, score
from eqmoe.inference import generate
from eqmoe.model import Transformer

DEFAULT_MAX_LENGTH = 2048  # lm-eval's, for a folder whose config.json names no max_position_embeddings


def _folder_max_length(folder: Path) -> int | None:
    try:
        value = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


@register_model("eqmoe")
class EqmoeLM(TemplateLM):
    """An eqmoe model for lm-eval, from a Hugging Face folder or Hub id (``hf``) or an eqmoe checkpoint
    (``checkpoint``: ``convert`` output or a run's ``checkpoints``, LoRA adapters applied), or given ready as
    ``source`` (a :class:`ModelSource`). ``max_length``: the longest input (default: ``config.json``'s
    ``max_position_embeddings``, else 2048, as ``HFLM``); ``parallelism``: a mesh to run on."""

    def __init__(
        self,
        hf: str | None = None,
        checkpoint: str | None = None,
        step: int | None = None,
        base: str | None = None,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        dtype: str = "float32",
        batch_size: int | str = 16,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        source: ModelSource | None = None,
        parallelism: parallel.Parallelism | None = None,
        device: str | None = None,  # lm-eval passes these two to every backend: the mesh (or JAX's device) decides
        max_batch_size: int | None = None,
    ):
        super().__init__()
        if source is None:
            source = load_source(
                hf_folder=hf, checkpoint=checkpoint, step=None if step is None else int(step), base=base, dtype=dtype
            )
        self._source = source
        self._tokenizer_path, self._chat_template_path = tokenizer, chat_template
        self._text = self._load_tokenizer(chat=False)
        self._chat: HFTokenizer | ByteTokenizer | None = None
        vocab = source.model.config.vocab_size
        check_tokenizer_fits(self._text.vocab_size, vocab, getattr(self._text, "path", None))
        self._parallelism = parallelism
        self.model: Transformer = parallel.shard(source.model, parallelism)
        self._batch_size = int(batch_size) if str(batch_size).isdigit() else 16  # "auto": a fixed batch compiles once
        self._max_length = int(max_length) if max_length else _folder_max_length(source.folder) or DEFAULT_MAX_LENGTH
        self._max_gen_toks = int(max_gen_toks)
        named = getattr(self._text, "special_tokens", {})
        eos = self._token_id(named.get("eos_token"))
        self._eot_id = eos if eos is not None else self._text.eos_id
        bos = self._token_id(named.get("bos_token"))
        self._prefix_id = bos if bos is not None else self._eot_id
        self._bos_text = named.get("bos_token")
        self._stop_tokens: dict[tuple[str, ...], list[int]] = {}

    # --- what lm-eval asks of a model -----------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eot_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self._text, "path", "bytes")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As ``HFLM.tok_encode``: the post-processor's special tokens unless asked not to or the text already
        starts with the BOS token."""
        starts_with_bos = self._bos_text is not None and string.startswith(self._bos_text)
        if add_special_tokens is False or (add_special_tokens is None and starts_with_bos):
            return self._text.encode_with_offsets([string])[0][0].tolist()
        return list(self._text.encode(string))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self._text.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        window = self.max_length + 1  # HFLM's: the input is at most max_length tokens, the last one not read
        scored = self._score([(list(ctx) + list(cont))[-window:], len(cont)] for _, ctx, cont in requests)
        answers = [(s.logprob, s.greedy) for s in scored]
        for (request, _, _), answer in zip(requests, answers, strict=True):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                windows.append((list(context) + list(continuation), len(continuation)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, scored in zip(owners, self._score(windows), strict=True):
            totals[owner] += scored.logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        texts: list[str | None] = [None] * len(requests)
        # HFLM adds the eos token's text, special or not, to every request's stop sequences
        eot = self.eot_token_id
        eos_text = getattr(self._text, "special_ids", {}).get(eot) or self._text.decode([eot])
        for indices in groups.values():
            options = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos_text)
            new_tokens = int(options.pop("max_gen_toks"))
            temperature = float(options.get("temperature") or 0.0) if options.get("do_sample") else 0.0
            top_p = float(options.get("top_p") or 1.0)
            if new_tokens >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={new_tokens} leaves no room for a prompt within max_length={self.max_length}"
                )
            contexts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - new_tokens) :] for i in indices}
            order = sorted(indices, key=lambda i: -len(contexts[i]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                generated = self._generate([contexts[i] for i in chunk], new_tokens, until, temperature, top_p)
                for i, ids in zip(chunk, generated, strict=True):
                    text = postprocess_generated_text(self._text.decode(ids), until, None)
                    texts[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts  # type: ignore[return-value]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return (
            self._chat_tokenizer().chat_template.render(chat_history, add_generation_prompt=add_generation_prompt).text
        )

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return self._chat_tokenizer().chat_template.source()

    # --- the work -------------------------------------------------------------------------------------------------

    def _score(self, requests):
        with parallel.activate(self._parallelism):
            return score(
                self.model,
                [(tokens, len(tokens) - count) for tokens, count in requests],
                batch_size=self.batch_size,
                max_length=self.max_length,
                pad_id=0,
            )

    def _generate(self, contexts: list[list[int]], new_tokens: int, until: list[str], temperature: float, top_p: float):
        """Each context's new ids, up to its first stop id (inclusive), at most ``new_tokens``."""
        width = bucket_length(max(len(ids) for ids in contexts))
        prompt = np.zeros((self.batch_size, width), np.int32)  # every batch as wide: one program per length bucket
        mask = np.zeros((self.batch_size, width), bool)
        mask[:, -1] = True  # a padding row reads one token
        for row, ids in enumerate(contexts):
            prompt[row, width - len(ids) :] = ids
            mask[row, width - len(ids) :] = True
        stops = self._stop_ids(until)
        with parallel.activate(self._parallelism):
            tokens = generate(
                self.model,
                jnp.asarray(prompt),
                prompt_mask=jnp.asarray(mask),
                max_new_tokens=new_tokens,
                temperature=temperature,
                top_p=top_p,
                key=jax.random.key(0) if temperature > 0 else None,
                eos_id=stops or None,
                vocab_limit=min(self._text.vocab_size, self.model.config.vocab_size),
            )
        out = []
        for row in np.asarray(parallel.to_host(tokens))[: len(contexts), width:].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
            out.append(row[:end])
        return out

    def _stop_ids(self, until: list[str]) -> list[int]:
        """The folder's eos ids and every id whose own text holds a stop sequence (computed once per set)."""
        key = tuple(sorted(set(until)))
        if key not in self._stop_tokens:
            ids = set(getattr(self._text, "stop_ids", ()) or ())
            limit = min(self._text.vocab_size, self.model.config.vocab_size)
            stops = [s for s in key if s]
            if stops:
                for i in range(limit):
                    text = self._text.decode([i])
                    if any(stop in text for stop in stops):
                        ids.add(i)
            self._stop_tokens[key] = sorted(i for i in ids if 0 <= i < self.model.config.vocab_size)
        return self._stop_tokens[key]

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._text.token_to_id(token)

    def _load_tokenizer(self, *, chat: bool):
        source = self._source
        return folder_tokenizer(
            source.folder,
            source.metadata,
            self._tokenizer_path,
            chat=chat,
            chat_template=self._chat_template_path,
        )

    def _chat_tokenizer(self):
        if self._chat is None:
            self._chat = self._load_tokenizer(chat=True)
        return self._chat
