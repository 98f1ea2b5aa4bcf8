"""Frozen, typed configuration (model, training, search) and the named presets."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from aiayn.precision import DEFAULT_DTYPE, Dtype, TrainDtype

# Not settings: the special token ids are the tokenizer's, the same in every vocabulary (tokenizer.py).
SPECIAL_ID_KEYS = ("pad_id", "bos_id", "eos_id", "unk_id")
MAX_POSITIONS_LIMIT = 100_000  # a larger table of positions is a typo, not a model
MAX_PARAMETERS = 4_000_000_000  # 16 GB of fp32 weights; Table 3's big is 213M: more is a typo


def _about(default: Any, help: str) -> Any:
    """A config field whose help a generated command-line flag shows."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild a Transformer; saved as config.json in every model directory."""

    src_vocab_size: int = 8000
    tgt_vocab_size: int = 8000
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1  # §5.4 residual dropout, also on embeddings + positions
    attention_dropout: float = 0.0  # not in the paper (tensor2tensor option); 0 = faithful
    max_positions: int = 1024  # sinusoids extend past this at run time; learned ones cannot
    norm: Literal["post", "pre"] = "post"  # §3.1 LayerNorm(x + Sublayer(x)); "pre" is a deviation
    positions: Literal["sinusoidal", "learned"] = "sinusoidal"  # §3.5
    share_embeddings: bool = True  # §3.4: source, target and pre-softmax share one matrix
    tie_output: bool = True  # §3.4: target embedding == pre-softmax projection
    # §3.3's ReLU, max(0, x); swish (SiLU, x * sigmoid(x)) and gelu (x * Phi(x), with erf) are deviations
    # that imported models need (OPUS-MT's Marian models use swish)
    activation: Literal["relu", "swish", "gelu"] = "relu"
    output_bias: bool = (
        False  # a bias on the pre-softmax projection: not the paper's; Marian's final_logits_bias
    )

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "d_ff", "n_heads", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_positions > MAX_POSITIONS_LIMIT:
            raise ValueError(f"max_positions must be at most {MAX_POSITIONS_LIMIT}, got {self.max_positions}")
        for name in ("n_encoder_layers", "n_decoder_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "share_embeddings=True needs one vocabulary, got "
                f"src_vocab_size={self.src_vocab_size} and tgt_vocab_size={self.tgt_vocab_size}"
            )
        if self.share_embeddings and not self.tie_output:
            raise ValueError("share_embeddings=True shares all three matrices, so it needs tie_output=True")
        if self.num_parameters() > MAX_PARAMETERS:
            raise ValueError(
                f"this model would have {self.num_parameters():,} parameters ({4 * self.num_parameters() / 1e9:.0f} GB "
                f"in fp32), more than the {MAX_PARAMETERS:,} aiayn builds: check d_model={self.d_model}, "
                f"d_ff={self.d_ff}, the layers and the vocabulary sizes"
            )

    def num_parameters(self) -> int:
        """Distinct parameters of the model this config builds (Transformer.num_parameters, by formula)."""
        D, F = self.d_model, self.d_ff
        attention, ffn, norm = 4 * (D * D + D), 2 * D * F + F + D, 2 * D
        layers = self.n_encoder_layers * (attention + ffn + 2 * norm)
        layers += self.n_decoder_layers * (2 * attention + ffn + 3 * norm)
        embeddings = self.tgt_vocab_size * D * (1 if self.tie_output else 2)
        embeddings += self.tgt_vocab_size if self.output_bias else 0
        if not self.share_embeddings:
            embeddings += self.src_vocab_size * D
        if self.positions == "learned":
            embeddings += self.max_positions * D * (1 if self.share_embeddings else 2)
        final_norms = 2 * norm if self.norm == "pre" else 0
        return layers + embeddings + final_norms


