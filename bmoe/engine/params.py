"""The parameter table: one source for CLI flags, server defaults, validation and labels.

Theory of operation
-------------------
Every setting a person can change is one ``Param`` row. The same rows give:

* the command line of ``bmoe-cli`` and ``bmoe-server`` (``add_cli_flags``, read back with
  ``values_from_namespace``, written out again with ``to_args``);
* the JSON schema of ``GET /api/params`` and ``bmoe-cli --describe-params``
  (``describe``), whose ``default`` is the server's where the two differ;
* the parsing of a value from JSON or from a command-line string (``parse_value``) and
  the rules across settings (``validate``).

Messages name a setting by a ``{key}`` placeholder, never by a flag or a label: the
server renders them with labels, the CLI with flags (``render``), once, where the
message leaves the program.

A row is offered only once the machinery behind it exists; a row that does nothing
is never in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from . import builtin_templates

ParamType = Literal["bool", "int", "float", "path", "text", "choice"]
Level = Literal["basic", "advanced", "experimental", "debug"]
Scope = Literal["session", "request"]

AUTO = "auto"
SEED_RANDOM = 4294967295
MAX_TOKENS = 1 << 20          # the ceiling of every token count (n-predict, ctx-size)
MAX_THREADS = 256
MAX_TEMPLATE_CHARS = 1 << 20    # a chat template's text (real ones are ~40 KiB)
MAX_TEMPLATE_KWARGS_CHARS = 1 << 16  # chat-template-kwargs' JSON text
# variables the server itself gives every template: a setting cannot replace them
TEMPLATE_OWN_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token",
                          "eos_token")
PROMPT_BATCH = 512              # tokens of one prompt batch by default (llama.cpp's ubatch)
MAX_BATCH = 16384               # the most tokens of one prompt batch: its compute buffer grows
                                # with it (at a 150k vocabulary, 0.6 MiB a token for logits)
KV_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
KV_FLOAT_TYPES = ("f16", "f32", "bf16")   # the others are quantized
# llama.cpp's spellings of on / off / auto (common/arg.cpp is_truthy, is_falsey, is_autoy)
ON_OFF_AUTO = (("enabled", "on"), ("true", "on"), ("1", "on"), ("disabled", "off"),
               ("false", "off"), ("0", "off"), ("-1", "auto"))


@dataclass(frozen=True)
class Switch:
    """A flag that sets the row to a fixed value (``--no-think`` sets ``think`` false)."""

    flag: str
    value: Any
    deprecated: bool = False


@dataclass(frozen=True)
class Named:
    """A value with a person's name for it: a choice, or a special value."""

    value: Any
    label: str


@dataclass(frozen=True)
class Group:
    key: str
    label: str
    help: str
    order: int
    read_only: bool = False


@dataclass(frozen=True)
class Param:
    key: str
    label: str
    type: ParamType
    group: str
    group_label: str
    group_help: str
    group_order: int
    level: Level
    form: bool
    scope: Scope
    help: str
    details: str
    flag: str
    default: Any
    server_default: Any = None          # None: the same as ``default``
    short: str | None = None
    switches: tuple[Switch, ...] = ()
    choices: tuple[Named, ...] = ()
    min: int | float | None = None
    max: int | float | None = None
    unit: str | None = None
    typical: tuple[int | float, int | float] | None = None
    special: tuple[Named, ...] = ()
    lossy: bool = False
    accepts_auto: bool = False
    group_read_only: bool = False
    launch_only: bool = False           # names a file or host: set at launch, refused over the API
    env: str | None = None              # llama-server's LLAMA_ARG_* variable for the flag
    synonyms: tuple[tuple[str, str], ...] = ()   # other spellings of a choice: (word, value)

    def default_for(self, server: bool) -> Any:
        if server and self.server_default is not None:
            return self.server_default
        return self.default

    @property
    def dest(self) -> str:
        """The argparse attribute the row's flags store into."""
        return self.key.replace("-", "_")


# --- the groups, in form order ----------------------------------------------------------

_GROUPS: dict[str, Group] = {g.key: g for g in (
    Group("model", "Model", "The model file to run, chosen from the model list.", 1,
          read_only=True),
    Group("generation", "Generation",
          "How long an answer may run, whether the model thinks first, and the threads "
          "that compute it.", 2),
    Group("sampling", "Sampling (default: greedy, deterministic)",
          "How the next token is picked; at temperature 0 the same prompt gives the "
          "same answer.", 3),
    Group("streaming", "Expert streaming",
          "Reads the experts each token routes to from storage, instead of leaving "
          "residency to the kernel's file mapping.", 4),
    Group("cache", "Expert cache",
          "The memory that keeps experts once read, so a token that routes to them "
          "again does not read them from storage.", 5),
    Group("memory", "Memory and residency",
          "Where the weights every token uses are kept.", 6),
    Group("context", "Prompt batches and the KV cache",
          "How the prompt is read in batches, and how the context's keys and values are "
          "kept and attended to.", 7),
    Group("diagnostics", "Diagnostics and A/B baselines",
          "Settings for measuring the engine against its baselines; none makes it "
          "faster.", 10),
    Group("server", "Server", "What the server offers its clients.", 11),
)}


