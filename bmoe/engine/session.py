"""One loaded model and its context, driven from one engine thread.

Theory of operation
-------------------
A `Session` owns a llama.cpp model and one context made through llama-cpp-python's
low-level bindings, so that we choose every field of `llama_context_params` (the
abort callback, and the graph-eval callback the expert streamer feeds on). Every
method is called from the one engine thread (`bmoe.engine.thread.EngineThread`);
nothing here is thread-safe except `Turn.cancel`, which is a `threading.Event` the
abort callback and the decode loop read.

The KV cache holds the tokens of the last prompt plus its answer (`kv_tokens`).
A new prompt keeps the longest common prefix and prefills only the rest; at least
one token is always decoded so the sampler has fresh logits.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import llama_cpp as lc

from .calibrate import Arm, Trial
from . import families
from .chatparse import detect_framing
from .errors import Aborted, EngineError, LoadError, context_full
from . import (backend, builtin_templates, embed, kernels, moegemm, params, rpc, vocab_guard,
               weight_types)
from .grammar_guard import GrammarRefused, check_grammar
from .kernels import KernelChoice
from ..machine import probe_memory
from ..models.probe import model_bytes
from .sampling import (Sampling, build_chain, chain_biases, post_sampling_logprobs,
                       top_logprobs)
from .templating import ChatTemplate, TemplateError
from .vision import Vision, open_vision, reuse_start

log = logging.getLogger("bmoe.chat")

SEED_RANDOM = 4294967295
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
PREFILL_CHUNK = params.PROMPT_BATCH  # tokens per llama_decode by default (batch-size)
MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file (the largest real ones are ~40 KiB)


class Streamer(Protocol):
    """What the expert streamer offers the session (see bmoe.engine.experts)."""

    def configure_model_params(self, params: Any) -> None: ...
    def configure_context_params(self, params: Any) -> None: ...
    def attach(self, model: Any, ctx: Any) -> None: ...
    def prefill_begin(self) -> None: ...
    def batch_begin(self, n_tokens: int, n_outputs: int, n_after: int) -> None: ...
    def prefill_end(self) -> None: ...
    def token_begin(self) -> None: ...
    def token_end(self) -> dict[str, Any]: ...
    def summary(self) -> dict[str, Any]: ...
    def failure(self) -> str | None: ...     # a failure inside the graph callback, once
    def close(self) -> None: ...


@dataclass
class TokenEvent:
    step: int            # 1-based index of the generated token
    token: int
    text: str            # decoded text of this token (UTF-8 held back to whole chars)
    wall_ms: float
    telemetry: dict[str, Any] = field(default_factory=dict)
    logprob: float | None = None     # with `Sampling.n_probs`: this token's log-probability
    top: list[tuple[int, float, bytes]] | None = None  # ... the most likely (id, logprob, piece)


@dataclass
class PrefillProgress:
    """How far a prompt's prefill has come (llama-server's `prompt_progress`): `processed`
    counts the prompt's positions the KV holds, the `cache` it started from included."""
    total: int
    cache: int
    processed: int
    elapsed_ms: float


@dataclass
class Generation:
    finish: str                      # "stop" | "length" | "cancelled"
    tokens: list[int]
    text: str
    n_prompt: int                    # whole prompt the answer was conditioned on
    n_cached: int                    # prompt tokens the KV already held
    n_prefilled: int
    prefill_s: float
    decode_s: float
    ttft_s: float
    n_past: int                      # context used after the turn
    budget_cut_by_context: bool = False
    requested_budget: int = 0
    stop_word: str = ""              # the `Sampling.stop` string that ended it, if one did
    logit_bias: tuple[tuple[int, float], ...] = ()   # the biases the sampler added (ids)