@dataclass(frozen=True)
class TrainConfig:
    """How to train: batches, optimiser, schedule (§5.3), regularisation (§5.4) and when to stop."""

    # the paper's batch was about 25k target tokens: a GPU takes it at once, a CPU in micro-batches
    max_tokens: int = _about(4096, "padded target tokens per micro-batch")
    accumulate: int = 1  # micro-batches per update; the loss is divided, the schedule steps per update
    lr_scale: float = 1.0  # multiplies the §5.3 formula
    warmup_steps: int = 4000  # the paper's schedule warms up this long; its peak is the budget schedule's
    # paper: §5.3 (warmup, then 1/sqrt(step)); budget: linear warmup over warmup_fraction of the budget,
    # then linear to zero exactly at its end (max_minutes or max_updates); auto: budget when there is one
    schedule: Literal["auto", "paper", "budget"] = "auto"
    warmup_fraction: float = 0.1  # the budget schedule's warmup, a fraction of the budget
    # §6.1 averaging in a run with a budget: checkpoints at regular intervals over the last average_fraction
    # of the budget; the final model is their average if it validates better than the best single model
    average_last: int = 5  # 0 or 1: no averaging
    average_fraction: float = 0.2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1
    clip_norm: float = 0.0  # 0 = no clipping (the paper does not clip)
    # auto: bf16 autocast on CUDA, and on a CPU with AMX from d_model 256; else fp32 (precision.training_dtype)
    dtype: TrainDtype = DEFAULT_DTYPE
    max_len: int = 256  # training pairs with more tokens than this on either side are filtered
    max_epochs: int = _about(0, "stop after this many epochs (0: no limit)")
    max_updates: int = _about(0, "stop after this many updates (0: no limit)")
    max_minutes: float = _about(0.0, "stop after this many minutes of training, a budget (0: no limit)")
    valid_every: int = 0  # updates between validations; 0 = once per epoch
    patience: int = 0  # validations without a better BLEU before stopping; 0 = never stop early
    keep_last: int = 5  # newest checkpoints kept, besides the best and those the end of the run averages
    valid_beam_size: int = 1  # the beam of the validations during the run (greedy is fast): valid_search
    # The search the model is trained for (§6.1: beam 4, alpha 0.6, GNMT's penalty): the run's final
    # validation uses it, OUT's search.json keeps it, and translate, evaluate and serve start from it.
    # Its fields are set like the others (--set beam_size=5): SEARCH_KEYS.
    search: SearchConfig = dataclasses.field(default_factory=lambda: SearchConfig())
    seed: int = 1
    skip_nonfinite: bool = False  # skip batches whose loss is not finite instead of stopping
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"  # torchrun: auto = NCCL on CUDA, gloo on CPU
    dist_timeout_minutes: float = 30.0  # a rank that waits longer for the others than this fails the run

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("max_tokens", "accumulate", "warmup_steps", "max_len", "keep_last", "valid_beam_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.lr_scale <= 0:
            raise ValueError(f"lr_scale must be positive, got {self.lr_scale}")
        if not 0.0 <= self.adam_beta1 < 1.0 or not 0.0 <= self.adam_beta2 < 1.0 or self.adam_eps <= 0:
            raise ValueError(
                f"Adam needs betas in [0, 1) and a positive eps, got {self.adam_beta1}, {self.adam_beta2}, "
                f"{self.adam_eps}"
            )
        for name in (
            "max_epochs",
            "max_updates",
            "valid_every",
            "patience",
            "max_minutes",
            "clip_norm",
            "seed",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.dist_timeout_minutes <= 0:
            raise ValueError(f"dist_timeout_minutes must be positive, got {self.dist_timeout_minutes}")
        for name in ("warmup_fraction", "average_fraction"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        if self.average_last < 0:
            raise ValueError(f"average_last must not be negative, got {self.average_last}")
        if self.schedule == "budget" and not (self.max_minutes or self.max_updates):
            raise ValueError("schedule=budget needs a budget: max_minutes or max_updates")
        if self.search.n_best != 1:
            raise ValueError(f"a model's search returns one translation, got n_best={self.search.n_best}")

    @property
    def valid_search(self) -> SearchConfig:
        """The search of the validations during the run: the model's, with valid_beam_size beams."""
        return dataclasses.replace(self.search, beam_size=self.valid_beam_size)

    @property
    def averaged(self) -> int:
        """How many checkpoints the end of the run averages (0: none): any run with a budget, whatever its
        schedule (where the last part of a run is needs only its end)."""
        has_budget = bool(self.max_minutes or self.max_updates)
        return self.average_last if has_budget and self.average_last >= 2 else 0

    @property
    def budgeted(self) -> bool:
        """Whether the learning rate follows the budget (schedule budget, or auto with a budget)."""
        return self.schedule == "budget" or (
            self.schedule == "auto" and bool(self.max_minutes or self.max_updates)
        )


@dataclass(frozen=True)
class SearchConfig:
    """How to decode: greedy (beam_size 1) or beam search with a length penalty (§6.1)."""

    beam_size: int = 4
    alpha: float = 0.6  # length penalty weight
    length_penalty: Literal["gnmt", "average"] = "gnmt"  # gnmt: ((5+|Y|)/6)^alpha, as in the paper
    max_len_a: float = 1.0  # maximum output length = a * input length + b (§6.1: input + 50)
    max_len_b: int = 50
    n_best: int = 1
    # when a sentence's beam search is done: "beam" once beam_size of its hypotheses have finished
    # (fairseq, CTranslate2, transformers' early_stopping=True); "exact" once no live hypothesis can beat
    # its n_best-th finished one (tensor2tensor's bound, what the paper's code did; see docs/deviations.md)
    stopping: Literal["beam", "exact"] = "beam"

    def __post_init__(self) -> None:
        _check_types(self)
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {self.beam_size}")
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"n_best must be in [1, beam_size={self.beam_size}], got {self.n_best}")
        if self.alpha < 0:
            raise ValueError(f"alpha must not be negative, got {self.alpha}")
        if self.max_len_a < 0 or self.max_len_b < 0 or self.max_len_a == self.max_len_b == 0:
            raise ValueError(
                f"the maximum output length max_len_a * input + max_len_b needs both >= 0, not both 0; got "
                f"max_len_a={self.max_len_a}, "
                f"max_len_b={self.max_len_b}"
            )

    def max_length(self, source_tokens: int) -> int:
        """The most output tokens, EOS included, for a source of that many tokens, EOS included:
        floor(max_len_a * source + max_len_b) (§6.1: input length + 50)."""
        return math.floor(self.max_len_a * source_tokens + self.max_len_b)

    def with_n_best(self, n_best: int) -> SearchConfig:
        """This search returning n_best hypotheses a sentence: with at least as many beams."""
        return dataclasses.replace(self, beam_size=max(self.beam_size, n_best), n_best=n_best)

    def describe(self) -> str:
        """How a figure was searched: "greedy", or "beam 4, alpha 0.6, gnmt penalty, beam stopping"."""
        if self.beam_size == 1:
            return "greedy"
        return f"beam {self.beam_size}, alpha {self.alpha}, {self.length_penalty} penalty, {self.stopping} stopping"


Compile = Literal[False, True, "stored"]  # InferenceOptions.compile


@dataclass(frozen=True)
class InferenceOptions:
    """How a model is run to translate, built once from the flags and handed to whatever builds a
    translator (`aiayn translate`, `evaluate`, `plot`, `serve`, a training run's final validation)."""

    device: str = "auto"  # auto (CUDA when there is a GPU), cpu, cuda or cuda:N
    dtype: Dtype = DEFAULT_DTYPE  # auto: fp32 on a CPU, bf16 on CUDA; int8: CPU; fp16: CUDA
    # decode with a compiled step (inference/compiled.py), compiling the graphs a batch needs the first time
    # (True); or only with the graphs an earlier compile left in the store, the other batches eagerly
    # ("stored", which never compiles); eagerly (False: the command line's default, `serve`'s is True)
    compile: Compile = False
    shortlist: bool = False  # the output layer restricted to the model directory's vmap.txt
    threads: int | None = None  # the server's model worker: PyTorch (or CTranslate2) threads
    engine: Literal["torch", "ctranslate2"] = "torch"  # the server's: aiayn's search, or CTranslate2's

    def __post_init__(self) -> None:
        _check_types(self)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")


@dataclass(frozen=True)
class ServeConfig:
    """The server's limits and batching (`aiayn serve`); every field is also a flag of its own name, with
    the help written here once (`aiayn serve --help`)."""

    beam_size: int = _about(4, "default beam size of a request that names none (§6.1: 4)")
    max_body_bytes: int = _about(1 << 20, "request body limit")
    max_texts: int = _about(64, "texts per request")
    max_chars: int = _about(5000, "characters per text")
    max_tokens: int = _about(256, "source tokens per line of a text")
    max_beam: int = _about(8, "largest beam and n-best a request may ask for")
    max_queue: int = _about(1024, "lines waiting to be translated; past it: 503 with Retry-After")
    timeout_s: float = _about(30.0, "a request not answered by then gets 503 (its lines are dropped)")
    batch_tokens: int = _about(4096, "source tokens x beam per batch")
    batch_sentences: int = _about(64, "lines per batch")
    batch_wait_ms: float = _about(5.0, "how long the worker waits for more lines when the queue is short")
    max_batch_requests: int = _about(0, "requests whose lines may share a batch (1: no batching; 0: any)")
    req_limit: int = _about(
        0,
        "requests a client address may make a minute (a list of texts counts its length), as LibreTranslate's "
        "--req-limit; past it 429 (0: no limit)",
    )
    max_memory_mb: int = _about(
        0,
        "memory for the models in memory, in MiB; past it the least recently used is unloaded (0: half the machine's)",
    )
    files_translation: bool = _about(
        True,
        "translate files on LibreTranslate's /translate_file (--no-files-translation: its --disable-files-translation)",
    )
    ready_when_compiled: bool = _about(
        False,
        "/health says 503 until the compiled graphs are in, for a readiness probe (the server answers anyway)",
    )

    def __post_init__(self) -> None:
        _check_types(self)
        at_least_one = ("beam_size", "max_body_bytes", "max_texts", "max_chars", "max_tokens", "max_beam",
                        "max_queue", "batch_tokens", "batch_sentences")  # fmt: skip
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if (
            self.timeout_s <= 0
            or self.batch_wait_ms < 0
            or self.max_batch_requests < 0
            or self.max_memory_mb < 0
        ):
            raise ValueError(
                f"timeout_s must be positive and batch_wait_ms, max_batch_requests, max_memory_mb, req_limit not "
                f"negative; got {self.timeout_s}, {self.batch_wait_ms}, {self.max_batch_requests}, "
                f"{self.max_memory_mb}, {self.req_limit}"
            )
        if self.beam_size > self.max_beam:
            raise ValueError(f"the default beam_size={self.beam_size} is more than max_beam={self.max_beam}")


def _model_preset(d_model: int, d_ff: int, n_heads: int, n_layers: int, dropout: float) -> Mapping[str, Any]:
    return MappingProxyType(
        dict(
            d_model=d_model,
            d_ff=d_ff,
            n_heads=n_heads,
            n_encoder_layers=n_layers,
            n_decoder_layers=n_layers,
            dropout=dropout,
        )
    )


PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "tiny": _model_preset(64, 128, 4, 2, 0.0),  # unit tests: seconds on a CPU
        "small": _model_preset(256, 1024, 4, 3, 0.1),  # CPU training (the benchmarks' `small`)
        "base": _model_preset(512, 2048, 8, 6, 0.1),  # Table 3, base: 65M parameters
        "big": _model_preset(1024, 4096, 16, 6, 0.3),  # Table 3, big: 213M parameters
        "low-resource": _model_preset(128, 512, 4, 4, 0.1),  # 10k-200k pairs, a CPU, a budget: RECIPES
    }
)