def _row(key: str, label: str, type: ParamType, group: str, level: Level, help: str,
         details: str, default: Any, *, form: bool | None = None, **optional: Any) -> Param:
    g = _GROUPS[group]
    scope: Scope = optional.pop("scope", "session")
    if type == "bool" and "switches" not in optional:
        optional["switches"] = (Switch(f"--no-{key}", False),)
    return Param(
        key=key, label=label, type=type, group=g.key, group_label=g.label,
        group_help=g.help, group_order=g.order, level=level,
        form=level == "basic" if form is None else form,
        scope=scope, help=help, details=details,
        flag=f"--{key}", default=default, group_read_only=g.read_only, **optional)


def _physical_cores() -> int:
    """The cores a compute thread can use alone: physical cores, within our affinity."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    usable = usable or os.cpu_count() or 1
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            package = core = ""
            for line in f:
                name, _, value = line.partition(":")
                name, value = name.strip(), value.strip()
                if name == "physical id":
                    package = value
                elif name == "core id":
                    core = value
                    cores.add((package, core))
    except OSError:
        pass
    return max(1, min(usable, len(cores) or usable, MAX_THREADS))


def _rows() -> tuple[Param, ...]:
    return (
        _row("model", "Model file", "path", "model", "basic",
             "The GGUF model file to load.",
             "Choose it from the model list; a change takes effect at the next load.",
             "", short="-m", env="LLAMA_ARG_MODEL"),
        _row("mmproj", "Image projector", "path", "model", "advanced",
             "The projector (mmproj GGUF) that lets the model read images.",
             "Empty pairs the model with the projector in its folder whose header names "
             "the same model; name a file here to choose one yourself.",
             "", short="-mm", env="LLAMA_ARG_MMPROJ"),
        _row("mmproj-auto", "Pair a projector", "bool", "model", "advanced",
             "Pairs the model with the image projector in its folder when Image projector "
             "names none.",
             "Off loads the model without images unless Image projector names a file "
             "(llama-server's --no-mmproj).",
             True, switches=(Switch("--no-mmproj-auto", False), Switch("--no-mmproj", False)),
             env="LLAMA_ARG_MMPROJ_AUTO"),
        _row("chat-template", "Chat template", "text", "model", "advanced",
             "The chat template to use instead of the model file's: one of llama.cpp's "
             "built-in names (chatml, gemma, llama3, command-r, mistral-v7, phi4, ...) or "
             "the template's Jinja text.",
             "Empty uses the template the model file carries. A base model has none, so "
             "it only continues text until one is named here.",
             "", env="LLAMA_ARG_CHAT_TEMPLATE"),
        _row("chat-template-file", "Chat template file", "path", "model", "advanced",
             "A Jinja chat template file to use instead of the model file's template.",
             "Read once at load; it wins over Chat template. Set at launch only: a path "
             "the server reads is not an API setting.",
             "", launch_only=True, env="LLAMA_ARG_CHAT_TEMPLATE_FILE"),
        _row("chat-template-kwargs", "Template variables", "text", "model", "advanced",
             "Extra variables for the chat template, as one JSON object (llama-server's "
             "--chat-template-kwargs), such as {\"enable_thinking\": false}.",
             "Every turn's template reads them; a request's own chat_template_kwargs win "
             "over them, and enable_thinking false turns thinking off. Empty adds none; a "
             "change takes effect at the next load.",
             "", env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS"),
        _row("image-max-tokens", "Image tokens", "int", "model", "advanced",
             "The most tokens one image may take, for a projector whose count follows "
             "the image's size.",
             "Lower it where image tokens prefill slowly: the projector sizes the image "
             "down to fit. 0 keeps the projector's own cap; a fixed-size projector "
             "ignores it.",
             0, min=0, max=65536, unit="tokens", special=(Named(0, "the projector's own"),),
             env="LLAMA_ARG_IMAGE_MAX_TOKENS"),
        _row("n-predict", "Max tokens", "int", "generation", "basic",
             "The most tokens one answer may take.",
             "Lower it to cut long answers short; 0 lets an answer run until the context "
             "is full.",
             128, server_default=0, short="-n", scope="request", min=-1, max=MAX_TOKENS,
             unit="tokens", special=(Named(0, "up to the context"),
                                     Named(-1, "up to the context (llama-server's -1)")),
             env="LLAMA_ARG_N_PREDICT"),
        _row("think", "Thinking", "bool", "generation", "basic",
             "Lets a thinking model reason before it answers.",
             "Off answers sooner and leaves more of the context for the conversation, "
             "at some cost on hard questions; a model without a thinking mode ignores it.",
             True, scope="request", switches=(Switch("--no-think", False),)),
        _row("ctx-size", "Context", "int", "generation", "basic",
             "The tokens the model sees at once: prompt, conversation and answer.",
             "Coding agents need 16384 or more (a first request alone measured 9911 "
             "tokens). Every token of context costs KV-cache memory, taken at load.",
             4096, server_default=16384, short="-c", min=1, max=MAX_TOKENS,
             unit="tokens", env="LLAMA_ARG_CTX_SIZE"),
        _row("threads", "Compute threads", "int", "generation", "basic",
             "The threads that compute each token.",
             "The default is the machine's physical cores; more than that rarely helps "
             "decoding, and fewer leaves cores free for other programs.",
             _physical_cores(), short="-t", min=1, max=MAX_THREADS, env="LLAMA_ARG_THREADS"),
        _row("threads-batch", "Prefill threads", "int", "generation", "advanced",
             "The threads that read the prompt (prefill).",
             "Prefill uses cores better than decoding does, so more threads can pay "
             "here; 0 uses the compute threads.",
             0, min=0, max=MAX_THREADS, special=(Named(0, "same as compute threads"),),
             short="-tb", env="LLAMA_ARG_THREADS_BATCH"),
        _row("trial-threads", "Trial: threads", "int", "generation", "advanced",
             "A second thread count the first answer tries against Compute threads.",
             "The planner sets it until it has measured this model: the first answer "
             "decodes in alternating windows of the two counts, keeps the faster for the "
             "rest of the session, and the next plan reads the verdict. 0 tries nothing.",
             0, min=0, max=MAX_THREADS, special=(Named(0, "off"),)),
        _row("trial-overlap", "Trial: overlap", "bool", "streaming", "advanced",
             "Lets the first answer try Overlap reads both ways.",
             "The planner sets it until it has measured this model: with read-ahead on, "
             "the first answer decodes in alternating windows with overlap on and off, "
             "keeps the faster, and the next plan reads the verdict.",
             False),
        _row("temp", "Temperature", "float", "sampling", "basic",
             "How far sampling strays from the likeliest token.",
             "0 always takes the likeliest token, so the same prompt gives the same "
             "answer; 0.6 to 1 gives varied writing, and higher values drift.",
             0.0, min=0.0, max=2.0, special=(Named(0.0, "greedy"),), env="LLAMA_ARG_TEMPERATURE"),
        _row("top-k", "Top-k", "int", "sampling", "advanced",
             "Samples only among the k likeliest tokens.",
             "Lower it to keep a warm temperature on topic; it does nothing at "
             "temperature 0.",
             40, form=True, min=0, max=1000, special=(Named(0, "whole vocabulary"),),
             env="LLAMA_ARG_TOP_K"),
        _row("top-p", "Top-p", "float", "sampling", "advanced",
             "Samples only among the likeliest tokens whose chances add up to p.",
             "Lower it to trim unlikely tokens at a warm temperature; it does nothing at "
             "temperature 0.",
             0.95, form=True, min=0.0, max=1.0, env="LLAMA_ARG_TOP_P"),
        _row("seed", "Seed", "int", "sampling", "advanced",
             "The start of the random choices sampling makes.",
             "Fix it to repeat a run exactly at a temperature above 0; it does nothing at "
             "temperature 0.",
             SEED_RANDOM, form=True, min=0, max=SEED_RANDOM,
             special=(Named(SEED_RANDOM, "random per run"),)),
        _row("moe-stream", "Expert streaming", "bool", "streaming", "basic",
             "Reads the routed experts from storage as each token needs them.",
             "Off runs the model on plain mmap, as llama.cpp does: fine while the whole "
             "file fits in memory, several times slower once it does not (a 30B MoE on "
             "a 12 GB phone: 2.0 tokens/s on mmap, 5.2 streamed).",
             False, server_default=True),
        _row("io-threads", "Read lanes", "int", "streaming", "advanced",
             "Parallel reads from storage.",
             "On a phone's flash four lanes gave about 3x one reader's bandwidth; a disk "
             "that one reader already keeps busy gains little. More only help a device "
             "with deep queues, and each lane is a thread.",
             4, min=1, max=8),
        _row("o-direct", "Direct I/O", "bool", "streaming", "advanced",
             "Reads experts past the page cache.",
             "Keeps experts from taking memory twice (in the cache and in the page "
             "cache). Turn it off only to measure; where a file system refuses direct "
             "reads the engine falls back to buffered ones and says so.",
             True, switches=(Switch("--no-odirect", False),)),
        _row("huge-pages", "Huge pages for reads", "bool", "streaming", "advanced",
             "Reads experts into memory carved from transparent huge pages.",
             "A direct read costs the disk one transfer per physically contiguous run of "
             "the memory it fills; memory faulted in page by page is scattered, so a "
             "1 MiB read can be 256 transfers. With this on, an expert read into memory "
             "it never had takes pages carved from 2 MiB huge pages (the same bytes, no "
             "more), which on a virtual disk reads up to twice as fast. Off by default: "
             "once a cache of huge-page-backed slices turns over, the kernel splits "
             "those huge pages under the running model, and a gpt-oss-120b slice had a "
             "quarter of its tokens take 0.5-1.6 s instead of 0.09 with it on. No effect "
             "where the kernel has transparent huge pages off.",
             False),
        _row("packed-experts", "Packed experts file", "bool", "streaming", "advanced",
             "Reads MXFP4 experts from the model's packed experts file, where it has one.",
             "`bmoe-server models pack-experts MODEL` writes a copy of the model's MXFP4 "
             "experts (gpt-oss) beside it, already in the layout llama.cpp's repacked "
             "kernels run, so a read lands ready instead of being permuted on the cores "
             "that compute. It costs the experts' bytes again on disk. Used only where it "
             "matches the model file and this CPU's kernels; the load info says why not.",
             True),
        _row("prefetch", "Read-ahead", "int", "streaming", "advanced",
             "Reads the experts of the next layers before their routers pick them.",
             "After each layer the engine guesses the next N layers' experts (their "
             "routers applied to this layer's hidden state) and reads the guesses it "
             "lacks behind the real reads; a wrong guess costs bandwidth, never a wrong "
             "answer. 1 guesses the next layer only; 0 turns it off. Needs a cache "
             "smaller than the experts (once every expert fits, guessing only costs).",
             0, min=0, max=8, special=(Named(0, "off"),)),
        _row("spec-gate", "Read-ahead threshold", "float", "streaming", "advanced",
             "The least router probability a guessed expert needs to be read ahead.",
             "Raise it to read ahead only confident guesses (less bandwidth wasted, "
             "fewer experts ready in time); 0 reads the top guesses whatever their "
             "probability.",
             0.0, min=0.0, max=1.0),
        _row("overlap", "Overlap reads", "bool", "streaming", "advanced",
             "Lets read-ahead run while the model computes.",
             "Off, each layer also waits for its read-ahead (the reads are still "
             "batched); on, compute goes on while the lanes read, and only the time a "
             "layer waits for its own experts is lost (stall).",
             False),
        _row("prefill-ahead", "Prompt read-ahead", "bool", "streaming", "advanced",
             "While a prompt's layer computes, reads the next layer's experts.",
             "A prompt batch routes each layer to most of its experts, so a cache smaller "
             "than the experts reads nearly every expert once per batch. With this on, "
             "the next layer's experts (guessed for the whole batch by that layer's "
             "router) are read while this layer computes, and a long prompt waits only "
             "for what the disk could not read in that time. No effect when every "
             "expert fits the cache.",
             True),
        _row("cache-mb", "Expert cache", "int", "cache", "basic",
             "The memory that keeps experts once read.",
             "More cache reads less from storage, but below one token cycle (the bytes "
             "one token's experts span over all layers) a cache hits 0 % and is slower "
             "than none, so the engine refuses one. auto sizes it once at load to the "
             "memory the process may still take (the machine's, or its memory cgroup's "
             "if tighter) minus the RAM to leave, between one token cycle and all the "
             "experts; 0 turns it off.",
             0, server_default=AUTO, accepts_auto=True, min=0, unit="MiB",
             typical=(1500, 8192), special=(Named(0, "off"),)),
        _row("cache-policy", "Cache policy", "choice", "cache", "advanced",
             "Which cached expert gives way when the cache is full.",
             "reuse keeps the experts most likely to be routed again soon, a chance it "
             "learns from the routing seen so far (how long since each was last routed, "
             "how often it is); it reads the least on recorded routing. next-use keeps "
             "frequent experts of the layers coming next; lru the most recently used; "
             "lfu the most frequently used.",
             "reuse", choices=(Named("reuse", "learned chance of reuse"),
                               Named("next-use", "expected next use"),
                               Named("lru", "least recently used"),
                               Named("lfu", "least frequently used"))),
        _row("cache-fill", "Cache: fill in the background", "bool", "cache", "advanced",
             "When every expert fits the cache, reads them all while the lanes are idle.",
             "The load reads only the dense weights; with this on, a cache that can hold "
             "every expert is then filled by the read lanes at the lowest priority (the "
             "experts a token needs are read first), so a model that fits soon runs with "
             "every expert in memory and no per-layer cache work. Off, experts are read "
             "only when first routed. No effect when the experts do not all fit.",
             True),
        _row("cache-floor-mb", "Cache: RAM to leave", "int", "cache", "advanced",
             "Memory an auto-sized cache leaves to the system and other programs.",
             "Raise it if the machine swaps with the model loaded; each MiB left is a "
             "MiB less cache.",
             1536, form=True, min=0, unit="MiB"),
        _row("cache-ceil-mb", "Cache: ceiling", "int", "cache", "advanced",
             "The most memory an auto-sized cache may take.",
             "Set it to keep room for programs that start after the model loads; 0 "
             "puts no cap on it.",
             0, form=True, min=0, unit="MiB", special=(Named(0, "no cap"),)),
        _row("dense-weights", "Dense weights", "choice", "memory", "advanced",
             "Where the weights every token uses are kept.",
             "anon copies them into the process's memory at load, so they are never "
             "evicted; mmap leaves them on the file mapping, which loads faster but lets "
             "memory pressure evict them and read them again.",
             "anon", choices=(Named("mmap", "file mapping"),
                              Named("anon", "process memory"))),
        _row("repack", "Weight repacking", "choice", "memory", "advanced",
             "Whether a resident model may use llama.cpp's repacked-weight kernels.",
             "llama.cpp can repack Q4_0, Q4_K, IQ4_NL and MXFP4 weights at load for wider "
             "SIMD kernels (and use AMX tiles where built for them). auto checks once per "
             "machine, in a child process, that those kernels run here and agree with the "
             "file's own (this llama.cpp's AMX kernels crash on batches, so auto keeps "
             "them off where AMX is present); on uses them unchecked; off never does. "
             "Under expert streaming the load keeps the file's own layout; where this "
             "choice allows the repacked kernels, the streamer repacks MXFP4 experts "
             "itself as it reads them (gpt-oss).",
             "auto", choices=(Named("auto", "checked on this machine"),
                              Named("on", "always, unchecked"),
                              Named("off", "never")),
             switches=(Switch("--no-repack", "off"), Switch("-nr", "off")),
             synonyms=ON_OFF_AUTO, env="LLAMA_ARG_REPACK"),
        _row("rpc", "RPC helpers", "text", "memory", "advanced",
             "Other machines (HOST:PORT, comma-separated) that hold some of the model's "
             "layers in their memory.",
             "Each runs `bmoe-server rpc-worker`; the layers are shared among them by the "
             "memory they report (or by Layers on helpers), and the layers that stay here "
             "stream their experts. Set at "
             "launch only: the protocol is unauthenticated, so where it connects is not "
             "an API setting.",
             "", launch_only=True, env="LLAMA_ARG_RPC"),
        _row("rpc-layers", "Layers on helpers", "int", "memory", "advanced",
             "How many of the model's last layers the RPC helpers hold.",
             "Counted from the end, as llama.cpp's -ngl counts (the output layer is one); "
             "-1 gives them as many as fit the memory they report free. The layers that "
             "stay here stream their experts through the cache.",
             -1, min=-1, max=100000, special=(Named(-1, "by their memory"),)),
        _row("batch-size", "Prompt batch", "int", "context", "advanced",
             "The most prompt tokens one llama.cpp call is given (llama-server's -b).",
             "A long prompt is read in calls of this many tokens, each run in micro-batches "
             "of Prompt micro-batch; larger cuts the calls, not the work. Capped at the "
             "context.",
             PROMPT_BATCH, short="-b", min=1, max=MAX_BATCH, unit="tokens",
             env="LLAMA_ARG_BATCH"),
        _row("ubatch-size", "Prompt micro-batch", "int", "context", "advanced",
             "The tokens computed together while a prompt is read (llama-server's -ub).",
             "Larger reads long prompts faster on many cores and streams each expert once "
             "for more tokens, at the cost of a compute buffer that grows with it; never "
             "more than Prompt batch.",
             PROMPT_BATCH, short="-ub", min=1, max=MAX_BATCH, unit="tokens",
             env="LLAMA_ARG_UBATCH"),
        _row("flash-attn", "Flash attention", "choice", "context", "advanced",
             "Computes attention in one fused step instead of materialising its scores.",
             "auto lets llama.cpp use it where this machine's backend runs it; a quantized "
             "V cache needs it on or auto. Off is for measuring.",
             AUTO, short="-fa", choices=(Named("auto", "where the backend has it"),
                                         Named("on", "always"), Named("off", "never")),
             synonyms=ON_OFF_AUTO, env="LLAMA_ARG_FLASH_ATTN"),
        _row("cache-type-k", "KV cache: K type", "choice", "context", "advanced",
             "The number format the context's keys are kept in.",
             "q8_0 halves the keys' memory against f16 at a small cost in accuracy; q4 "
             "types cut it further and cost more. A quantized type needs the model's head "
             "width to be a multiple of 32.",
             "f16", short="-ctk", choices=tuple(Named(t, t) for t in KV_TYPES),
             lossy=True, env="LLAMA_ARG_CACHE_TYPE_K"),
        _row("cache-type-v", "KV cache: V type", "choice", "context", "advanced",
             "The number format the context's values are kept in.",
             "As for K; a quantized V type needs Flash attention on or auto.",
             "f16", short="-ctv", choices=tuple(Named(t, t) for t in KV_TYPES),
             lossy=True, env="LLAMA_ARG_CACHE_TYPE_V"),
        _row("swa-full", "Full-size SWA cache", "bool", "context", "advanced",
             "Keeps every position in the cache of sliding-window attention layers.",
             "A model with sliding-window layers (Gemma, gpt-oss) then keeps a longer "
             "prompt prefix reusable, at the memory of a full cache for those layers; no "
             "effect on other models.",
             False, env="LLAMA_ARG_SWA_FULL"),
        _row("embedding", "Embeddings only", "bool", "context", "advanced",
             "Serves the model's embeddings (/v1/embeddings, /embedding) instead of chat.",
             "For an embedding model (BERT, a text-embedding GGUF) or a reranker (with "
             "Pooling rank: /rerank). The context computes vectors, not tokens, so the chat "
             "routes answer 501 while it is on. A change takes effect at the next load.",
             False, switches=(Switch("--no-embedding", False), Switch("--embeddings", True)),
             env="LLAMA_ARG_EMBEDDINGS"),
        _row("pooling", "Pooling", "choice", "context", "advanced",
             "How a prompt's token vectors become its embedding.",
             "auto takes the model's own (an embedding model says which); mean averages "
             "them, cls takes the first token's, last the last one's, none returns one "
             "vector per token (/embedding only), rank scores a query against a document "
             "(a reranker's head). Only with Embeddings only on.",
             AUTO, choices=(Named("auto", "the model's"), Named("none", "every token's"),
                            Named("mean", "the mean"), Named("cls", "the first token's"),
                            Named("last", "the last token's"),
                            Named("rank", "a reranker's score")),
             env="LLAMA_ARG_POOLING"),
        _row("force-cache", "Force cache size", "bool", "diagnostics", "debug",
             "Accepts an expert cache smaller than one token cycle.",
             "The engine refuses such a cache because it hits 0 % and is slower than "
             "none; force it only to measure that.",
             False),
        _row("load-all", "Load all experts", "bool", "diagnostics", "debug",
             "Loads every expert into memory at load instead of reading them on demand.",
             "The baseline to compare streaming against; it needs memory for every "
             "expert in the file.",
             False),
        _row("decide", "Decisions", "bool", "server", "advanced",
             "Lets clients ask the model to choose among given answers (/api/decide).",
             "Each decision is one prompt read and no answer written, so it is cheap; "
             "turn it off to refuse such requests.",
             False, server_default=True, form=True),
    )


@lru_cache(maxsize=1)
def _table() -> tuple[Param, ...]:
    return _rows()


@lru_cache(maxsize=1)
def _by_key() -> dict[str, Param]:
    return {p.key: p for p in _table()}


def table() -> list[Param]:
    """Every row, in table order."""
    return list(_table())


def param(key: str) -> Param:
    """The row for ``key``; KeyError for a key the table does not have."""
    return _by_key()[key]


def defaults(server: bool) -> dict[str, Any]:
    return {p.key: p.default_for(server) for p in _table()}


# --- describe ---------------------------------------------------------------------------

def _named(items: tuple[Named, ...]) -> list[dict[str, Any]]:
    return [{"value": n.value, "label": n.label} for n in items]


def _switch(s: Switch) -> dict[str, Any]:
    out: dict[str, Any] = {"flag": s.flag, "value": s.value}
    if s.deprecated:
        out["deprecated"] = True
    return out


def describe_param(p: Param, server: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "key": p.key, "label": p.label, "type": p.type, "group": p.group,
        "group_label": p.group_label, "group_help": p.group_help,
        "group_order": p.group_order}
    if p.group_read_only:
        out["group_read_only"] = True
    out.update(level=p.level, form=p.form, scope=p.scope, help=p.help)
    if p.details:
        out["details"] = p.details
    out["flag"] = p.flag
    optional: dict[str, Any] = {
        "short": p.short,
        "switches": [_switch(s) for s in p.switches] or None,
        "choices": _named(p.choices) or None,
        "min": p.min, "max": p.max, "unit": p.unit,
        "typical": {"min": p.typical[0], "max": p.typical[1]} if p.typical else None,
        "special": _named(p.special) or None,
        "lossy": p.lossy or None, "accepts_auto": p.accepts_auto or None,
        "launch_only": p.launch_only or None}
    out.update((k, v) for k, v in optional.items() if v is not None)
    out["default"] = p.default_for(server)
    return out


def describe(server: bool) -> list[dict[str, Any]]:
    """The JSON of ``GET /api/params`` (server=True) or ``bmoe-cli --describe-params``."""
    return [describe_param(p, server) for p in _table()]


# --- parsing and validation -------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _shown(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."


def _parse_bool(p: Param, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError(f"{{{p.key}}} must be true or false, not {_shown(raw)}")


def _parse_number(p: Param, raw: Any) -> int | float:
    kind = "a whole number" if p.type == "int" else "a number"
    if p.accepts_auto:
        kind += " or auto"
    wrong = ValueError(f"{{{p.key}}} must be {kind}, not {_shown(raw)}")
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise wrong
    try:
        value = float(raw) if p.type == "float" else _to_int(raw)
    except (ValueError, OverflowError):
        raise wrong from None
    if not math.isfinite(value):
        raise wrong
    return value


def _to_int(raw: int | float | str) -> int:
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float):
        if not raw.is_integer():
            raise ValueError(raw)
        return int(raw)
    return int(raw.strip())


def _check_range(p: Param, value: int | float) -> None:
    unit = f" {p.unit}" if p.unit else ""
    low = p.min is None or value >= p.min
    high = p.max is None or value <= p.max
    if low and high:
        return
    if p.min is not None and p.max is not None:
        raise ValueError(f"{{{p.key}}} must be between {p.min} and {p.max}{unit}, "
                         f"not {_shown(value)}")
    if not low:
        raise ValueError(f"{{{p.key}}} must be at least {p.min}{unit}, not {_shown(value)}")
    raise ValueError(f"{{{p.key}}} must be at most {p.max}{unit}, not {_shown(value)}")


def _parse_text(p: Param, raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"{{{p.key}}} must be text, not {_shown(raw)}")
    if "\0" in raw:
        raise ValueError(f"{{{p.key}}} must not contain a NUL character")
    if p.key == "rpc" and not _RPC_LIST.match(raw):
        raise ValueError(f"{{{p.key}}} must be HOST:PORT[,HOST:PORT...], not {_shown(raw)}")
    if p.key == "chat-template" and raw.strip() and builtin_templates.resolve(raw) is None:
        names = ", ".join(builtin_templates.NAMES)
        raise ValueError(f"{{{p.key}}} must name a built-in template ({names}) or be Jinja "
                         f"template text, not {_shown(raw)}")
    if p.key == "chat-template" and len(raw) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{{{p.key}}} is longer than {MAX_TEMPLATE_CHARS} characters")
    if p.key == "chat-template-kwargs":
        template_kwargs(raw)
    return raw


def template_kwargs(raw: Any) -> dict[str, Any]:
    """The template variables a ``chat-template-kwargs`` value names (``{}`` when empty).

    Raises ValueError with a person's reason naming the setting as ``{chat-template-kwargs}``.
    """
    text = raw.strip() if isinstance(raw, str) else ""
    if not text:
        return {}
    if len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"{{chat-template-kwargs}} is {len(text):,} characters; the limit "
                         f"is {MAX_TEMPLATE_KWARGS_CHARS:,}")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) \
            else ""
        raise ValueError(f"{{chat-template-kwargs}} must be a JSON object such as "
                         f"{{\"enable_thinking\": false}}; it is not JSON{where}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{{chat-template-kwargs}} must be a JSON object such as "
                         f"{{\"enable_thinking\": false}}, not a JSON {_json_name(value)}")
    taken = sorted(k for k in value if k in TEMPLATE_OWN_VARIABLES)
    if taken:
        raise ValueError(f"{{chat-template-kwargs}} cannot set {', '.join(taken)}: the server "
                         "gives the template those itself")
    return value


def _json_name(value: Any) -> str:
    return {list: "list", str: "string", bool: "true/false", type(None): "null"}.get(
        type(value), "number")


_RPC_LIST = re.compile(r"^\s*(?:[^,:\s]+:\d{1,5}(?:\s*,\s*[^,:\s]+:\d{1,5})*)?\s*$")


def _parse_choice(p: Param, raw: Any) -> str:
    allowed = [str(c.value) for c in p.choices]
    if isinstance(raw, str) and raw.strip() in allowed:
        return raw.strip()
    word = raw.strip().lower() if isinstance(raw, str) else None
    for other, value in p.synonyms:
        if word == other:
            return value
    raise ValueError(f"{{{p.key}}} must be one of {', '.join(allowed)}, not {_shown(raw)}")


def parse_value(p: Param, raw: Any) -> Any:
    """The row's value from a JSON value or a command-line string.

    Raises ValueError with a person's reason that names the setting as ``{key}``.
    """
    if p.type == "bool":
        return _parse_bool(p, raw)
    if p.type in ("path", "text"):
        return _parse_text(p, raw)
    if p.type == "choice":
        return _parse_choice(p, raw)
    if p.accepts_auto and isinstance(raw, str) and raw.strip().lower() == AUTO:
        return AUTO
    value = _parse_number(p, raw)
    _check_range(p, value)
    return value


def _cache_above_ceiling(values: dict[str, Any]) -> str:
    cache, ceiling = values.get("cache-mb"), values.get("cache-ceil-mb")
    if not isinstance(cache, int) or not isinstance(ceiling, int) or ceiling <= 0:
        return ""
    if cache <= ceiling:
        return ""
    return (f"{{cache-mb}} is {cache} MiB, above {{cache-ceil-mb}} ({ceiling} MiB): "
            f"lower one, or set {{cache-ceil-mb}} to 0 for no cap")


def _quantized_v_without_flash(values: dict[str, Any]) -> str:
    kind = values.get("cache-type-v")
    if kind in (None, *KV_FLOAT_TYPES) or values.get("flash-attn") != "off":
        return ""
    return (f"{{cache-type-v}} {kind} needs {{flash-attn}} on or auto: llama.cpp keeps a "
            "quantized V cache only with flash attention. Turn it on, or keep V as f16.")


def validate(values: dict[str, Any]) -> str:
    """"" when ``values`` hold together; otherwise a message with ``{key}`` placeholders.

    Checks each value the table knows, then the rules across settings.
    """
    for p in _table():
        if p.key in values:
            try:
                parse_value(p, values[p.key])
            except ValueError as e:
                return str(e)
    for rule in (_cache_above_ceiling, _quantized_v_without_flash):
        message = rule(values)
        if message:
            return message
    return ""


_PLACEHOLDER = re.compile(r"\{([a-z0-9][a-z0-9-]*)\}")


def render(message: str, style: Literal["label", "flag"] = "label") -> str:
    """Replace each ``{key}`` of the table by the row's label (server) or flag (CLI)."""
    def one(m: re.Match[str]) -> str:
        p = _by_key().get(m.group(1))
        if p is None:
            return m.group(0)
        return p.label if style == "label" else p.flag
    return _PLACEHOLDER.sub(one, message)