def _meta(model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = lc.llama_model_meta_val_str(model, key.encode(), buf, ctypes.sizeof(buf))
    if n < 0:
        return None
    return buf.value.decode("utf-8", "replace")


def grammar_sampler(vocab: Any, grammar: str, tokens: list[int], patterns: list[str]) -> Any:
    """llama.cpp's grammar sampler; lazy when there are triggers: free text until a trigger
    token is sampled or the text so far matches a trigger pattern (`triggers`: a family's
    marker word, only where the grammar holds what follows it), then held to the grammar."""
    if not tokens and not patterns:
        return lc.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    toks = (lc.llama_token * len(tokens))(*tokens)
    words = [p.encode() for p in patterns]
    regexes = (ctypes.c_char_p * len(words))(*words)
    return lc.llama_sampler_init_grammar_lazy_patterns(
        vocab, grammar.encode(), b"root", regexes if words else None, len(words),
        toks, len(tokens))


class Session:
    # Set while the model loads (`_open`, `_make_context`, `_setup_template`): llama.cpp's
    # handles are ctypes values, typed Any; the rest is plain.
    model: Any
    ctx: Any
    vocab: Any
    memory: Any
    _batch: Any
    arch: str
    n_vocab: int
    n_ctx: int
    n_ctx_train: int
    n_batch: int
    n_ubatch: int
    attention: "ContextReport"
    n_expert: int
    n_expert_used: int
    compute_threads: int
    template_text: str
    template: "ChatTemplate | builtin_templates.LegacyTemplate | None"
    kernels: KernelChoice
    template_source: str
    bos_token: str
    eos_token: str

    def __init__(self, model_path: str | os.PathLike[str], values: dict[str, Any],
                 streamer_factory: Callable[["Session"], Streamer | None] | None = None) -> None:
        backend.start()
        self.path = Path(model_path)
        self.values = dict(values)
        self.kv_tokens: list[int] = []
        self._abort_flag: threading.Event | None = None
        self._on_progress: Callable[[int], None] | None = None    # a prefill being watched
        t0 = time.monotonic()
        self.model = None
        self.ctx = None
        self.streamer: Streamer | None = None
        self._batch = None
        self.tool_framing: str | None = None
        self.template_kwargs: dict[str, Any] = {}  # chat-template-kwargs, read at load
        self.vision: Vision | None = None
        self.trial: Trial | None = None       # the first answer's calibration (calibrate.py)
        self.rpc: Any = None                  # rpc.RpcDevices when helpers hold layers
        self.embeddings = bool(values.get("embedding"))   # an embedding context (embed.py)
        self.memory: Any = None
        try:
            self._open(streamer_factory)
        except BaseException:
            self.close()
            raise
        self.load_s = time.monotonic() - t0

    # -- loading -----------------------------------------------------------

    def _open(self, streamer_factory: Callable[["Session"], Streamer | None] | None) -> None:
        if not self.path.is_file():
            raise LoadError(f"The model file {self.path} does not exist.")
        unusable = weight_types.first_unusable(self.path)
        if unusable is not None:
            raise LoadError(
                f"{self.path.name} stores {unusable.name} as "
                f"{weight_types.type_name(unusable.type)}: llama.cpp adds that tensor to "
                "its F32 activations and its CPU kernels take it only as F32 (it would "
                "abort at the first token). Convert the model again with a current "
                "convert_hf_to_gguf, which writes norms, biases and token types in F32.")
        twice = vocab_guard.first_duplicate(self.path)
        if twice is not None:
            raise LoadError(
                f"{self.path.name} has a broken vocabulary: token {twice.first} and token "
                f"{twice.again} are both {twice.shown()}, and llama.cpp stops the whole "
                "process on loading such a file. Convert the model again (the converter "
                "added a token the vocabulary already had).")
        self.arch = ""
        endpoints = _rpc_endpoints(self.values)
        split = None
        if endpoints:
            self.rpc = rpc.RpcDevices(endpoints, rpc.reach(endpoints))
            split = self.rpc.split_for(self.path, int(self.values.get("rpc-layers", -1)))
        self.streamer = streamer_factory(self) if streamer_factory else None
        if self.streamer is not None and self.rpc is not None and split is not None:
            # A helper's layers are in its memory, not ours: the streamer keeps the others.
            keep = getattr(self.streamer, "keep_layers_below", None)
            if keep is None or not keep(self.rpc.first_remote_layer(split)):
                self.streamer = None
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.load_mode = lc.LLAMA_LOAD_MODE_MMAP
        self.kernels = self._kernel_choice()
        mparams.use_extra_bufts = self.kernels.extra_bufts
        if self.streamer is not None:
            self.streamer.configure_model_params(mparams)
        if self.rpc is not None and split is not None:
            self.rpc.configure(mparams, split)
        path = str(self.path).encode()
        self.model = (self.rpc.load_model(path, mparams) if self.rpc is not None
                      else lc.llama_model_load_from_file(path, mparams))
        if not self.model:
            raise LoadError(f"llama.cpp could not load {self.path.name}: not a model file it reads.")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.arch = _meta(self.model, "general.architecture") or ""
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self.model)
        used = _meta(self.model, f"{self.arch}.expert_used_count")
        self.n_expert_used = int(used) if used and used.isdigit() else 0
        count = _meta(self.model, f"{self.arch}.expert_count")
        self.n_expert = int(count) if count and count.isdigit() else 0
        self._make_context()
        self._setup_template()
        self.vision = open_vision(self)

    def _kernel_choice(self) -> KernelChoice:
        """Whether this load may use llama.cpp's extra buffer types (`kernels`). Under the
        streamer the load keeps the file's own layout (the streamer finds its experts at
        their file offsets); the same choice then decides whether the streamer repacks
        its MXFP4 experts itself (asked by it, only for such a model)."""
        mode = str(self.values.get("repack") or "auto")
        if self.streamer is not None:
            allow = getattr(self.streamer, "allow_repack", None)
            if allow is not None:
                def experts() -> tuple[bool, str]:
                    choice = kernels.choose(mode)
                    return choice.extra_bufts, choice.reason
                allow(experts)
            return KernelChoice(False, kernels.registered_extra_bufts(), mode, "streamer",
                                "the expert streamer loads the file's own layout (its MXFP4 "
                                "experts may be repacked as it reads them: expert_repack)")
        return kernels.within_memory(kernels.choose(mode), model_bytes(self.path),
                                     probe_memory().budget)

    @property
    def moe_prompt_matmul(self) -> str:
        """How a MoE layer's prompt batches run here (for /api/info): "" for a dense
        model."""
        if not self.n_expert:
            return ""
        if self.rpc is not None:
            return "llama.cpp's (layers on RPC helpers)"
        repacked = self.kernels.extra_bufts
        if self.streamer is not None:
            notes = getattr(self.streamer, "load_info", None) or {}
            repacked = str(notes.get("expert_repack", "")).startswith("on")
        if not repacked:
            return "llama.cpp's (the experts are not repacked)"
        if not moegemm.enabled():
            return ("llama.cpp's (BMOE_MOE_GEMM=0)" if moegemm.kinds()
                    else "llama.cpp's (no four-row kernels here)")
        return "four rows: llama.cpp's gemm kernels on " + ", ".join(moegemm.kinds()) + \
            " experts"

    def _make_context(self) -> None:
        cparams = lc.llama_context_default_params()
        n_ctx = int(self.values.get("ctx-size") or 4096)
        cparams.n_ctx = n_ctx
        n_batch = min(n_ctx, int(self.values.get("batch-size") or PREFILL_CHUNK))
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_batch, int(self.values.get("ubatch-size") or PREFILL_CHUNK))
        asked = _attention_settings(self.values)
        cparams.flash_attn_type = _FLASH_ATTN[asked.flash_attn]
        cparams.type_k = _KV_TYPE[asked.type_k]
        cparams.type_v = _KV_TYPE[asked.type_v]
        cparams.swa_full = asked.swa_full
        threads = int(self.values.get("threads") or os.cpu_count() or 1)
        tb = int(self.values.get("threads-batch") or 0) or threads
        cparams.n_threads = threads
        cparams.n_threads_batch = tb
        cparams.no_perf = True
        if self.embeddings:
            cparams.embeddings = True
            cparams.pooling_type = embed.context_pooling(self.values)

        @lc.ggml_abort_callback
        def _abort(_data: ctypes.c_void_p) -> bool:
            flag = self._abort_flag
            return bool(flag is not None and flag.is_set())

        # The abort callback runs between graph nodes (Python, under the GIL): it is
        # installed only while a prefill runs; single-token decodes are cancelled
        # between tokens instead.
        self._abort_ref = _abort
        if self.streamer is not None:
            self.streamer.configure_context_params(cparams)
        elif self.n_expert and self.kernels.extra_bufts and self.rpc is None:
            # a resident MoE on repacked kernels: its prompts' expert matmuls four tokens
            # at a time (moegemm), the callback handing them the wrapper on first use
            fn = moegemm.callback()
            if fn is not None:
                cparams.cb_eval = fn
                cparams.cb_eval_user_data = None
        heard = _LlamaLog()            # started last, stopped first: the streamer's tap is outer
        heard.start()
        try:
            self.ctx = (self.rpc.init_context(self.model, cparams) if self.rpc is not None
                        else lc.llama_init_from_model(self.model, cparams))
        finally:
            heard.stop()
        if not self.ctx:
            raise LoadError(_context_refused(n_ctx, asked, heard.errors()))
        self.n_ctx = lc.llama_n_ctx(self.ctx)
        self.n_batch = lc.llama_n_batch(self.ctx)
        self.n_ubatch = lc.llama_n_ubatch(self.ctx)
        self.attention = asked.resolved(heard.lines)
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self.memory = lc.llama_get_memory(self.ctx)
        if not self.memory and not self.embeddings:
            # an encoder (BERT) keeps no KV cache and writes no tokens: decoding on it
            # would abort the process
            raise LoadError(f"{self.path.name} is an embedding model ({self.arch}): it "
                            "writes no text. Load it with {embedding} on.")
        self.compute_threads = threads
        self._threads_batch = tb
        if self.streamer is not None:
            self.streamer.attach(self.model, self.ctx)
        can_overlap = getattr(self.streamer, "queue", None) is not None
        self.trial = Trial.from_values(self.values, can_overlap=can_overlap)
        self._arm = Arm(threads, bool(getattr(self.streamer, "overlap", False)))

    def _setup_template(self) -> None:
        raw = lc.llama_model_chat_template(self.model, None)
        self.template_text = raw.decode("utf-8", "replace") if raw else ""
        self.template_source = "model" if self.template_text else "none"
        override = self._template_override()
        if override is not None:
            self.template_text, self.template_source = override
        self.eos_token = self.token_text(lc.llama_vocab_eos(self.vocab))
        bos = lc.llama_vocab_bos(self.vocab)
        self.bos_token = self.token_text(bos) if bos >= 0 else ""
        self.template = None
        if builtin_templates.is_legacy(self.template_text) and self.template_source != "model":
            self.template = builtin_templates.LegacyTemplate(self.template_text)
        elif self.template_text:
            self.template = ChatTemplate(self.template_text, bos_token=self.bos_token,
                                         eos_token=self.eos_token)
        try:
            self.template_kwargs = params.template_kwargs(self.values.get("chat-template-kwargs"))
        except ValueError as e:
            raise LoadError(str(e)) from None
        self.tool_framing = self._find_tool_framing()

    def _template_override(self) -> tuple[str, str] | None:
        """The chat template the settings name instead of the file's (`chat-template-file`,
        then `chat-template`: a built-in's name or Jinja text), with where it came from."""
        path = str(self.values.get("chat-template-file") or "")
        if path:
            try:
                data = Path(path).expanduser().read_bytes()
            except OSError as e:
                raise LoadError(f"The chat template file {path} cannot be read "
                                f"({e.strerror or 'error'}): fix {{chat-template-file}}.") from None
            if len(data) > MAX_TEMPLATE_BYTES:
                raise LoadError(f"The chat template file {path} is larger than "
                                f"{MAX_TEMPLATE_BYTES // 1024} KiB: fix {{chat-template-file}}.")
            text = data.decode("utf-8", "replace")
            if not text.strip():
                raise LoadError(f"The chat template file {path} is empty: fix "
                                "{chat-template-file}.")
            return text, f"file {Path(path).name}"
        named = str(self.values.get("chat-template") or "")
        if not named:
            return None
        resolved = builtin_templates.resolve(named)
        if resolved is None:
            raise LoadError(f"{named!r} is not a chat template this server knows: name one "
                            f"of {', '.join(builtin_templates.NAMES)} or give the "
                            "template's text in {chat-template}.")
        name = builtin_templates.canonical(named)
        return resolved, f"built-in {name}" if name else "setting"

    def _find_tool_framing(self) -> str | None:
        """The template's chat-format family (`families.detect` reads the template's text;
        Qwen's hermes / qwen3_coder are told apart by rendering a sample call), the
        generic JSON format when neither knows it; None without a template."""
        if self.template is None:
            return None

        def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
            return self.render(messages, tools=tools, add_generation_prompt=False)

        named = families.detect(self.template_text)
        if named is not None:
            return named
        try:
            return detect_framing(render) or families.GENERIC
        except TemplateError as e:
            log.warning("the chat template refused a sample tool call: %s", e)
            return families.GENERIC

    def close(self) -> None:
        vision, self.vision = getattr(self, "vision", None), None
        if vision is not None:
            vision.close()
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self.rpc is not None and self.rpc.failed:
            # A helper was lost mid-decode: the context and model cannot be freed safely
            # (rpcguard.c); they are leaked, and the next load connects afresh.
            self.ctx = self.model = None
        if self.ctx:
            lc.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None

    # -- text ----------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool = True,
                 add_special: bool | None = None) -> list[int]:
        # JSON can carry an unpaired surrogate ("\\ud800"), which is not UTF-8; llama.cpp
        # must only ever see valid UTF-8, so each becomes U+FFFD as a decoder would.
        data = _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8")
        add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab)) if add_special is None \
            else add_special
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < self.n_vocab:
            # llama.cpp indexes its vocabulary unchecked here (an exception through C:
            # the process aborts); a vocabulary without EOS (BERT's) reports -1
            return b""
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.vocab, token, buf, 64, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, buf, -n, 0, True)
        return buf.raw[:n]

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               enable_thinking: bool = True, add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        if self.template is None:
            raise EngineError("needs_chat_mode", "This model has no chat template; it cannot chat.")
        return self.template.render(messages, tools=tools, enable_thinking=enable_thinking,
                                    add_generation_prompt=add_generation_prompt, extra=extra)

    # -- decoding ------------------------------------------------------------

    def _grammar_sampler(self, grammar: str, triggers: list[int],
                         patterns: list[str] | None = None) -> Any:
        # The last gate before llama.cpp: every grammar, generated or a client's, is read
        # by the guard first (a grammar llama.cpp cannot hold crashes the process).
        try:
            check_grammar(grammar, n_vocab=self.n_vocab)
        except GrammarRefused as e:
            raise EngineError("invalid_request", f"grammar: {e}", param="grammar") from None
        if any(not 0 <= t < self.n_vocab for t in triggers):
            raise EngineError("invalid_request", "A grammar trigger is not a token of this "
                              "model.")
        return grammar_sampler(self.vocab, grammar, triggers, patterns or [])

    def _sampler(self, grammar: str | None, triggers: list[int] | None = None,
                 sampling: Sampling | None = None, prompt: list[int] | None = None,
                 patterns: list[str] | None = None) -> Any:
        g = None
        if grammar:
            g = self._grammar_sampler(grammar, triggers or [], patterns)
            if not g:
                raise EngineError("invalid_request", "The output grammar could not be built "
                                  "from this schema or tool list.")
        if sampling is not None:        # a request's own sampling (llama-server's routes)
            return build_chain(self, sampling, g, prompt or [])
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if g is not None:
            lc.llama_sampler_chain_add(chain, g)
        temp = float(self.values.get("temp") or 0.0)
        if temp <= 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            return chain
        top_k = int(self.values.get("top-k", 40))
        top_p = float(self.values.get("top-p", 0.95))
        seed = int(self.values.get("seed", SEED_RANDOM))
        if top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(top_k))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(top_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temp))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        return chain

    def decode(self, tokens: list[int], pos0: int, want_logits: bool) -> None:
        """Decode `tokens` at positions pos0.. in chunks; raises on abort or failure."""
        b = self._batch
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            n = len(chunk)
            for i, tok in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = pos0 + start + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = 0
            last = start + n == len(tokens)
            if last and want_logits:
                b.logits[n - 1] = 1
            b.n_tokens = n
            if self.streamer is not None:
                self.streamer.batch_begin(n, int(last and want_logits), len(tokens) - start - n)
            rc = self.rpc.decode(self.ctx, b) if self.rpc is not None else \
                lc.llama_decode(self.ctx, b)
            if self.streamer is not None:
                self.check_streamer(pos0)
            if rc == 2:
                raise Aborted(pos0 + start)
            if rc != 0:
                raise EngineError("failed", f"llama_decode failed with code {rc}.")
            if self._on_progress is not None:
                self._on_progress(pos0 + start + n)

    def check_streamer(self, pos0: int) -> None:
        """A streamer failure stopped the graph: forget this decode's KV, raise it."""
        message = self.streamer.failure() if self.streamer is not None else None
        if message:
            lc.llama_memory_seq_rm(self.memory, 0, pos0, -1)
            raise EngineError("failed", message)

    def _decode_prompt(self, prompt: list[int], reused: int, cancel: threading.Event) -> int:
        """Decode the prompt past `reused`; images (negative ids) through the projector.
        Returns where decoding started (an image is decoded whole, so maybe earlier)."""
        if self.vision is None or min(prompt[reused:], default=0) >= 0:
            self.decode(prompt[reused:], reused, want_logits=True)
            return reused
        start = reuse_start(self.vision, prompt, reused)
        try:
            if start < reused:
                lc.llama_memory_seq_rm(self.memory, 0, start, -1)
                del self.kv_tokens[start:]
            self.vision.prefill(self, prompt, start, cancel)
        except BaseException:
            lc.llama_memory_seq_rm(self.memory, 0, start, -1)   # the KV as kv_tokens says
            del self.kv_tokens[start:]
            raise
        return start

    def _reuse_prefix(self, prompt: list[int]) -> int:
        n, kv = self._common_prefix(prompt, len(prompt) - 1), self.kv_tokens
        if n < len(kv):
            lc.llama_memory_seq_rm(self.memory, 0, n, -1)
            del self.kv_tokens[n:]
        return n

    def prefill(self, prompt: list[int], cancel: threading.Event) -> tuple[int, float]:
        """Bring the KV to `prompt` (all but nothing left to decode); returns (reused, seconds)."""
        t0 = time.monotonic()
        self._check_usable()
        if self.embeddings:
            raise EngineError("not_supported", "This server computes embeddings only (it was "
                              "started with {embedding}): use /v1/embeddings, or load the "
                              "model with {embedding} off to chat.")
        reused = self._reuse_prefix(prompt)
        self._abort_flag = cancel
        lc.llama_set_abort_callback(self.ctx, self._abort_ref, None)
        if self.streamer is not None:
            self.streamer.prefill_begin()
        try:
            reused = self._decode_prompt(prompt, reused, cancel)
        except Aborted:
            lc.llama_memory_seq_rm(self.memory, 0, reused, -1)
            raise
        finally:
            lc.llama_set_abort_callback(self.ctx, _NO_ABORT, None)
            self._abort_flag = None
            if self.streamer is not None:
                self.streamer.prefill_end()
        self.kv_tokens = list(prompt)
        return reused, time.monotonic() - t0

    def generate(self, prompt: list[int], *, max_tokens: int, cancel: threading.Event,
                 on_token: Callable[[TokenEvent], None], grammar: str | None = None,
                 grammar_triggers: list[int] | None = None,
                 grammar_patterns: list[str] | None = None,
                 sampling: Sampling | None = None,
                 on_progress: Callable[[PrefillProgress], None] | None = None) -> Generation:
        """Prefill `prompt` (reusing the KV prefix) and decode up to `max_tokens` tokens.

        `max_tokens` 0 means no ceiling but the context. Raises EngineError before any
        token when the prompt leaves no room. `on_progress` hears the prefill: once before
        its first batch (what the KV already held), then after each batch.
        """
        if not prompt:
            raise EngineError("empty_prompt", "The prompt is empty.")
        self._check_usable()
        room = self.n_ctx - len(prompt)
        if room <= 0:
            raise context_full(len(prompt), self.n_ctx)
        budget = room if max_tokens <= 0 else min(max_tokens, room)
        sampler = self._sampler(grammar, grammar_triggers, sampling, prompt, grammar_patterns)
        t_start = time.monotonic()
        try:
            try:
                if on_progress is not None:
                    self._watch_prefill(prompt, on_progress, t_start)
                reused, prefill_s = self.prefill(prompt, cancel)
            except Aborted:
                return Generation("cancelled", [], "", len(prompt), 0, 0,
                                  time.monotonic() - t_start, 0.0, 0.0, len(self.kv_tokens))
            finally:
                self._on_progress = None
            return self._decode_loop(prompt, budget, max_tokens, reused, prefill_s, t_start,
                                     sampler, cancel, on_token, sampling)
        finally:
            lc.llama_sampler_free(sampler)

    def _watch_prefill(self, prompt: list[int], on_progress: Callable[[PrefillProgress], None],
                       t0: float) -> None:
        """Report the prefill to `on_progress`, from the prefix the KV holds on."""
        total = len(prompt)
        cache = self._common_prefix(prompt, len(prompt) - 1)

        def report(processed: int) -> None:
            on_progress(PrefillProgress(total, cache, max(cache, processed),
                                        (time.monotonic() - t0) * 1000.0))
        report(cache)
        self._on_progress = report

    def _common_prefix(self, prompt: list[int], limit: int) -> int:
        """How many of the prompt's first `limit` tokens the KV already holds."""
        n, kv = 0, self.kv_tokens
        limit = min(limit, len(kv), len(prompt))
        while n < limit and kv[n] == prompt[n]:
            n += 1
        return n

    def _decode_loop(self, prompt: list[int], budget: int, max_tokens: int, reused: int,
                     prefill_s: float, t_start: float, sampler: Any, cancel: threading.Event,
                     on_token: Callable[[TokenEvent], None],
                     sampling: Sampling | None = None) -> Generation:
        n_probs = sampling.n_probs if sampling is not None else 0
        post = sampling is not None and sampling.post_sampling_probs and n_probs > 0
        biases = list(chain_biases(self, sampling).items()) if post and sampling else []
        stops = _StopWatch(sampling.stop if sampling is not None else ())
        out: list[int] = []
        pieces: list[str] = []
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        finish = "length"
        t_decode = time.monotonic()
        ttft = 0.0
        self._abort_flag = cancel
        try:
            while len(out) < budget:
                if cancel.is_set():
                    finish = "cancelled"
                    break
                t0 = time.monotonic()
                if self.streamer is not None:
                    self.streamer.token_begin()
                tok = lc.llama_sampler_sample(sampler, self.ctx, -1)
                probs = None
                if post and sampling is not None:
                    probs = post_sampling_logprobs(self.logits_row(), sampling, tok, n_probs,
                                                   biases)
                elif n_probs:
                    probs = top_logprobs(self.logits_row(), tok, n_probs)
                if self.is_eog(tok):
                    finish = "stop"
                    break
                out.append(tok)
                text = decoder.decode(self.token_bytes(tok))
                pieces.append(text)
                if stops.feed(text):
                    finish = "stop"
                    self._emit(on_token, len(out), tok, text, t0, budget, probs)
                    break
                if len(out) < budget:
                    t_step = self._trial_arm()
                    try:
                        self.decode([tok], len(self.kv_tokens), want_logits=True)
                        self._trial_step(t_step)
                    except Aborted:
                        lc.llama_memory_seq_rm(self.memory, 0, len(self.kv_tokens), -1)
                        finish = "cancelled"
                        # the sampled token was shown to nobody yet: report it, but the
                        # KV does not hold it.
                        self._emit(on_token, len(out), tok, text, t0, budget, probs)
                        break
                    self.kv_tokens.append(tok)
                if not ttft:
                    ttft = time.monotonic() - t_start
                self._emit(on_token, len(out), tok, text, t0, budget, probs)
        finally:
            self._abort_flag = None
        tail = decoder.decode(b"", final=True)
        if tail:
            pieces.append(tail)
        n_past = len(self.kv_tokens)
        return Generation(
            finish=finish, tokens=out, text="".join(pieces), n_prompt=len(prompt),
            n_cached=reused, n_prefilled=len(prompt) - reused, prefill_s=prefill_s,
            decode_s=time.monotonic() - t_decode, ttft_s=ttft, n_past=n_past,
            budget_cut_by_context=(finish == "length" and (max_tokens <= 0 or max_tokens > budget)),
            requested_budget=max_tokens, stop_word=stops.word,
            logit_bias=tuple(chain_biases(self, sampling).items()) if sampling else (),
        )

    def _trial_arm(self) -> float:
        """Decode the next step under the calibration's arm (``calibrate.py``)."""
        if self.trial is None:
            return 0.0
        arm = self.trial.arm()
        if arm != self._arm:
            if arm.threads != self._arm.threads:
                lc.llama_set_n_threads(self.ctx, arm.threads, self._threads_batch)
                self.compute_threads = arm.threads
            if self.streamer is not None and hasattr(self.streamer, "overlap"):
                self.streamer.overlap = arm.overlap
            self._arm = arm
        return time.perf_counter()

    def _trial_step(self, t0: float) -> None:
        if self.trial is not None and not self.trial.done:
            self.trial.record(time.perf_counter() - t0)

    def _emit(self, on_token: Callable[[TokenEvent], None], step: int, tok: int, text: str,
              t0: float, budget: int,
              probs: tuple[float, list[tuple[int, float]]] | None = None) -> None:
        telemetry = self.streamer.token_end() if self.streamer is not None else {}
        on_token(TokenEvent(step=step, token=tok, text=text,
                            wall_ms=(time.monotonic() - t0) * 1000.0, telemetry=telemetry,
                            logprob=probs[0] if probs else None,
                            top=[(t, lp, self.token_bytes(t)) for t, lp in probs[1]]
                            if probs else None))

    def logits_row(self) -> Any:
        """The last decoded position's logits as a numpy array (a copy)."""
        import numpy as np
        ptr = lc.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def truncate_kv(self, n: int) -> None:
        """Forget every KV position from `n` on (a turn rolled back)."""
        if n < len(self.kv_tokens) and self.usable and self.memory:
            lc.llama_memory_seq_rm(self.memory, 0, n, -1)
            del self.kv_tokens[n:]

    def clear_kv(self) -> None:
        if self.usable and self.memory:
            lc.llama_memory_clear(self.memory, True)
        self.kv_tokens = []

    # -- the KV cache in a file (llama-server's slot save / restore) -------------

    def save_kv(self, path: str) -> tuple[int, int]:
        """Write the KV cache and its tokens to `path`, a llama.cpp sequence state file
        (the plain token list llama-server restores too); (tokens, bytes) written."""
        self._check_usable()
        if any(t < 0 for t in self.kv_tokens):
            raise EngineError("invalid_request", "The context holds an image: a slot with "
                              "an image in it is not saved to a file here.")
        n = len(self.kv_tokens)
        ids = (lc.llama_token * max(1, n))(*self.kv_tokens)
        written = lc.llama_state_seq_save_file(self.ctx, os.fsencode(path), 0, ids, n)
        if not written:
            raise EngineError("failed", "llama.cpp could not write the slot's file.")
        return n, int(written)

    def kv_identity(self) -> dict[str, Any]:
        """What a saved KV state is only valid for: this model file and this context's
        layout (size, cache types, flash attention, which decides the V cache's layout)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            size = -1
        return {"model": str(self.path), "model_size": size, "n_ctx": self.n_ctx,
                "attention": self.attention.to_json()}

    def load_kv(self, path: str) -> tuple[int, int]:
        """Replace the KV cache with a sequence state file's (checked here first: its
        header, its token count against the context, its ids against the vocabulary);
        (tokens, bytes) read. A file llama.cpp refuses leaves the KV empty."""
        self._check_usable()
        tokens = _state_file_tokens(path, self.n_ctx, self.n_vocab)
        lc.llama_memory_seq_rm(self.memory, 0, -1, -1)
        self.kv_tokens = []
        cap = len(tokens) or 1
        ids = (lc.llama_token * cap)()
        n_out = ctypes.c_size_t(0)
        read = lc.llama_state_seq_load_file(self.ctx, os.fsencode(path), 0, ids, cap,
                                            ctypes.byref(n_out))
        if not read:
            lc.llama_memory_seq_rm(self.memory, 0, -1, -1)
            raise EngineError("invalid_request", "The slot's file is not a saved state of "
                              "this model and context: llama.cpp refused it.")
        got = list(ids[:n_out.value])
        self.kv_tokens = got
        return len(got), int(read)

    @property
    def usable(self) -> bool:
        """False once an RPC helper was lost mid-decode: the context must not be touched."""
        return self.rpc is None or not self.rpc.failed

    def _check_usable(self) -> None:
        if not self.usable:
            raise EngineError("failed", self.rpc.failed)
        # a streamed model's file replaced, cut short or hung: say so before the turn runs
        problem = getattr(self.streamer, "file_problem", None)
        message = problem() if problem is not None else None
        if message:
            raise EngineError("failed", message)


def _rpc_endpoints(values: dict[str, Any]) -> tuple[Any, ...]:
    text = str(values.get("rpc") or "").strip()
    if not text:
        return ()
    try:
        return rpc.parse_endpoints(text)
    except ValueError as e:
        raise LoadError(f"{{rpc}}: {e}") from None


_NO_ABORT = ctypes.cast(ctypes.c_void_p(), lc.ggml_abort_callback)


class _StopWatch:
    """Whether the text so far holds one of the stop strings (`Sampling.stop`)."""

    def __init__(self, words: tuple[str, ...]) -> None:
        self.words = [w for w in words if w]
        self.keep = max((len(w) for w in self.words), default=0)
        self.tail = ""
        self.word = ""

    def feed(self, text: str) -> bool:
        if not self.words or not text:
            return False
        self.tail = (self.tail + text)[-(self.keep + len(text)):]
        hits = [(self.tail.find(w), w) for w in self.words if w in self.tail]
        if hits:
            self.word = min(hits)[1]
        self.tail = self.tail[-self.keep:]
        return bool(hits)


# -- the context's attention and KV cache settings ----------------------------------------

_FLASH_ATTN = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
               "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}
_GGML_TYPE_BF16 = 30  # ggml.h enum ggml_type (the binding does not name it)
_KV_TYPE = {"f32": lc.GGML_TYPE_F32, "f16": lc.GGML_TYPE_F16, "bf16": _GGML_TYPE_BF16,
            "q8_0": lc.GGML_TYPE_Q8_0, "q4_0": lc.GGML_TYPE_Q4_0, "q4_1": lc.GGML_TYPE_Q4_1,
            "iq4_nl": lc.GGML_TYPE_IQ4_NL, "q5_0": lc.GGML_TYPE_Q5_0,
            "q5_1": lc.GGML_TYPE_Q5_1}
# llama.cpp's lines that say what the context was made with (src/llama-context.cpp's
# resolve_fused_ops, src/llama-kv-cache.cpp's size line)
_FA_ON = (b"Flash Attention enabled", b"enabling flash_attn since")
_FA_OFF = b"Flash Attention not supported"
_KV_LINE = re.compile(rb"K \((\w+)\):\s*[\d.]+ MiB, V \((\w+)\)")


@dataclass(frozen=True)
class ContextReport:
    """What the context was asked for and what llama.cpp made: ``flash_attn`` is the
    setting (auto / on / off), ``flash_attn_used`` whether attention runs fused (None
    when llama.cpp did not say); the K and V types are the ones its KV cache reported."""

    flash_attn: str
    type_k: str
    type_v: str
    swa_full: bool
    flash_attn_used: bool | None = None
    kv_reported: bool = False          # the K and V types are llama.cpp's own report

    def resolved(self, lines: list[bytes]) -> "ContextReport":
        used: bool | None = {"on": True, "off": False}.get(self.flash_attn)
        type_k, type_v, heard = self.type_k, self.type_v, False
        for line in lines:
            if any(on in line for on in _FA_ON):
                used = True
            elif _FA_OFF in line:
                used = False
            kv = _KV_LINE.search(line)
            if kv and not heard:         # the first cache's (a SWA model reports two)
                type_k, type_v, heard = kv.group(1).decode(), kv.group(2).decode(), True
        return ContextReport(self.flash_attn, type_k, type_v, self.swa_full, used, heard)

    def to_json(self) -> dict[str, Any]:
        return {"flash_attn": self.flash_attn, "flash_attn_used": self.flash_attn_used,
                "cache_type_k": self.type_k, "cache_type_v": self.type_v,
                "swa_full": self.swa_full, "kv_reported": self.kv_reported}


def _attention_settings(values: dict[str, Any]) -> ContextReport:
    """The settings as asked; a quantized V cache without flash attention is refused
    here, before llama.cpp is asked (it would refuse the context)."""
    asked = ContextReport(str(values.get("flash-attn") or "auto"),
                          str(values.get("cache-type-k") or "f16"),
                          str(values.get("cache-type-v") or "f16"),
                          bool(values.get("swa-full", False)))
    message = params.validate({"flash-attn": asked.flash_attn, "cache-type-k": asked.type_k,
                               "cache-type-v": asked.type_v})
    if message:
        raise LoadError(message)
    return asked


def _context_refused(n_ctx: int, asked: ContextReport, errors: list[str]) -> str:
    """Why llama.cpp made no context, in its own words where it gave them."""
    said = "; ".join(errors)
    if said and any(w in said for w in ("cache type", "K cache", "V cache", "flash_attn")):
        return (f"llama.cpp refused the KV cache types (K {asked.type_k}, V {asked.type_v}, "
                f"flash attention {asked.flash_attn}): {said}. Choose other "
                "{cache-type-k} / {cache-type-v}.")
    because = f": {said}" if said else ""
    return (f"llama.cpp could not create a context of {n_ctx} tokens{because} "
            "(lower {ctx-size}).")


class _LlamaLog:
    """Hears llama.cpp's log lines while a context is made, passing each one on to the
    callback that was installed before (they are restored in ``stop``)."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self._levels: list[int] = []
        self._prev: Any = None
        self._prev_data: Any = None
        self._fn: Any = None

    def start(self) -> None:
        cb, data = lc.llama_log_callback(), ctypes.c_void_p()
        lc.llama_log_get(ctypes.byref(cb), ctypes.byref(data))
        self._prev, self._prev_data = cb, data

        @lc.llama_log_callback
        def _hear(level: int, text: bytes, user: ctypes.c_void_p) -> None:
            if text:
                self.lines.append(bytes(text))
                self._levels.append(level)
            if self._prev:
                self._prev(level, text, self._prev_data)

        self._fn = _hear
        lc.llama_log_set(_hear, ctypes.c_void_p(0))

    def stop(self) -> None:
        if self._fn is not None:
            lc.llama_log_set(self._prev, self._prev_data)
            self._fn = None

    def errors(self) -> list[str]:
        return [line.decode("utf-8", "replace").strip().split(": ", 1)[-1]
                for line, level in zip(self.lines, self._levels, strict=True)
                if level == backend.GGML_LOG_LEVEL_ERROR and line.strip()]