@dataclass(frozen=True)
class Recipe:
    """What a preset sets besides the model: training settings and the vocabulary size. The user's own
    flags (--max-tokens, --vocab-size, --set KEY=VALUE) override each of them."""

    train: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))  # TrainConfig
    vocab_size: int = 8000  # the tokenizer's, when it learns one
    bpe_dropout: float = 0.0  # BPE-dropout of the training pairs' segmentations (prepare.py), 0: none
    bpe_dropout_updates: int = 0  # ... for a budget that buys at least this many updates

    def bpe_dropout_for(self, updates: int) -> float:
        """The BPE-dropout of a run whose budget buys this many updates (0: no budget). Other segmentations
        of the same pairs slow learning down (longer sequences, a moving target): they pay when the budget
        leaves the model the updates to use them, and cost BLEU when it does not. Updates, not minutes: a
        minute buys several times more of them on one CPU than on another (training/calibrate.py)."""
        return self.bpe_dropout if updates and updates >= self.bpe_dropout_updates else 0.0


RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        # Chosen on Multi30k's training and validation splits only (docs/results.md); for corpora
        # of about 10k-200k pairs trained under a time budget on a CPU.
        "low-resource": Recipe(
            # decoded with beam 4 and the average length penalty, score / |Y| (fairseq's default), which
            # beat §6.1's alpha 0.6 GNMT penalty in both directions (docs/results.md, the search table)
            train=MappingProxyType(
                dict(max_tokens=1024, warmup_steps=400, lr_scale=0.5, alpha=1.0, length_penalty="average")
            ),
            vocab_size=6000,
            # BPE-dropout 0.1 from 20,000 updates: it paid at about 24,000 and not at about 12,000, in
            # both directions (benchmarks/bench_budget.py; docs/results.md, by updates)
            bpe_dropout=0.1,
            bpe_dropout_updates=20_000,
        ),
    }
)
LOW_RESOURCE_PAIRS = 200_000  # up to this many training pairs `aiayn train` picks low-resource by itself