# --- the command line -------------------------------------------------------------------

def _arg_type(p: Param) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse_value(p, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(render(str(e), "flag")) from None
    convert.__name__ = p.type
    return convert


def _shown_default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return '""' if value == "" else str(value)


def _help(p: Param, server: bool) -> str:
    text = f"{p.help} (default: {_shown_default(p.default_for(server))})"
    return text.replace("%", "%%")


def _metavar(p: Param) -> str:
    if p.type == "choice":
        return "{" + ",".join(str(c.value) for c in p.choices) + "}"
    if p.accepts_auto:
        return "N|auto"
    return {"int": "N", "float": "X", "path": "PATH", "text": "TEXT"}[p.type]


def add_cli_flags(parser: argparse.ArgumentParser, server: bool) -> None:
    """Add every row's flags. Flags not given leave no attribute in the namespace."""
    group = parser.add_argument_group("engine parameters")
    for p in _table():
        names = [p.flag] + ([p.short] if p.short else [])
        common: dict[str, Any] = {"dest": p.dest, "default": argparse.SUPPRESS}
        if p.type == "bool":
            group.add_argument(*names, action="store_const", const=True,
                               help=_help(p, server), **common)
        else:
            group.add_argument(*names, type=_arg_type(p), metavar=_metavar(p),
                               help=_help(p, server), **common)
        for s in p.switches:
            note = "deprecated; " if s.deprecated else ""
            group.add_argument(s.flag, action="store_const", const=s.value,
                               help=f"{note}sets {p.flag} to {_shown_default(s.value)}",
                               **common)


def values_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """The values of the flags given on the command line, by key."""
    return {p.key: getattr(ns, p.dest) for p in _table() if hasattr(ns, p.dest)}


def _bool_args(p: Param, value: bool) -> list[str]:
    if value:
        return [p.flag]
    for s in p.switches:
        if s.value is False and not s.deprecated:
            return [s.flag]
    raise ValueError(f"{{{p.key}}} has no flag that turns it off")


def _value_text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def to_args(values: dict[str, Any], keys: list[str]) -> list[str]:
    """The ``bmoe-cli`` command line (no program name) that sets ``keys`` to ``values``.

    Written in table order; a value that starts with ``-`` is joined to its flag with
    ``=`` so it is not read as a flag of its own.
    """
    wanted = set(keys)
    args: list[str] = []
    for p in _table():
        if p.key not in wanted or p.key not in values:
            continue
        value = values[p.key]
        if p.type == "bool":
            args += _bool_args(p, bool(value))
            continue
        text = _value_text(value)
        args += [f"{p.flag}={text}"] if text.startswith("-") else [p.flag, text]
    return args