STATE_HEADER = 12   # a sequence state file: magic, version, token count (u32 each)


def _state_file_tokens(path: str, n_ctx: int, n_vocab: int) -> list[int]:
    """The token list a sequence state file starts with, checked before llama.cpp reads
    it: the magic and version, a count within the context (and the file), ids within the
    vocabulary (so also no image chunk and no llama-server packed list)."""
    try:
        with open(path, "rb") as f:
            head = f.read(STATE_HEADER)
            size = os.fstat(f.fileno()).st_size
            if len(head) < STATE_HEADER:
                raise EngineError("invalid_request", "The slot's file is too short to be a "
                                  "saved state.")
            magic, version, n = struct.unpack("=III", head)
            if magic != lc.LLAMA_STATE_SEQ_MAGIC or version != lc.LLAMA_STATE_SEQ_VERSION:
                raise EngineError("invalid_request", "The slot's file is not a llama.cpp "
                                  "sequence state of this version.")
            if n > n_ctx or STATE_HEADER + 4 * n > size:
                raise EngineError("invalid_request", f"The slot's file holds {n} tokens: "
                                  f"more than the context ({n_ctx}) or the file.")
            ids = list(struct.unpack(f"={n}i", f.read(4 * n)))
    except OSError as e:
        raise EngineError("invalid_request", "The slot's file cannot be read "
                          f"({e.strerror or 'error'}).") from None
    if any(t < 0 or t >= n_vocab for t in ids):
        raise EngineError("invalid_request", "The slot's file holds token ids outside this "
                          "model's vocabulary: it was saved from another model.")
    return ids