def recipe(name: str) -> Recipe:
    """The preset's settings besides the model (the defaults for a preset that is a model alone)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return RECIPES.get(name, Recipe())


def preset_for_corpus(pairs: int) -> str:
    """The preset for a corpus of this many training pairs when the user names none."""
    return "low-resource" if pairs <= LOW_RESOURCE_PAIRS else "small"


@dataclass(frozen=True)
class Choice:
    """What a run's recipe decides, where the user's flags do not: the one owner of these decisions."""

    preset: str
    vocab_size: int
    bpe_dropout: float
    updates: int = 0  # the updates the budget buys, where the choice asked (0: not asked, or no budget)


def choose(
    preset: str | None,
    pairs: int | None = None,
    vocab_size: int | None = None,
    bpe_dropout: float | None = None,
    updates: int | Callable[[str], int] = 0,
) -> Choice:
    """The preset (the user's, else the one for a corpus of `pairs` training pairs), then its recipe's
    vocabulary size and BPE-dropout for a budget that buys `updates` updates (0: none), each unless the
    user gave it. updates may be a function of the preset (a calibration, training/calibrate.py), asked
    only where the decision depends on it. `aiayn train` and `aiayn prepare` both ask here; pairs is
    None while the corpus is not read yet, and then preset must be named."""
    if preset is None:
        if pairs is None:
            raise ValueError("choose: a preset, or the number of training pairs that picks one")
        preset = preset_for_corpus(pairs)
    chosen = recipe(preset)
    bought = 0
    if bpe_dropout is None and chosen.bpe_dropout:
        bought = updates(preset) if callable(updates) else updates
        bpe_dropout = chosen.bpe_dropout_for(bought)
    return Choice(
        preset,
        chosen.vocab_size if vocab_size is None else vocab_size,
        bpe_dropout or 0.0,
        bought,
    )


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named ModelConfig; `vocab_size=` sets both vocabularies, other keys override fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if "vocab_size" in overrides:
        vocab_size = overrides.pop("vocab_size")
        fields.update(src_vocab_size=vocab_size, tgt_vocab_size=vocab_size)
    return from_dict(ModelConfig, {**fields, **overrides}, where="preset overrides")


def preset_for_vocabulary(
    name: str, src_vocab_size: int, tgt_vocab_size: int, joint: bool, /, **overrides: Any
) -> ModelConfig:
    """A preset for a tokenizer's vocabularies. §3.4's sharing of the embedding matrices follows from
    the vocabulary: shared for one joint vocabulary unless overridden, and never across two."""
    share = overrides.pop("share_embeddings", joint)
    if share and not joint:
        raise ValueError(
            "share_embeddings=true needs one vocabulary for both languages, but the tokenizer has one per "
            "language (--separate-vocab)"
        )
    for key in ("src_vocab_size", "tgt_vocab_size", "vocab_size"):
        if key in overrides:
            raise ValueError(
                f"{key} is not a setting here: the tokenizer's vocabulary decides it (--vocab-size)"
            )
    vocab = dict(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size)
    return preset(name, **{**overrides, **vocab, "share_embeddings": share})


C = TypeVar("C", ModelConfig, TrainConfig, SearchConfig, ServeConfig)


def from_dict(cls: type[C], values: dict[str, Any], where: str = "config") -> C:
    """Build a config from a dict, refusing unknown keys (a typo is an error, never ignored).

    A TrainConfig takes its search as a "search" object (train.json), as SEARCH_KEYS at the top level
    (--set, recipes and the train.json of runs made before the search was an object), or both: the
    top-level keys win."""
    if cls is TrainConfig:
        values = _nest_search(values, where)
    known = {f.name for f in dataclasses.fields(cls)}
    _refuse_special_ids(values, where)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown {cls.__name__} key(s) {unknown}; known keys: {sorted(known)}")
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# The fields of a TrainConfig's search that are set as if they were its own (`--set alpha=1.0`).
SEARCH_KEYS = ("beam_size", "alpha", "length_penalty", "max_len_a", "max_len_b", "stopping")


def _nest_search(values: dict[str, Any], where: str) -> dict[str, Any]:
    """values with SEARCH_KEYS moved into the "search" SearchConfig."""
    values = dict(values)
    search = values.pop("search", {})
    if isinstance(search, SearchConfig):
        search = dataclasses.asdict(search)
    if not isinstance(search, dict):
        raise ValueError(f"{where}: search must be an object of SearchConfig keys, got {search!r}")
    search = {**search, **{k: values.pop(k) for k in SEARCH_KEYS if k in values}}
    values["search"] = from_dict(SearchConfig, search, where=f"{where}: search")
    return values


def _fields(cls: type) -> dict[str, Any]:
    """The settings of a config class by name with their types; a TrainConfig's search by SEARCH_KEYS."""
    hints = dict(_type_hints(cls))
    if cls is TrainConfig:
        search = _type_hints(SearchConfig)
        hints.pop("search")
        hints |= {k: search[k] for k in SEARCH_KEYS}
    return hints


def parse_overrides(classes: type | tuple[type, ...], items: list[str]) -> dict[str, Any]:
    """Turn ["dropout=0.3", "norm=pre"] into typed values for the fields of a config class (or several)."""
    hints: dict[str, Any] = {}
    for cls in classes if isinstance(classes, tuple) else (classes,):
        hints |= _fields(cls)
    name = " or ".join(c.__name__ for c in (classes if isinstance(classes, tuple) else (classes,)))
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        _refuse_special_ids([key], f"--set {item!r}")
        if key not in hints:
            raise ValueError(
                f"--set {item!r}: unknown key {key!r} (not a {name} field); known keys: {sorted(hints)}"
            )
        out[key] = _parse_value(hints[key], text.strip(), f"--set {item!r}")
    return out


def _refuse_special_ids(keys: Any, where: str) -> None:
    for key in keys:
        if key in SPECIAL_ID_KEYS:
            raise ValueError(
                f"{where}: {key} is not a setting; the special token ids belong to the tokenizer "
                "(pad 0, bos 1, eos 2, unk 3 in every vocabulary aiayn trains)"
            )


def split_overrides(values: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """{key: value} of ModelConfig and TrainConfig fields, split in two; an unknown key is an error."""
    _refuse_special_ids(values, where)
    model_fields, train_fields = set(_fields(ModelConfig)), {*_fields(TrainConfig), "search"}  # train.json's
    unknown = sorted(set(values) - model_fields - train_fields)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown}; known keys: {sorted(model_fields | train_fields)}"
        )
    model = {k: v for k, v in values.items() if k in model_fields}
    return model, {k: v for k, v in values.items() if k in train_fields}


def _parse_value(hint: Any, text: str, where: str) -> Any:
    if hint is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: expected true or false, got {text!r}")
    if typing.get_origin(hint) is Literal:
        if text not in typing.get_args(hint):
            raise ValueError(f"{where}: expected one of {list(typing.get_args(hint))}, got {text!r}")
        return text
    try:
        return hint(text)
    except ValueError:
        raise ValueError(f"{where}: expected {hint.__name__}, got {text!r}") from None


@functools.cache
def _type_hints(cls: type) -> Mapping[str, Any]:
    """A config class's field types, resolved once (the server builds a SearchConfig per request)."""
    return MappingProxyType(typing.get_type_hints(cls))


def _check_types(config: Any) -> None:
    """Refuse wrong-typed values (a string where an int belongs) with the field's name."""
    hints = _type_hints(type(config))
    for field in dataclasses.fields(config):
        value, hint = getattr(config, field.name), hints[field.name]
        if typing.get_origin(hint) is Literal:
            ok = value in typing.get_args(hint)
            expected = f"one of {list(typing.get_args(hint))}"
        elif hint is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            expected = "a finite number"
            if ok and isinstance(value, int):
                object.__setattr__(config, field.name, float(value))
        elif hint is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            expected = "an integer"
        elif hint is bool:
            ok = isinstance(value, bool)
            expected = "true or false"
        elif dataclasses.is_dataclass(hint):
            ok = isinstance(value, hint)
            expected = f"a {hint.__name__}"
        else:
            ok, expected = True, str(hint)
        if not ok:
            raise ValueError(f"{type(config).__name__}.{field.name}: expected {expected}, got {value!r}")


def save_json(config: ModelConfig | TrainConfig | SearchConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object from a file; a missing or bad file is a ValueError naming it."""
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, expected a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(values).__name__}")
    return values


def load_json(cls: type[C], path: str | Path) -> C:
    """Read a config file; a bad file is a ValueError naming it."""
    return from_dict(cls, read_json(path), where=str(path))


__all__ = [
    "ModelConfig",
    "TrainConfig",
    "SearchConfig",
    "ServeConfig",
    "PRESETS",
    "RECIPES",
    "Recipe",
    "preset",
    "recipe",
    "preset_for_corpus",
    "from_dict",
    "parse_overrides",
    "split_overrides",
    "read_json",
    "load_json",
    "save_json",
]
