"""Translator: text in, text out; the one place that joins tokenizer, model and search."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from aiayn.checkpoint import ModelDir
from aiayn.config import Compile, InferenceOptions, SearchConfig
from aiayn.inference.compiled import CompiledDecoder, NotStored, StoredDecoder
from aiayn.inference.graph_store import default_store, stored
from aiayn.inference.search import Decoder, EagerDecoder, Hypothesis, max_lengths, search
from aiayn.inference.shortlist import Shortlist, Shortlisted, load_shortlist
from aiayn.inference.static_cache import row_class
from aiayn.inference.warmup import SENTENCES, Warmup, classes_up_to, plan, store_plan, stored_plan
from aiayn.model import Transformer, attention_maps
from aiayn.precision import DEFAULT_DTYPE, Dtype, autocast, configure, for_inference, resolve_device
from aiayn.tokenizer import BOS_ID, PAD_ID, Tokenizer


class Translator:
    """`Translator.load(dir).translate(["Ein Hund läuft."])` -> ["A dog runs."].

    The model is used as it is given: `Translator.load` prepares one for inference (precision.py);
    training's validation wraps the model it trains.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        search_config: SearchConfig | None = None,
        dtype: Dtype = DEFAULT_DTYPE,
        batch_tokens: int = 4096,
        compile: Compile = False,
        shortlist: Shortlist | None = None,
    ):
        if tokenizer.src_vocab_size != model.config.src_vocab_size or (
            tokenizer.tgt_vocab_size != model.config.tgt_vocab_size
        ):
            raise ValueError(
                f"tokenizer vocabulary sizes ({tokenizer.src_vocab_size}, {tokenizer.tgt_vocab_size}) differ "
                f"from the model's ({model.config.src_vocab_size}, {model.config.tgt_vocab_size})"
            )
        if dtype == "int8" and any(type(m) is torch.nn.Linear for m in model.modules()):
            raise ValueError("dtype int8 needs a quantised model: precision.for_inference(model, 'int8')")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.search_config = search_config or SearchConfig()
        self.dtype = dtype
        self.batch_tokens = batch_tokens  # source tokens x beam per batch
        # search runs on the model itself (`eager`), or on its compiled decoding step (compiled.py), with
        # or without an output-layer shortlist (shortlist.py). compile="stored": the compiled step only for
        # the batches whose graphs the store holds; a store with none of this model's is not even handed to
        # the compiler, whose import alone is slow
        self.eager: Decoder = EagerDecoder(self.model)
        store = default_store()
        self.decoder = self.eager
        if compile == "stored" and stored(self.model, store):
            self.decoder = StoredDecoder(self.model, store)
        elif compile is True:
            self.decoder = CompiledDecoder(self.model, store=store)
        self.shortlist = shortlist
        if shortlist is not None:
            self.decoder = Shortlisted(self.decoder, shortlist)
            self.eager = Shortlisted(self.eager, shortlist)
        # where Translator.load read the model from, and how: what compile_in_background's workers load
        self.source: tuple[Path, InferenceOptions] | None = None

    @classmethod
    def load(
        cls,
        directory: str | Path | ModelDir,
        search_config: SearchConfig | None = None,
        options: InferenceOptions | None = None,
        **overrides: Any,
    ) -> Translator:
        """A model directory (a path, or one ModelDir.read has read), in the layout and number format that
        translate fastest (for_inference); without a search_config, the one the model directory names
        (search.json), else §6.1's.
        options (config.InferenceOptions; overrides: some of its fields, e.g. dtype="fp32", device="cpu"):
        compile=True decodes with a compiled step (compiled.py): the first batch of each row class compiles
        its graphs, or loads what an earlier process compiled from the store (graph_store.default_store), and
        compile_ahead / compile_in_background compile them beforehand in worker processes; compile="stored"
        only loads, and decodes eagerly where the store has no graphs;
        shortlist restricts the output layer to the candidates of the directory's vmap.txt (shortlist.py)."""
        if isinstance(overrides.get("device"), torch.device):
            overrides["device"] = str(overrides["device"])
        given = {name: value for name, value in overrides.items() if value is not None}  # None: the options'
        options = replace(options or InferenceOptions(), **given)
        device = resolve_device(options.device)
        configure(device)
        model_dir = ModelDir.read(directory)
        model = for_inference(model_dir.model(device), options.dtype)
        candidates = load_shortlist(model_dir.path, model_dir.tokenizer) if options.shortlist else None
        translator = cls(
            model, model_dir.tokenizer, search_config or model_dir.search, options.dtype,
            compile=options.compile, shortlist=candidates,
        )  # fmt: skip
        translator.source = (model_dir.path.resolve(), options)
        return translator

    def attention(self, ids: list[int]) -> tuple[list[int], dict[str, list[torch.Tensor]]]:
        """The greedy translation of one sentence of source ids (EOS-terminated) and the attention weights
        of every layer over it, the decoder reading [BOS] + that translation: (tokens, maps) with maps as
        model.attention_maps gives them, each (1, H, L, M) a layer."""
        greedy = replace(self.search_config, beam_size=1, n_best=1)
        tokens = self.translate_ids([ids], greedy)[0][0].tokens
        tgt_in = [BOS_ID, *tokens]
        with torch.inference_mode():
            src, tgt = (torch.tensor([x], device=self.device) for x in (ids, tgt_in))
            return tokens, attention_maps(self.model, src, tgt)

    @property
    def compiled(self) -> CompiledDecoder | None:
        """The compiled decoder search runs on (under a shortlist or not), or None when it runs eagerly."""
        decoder = self.decoder.decoder if isinstance(self.decoder, Shortlisted) else self.decoder
        return decoder if isinstance(decoder, CompiledDecoder) else None

    def compile_in_background(
        self, search_config: SearchConfig, max_sentences: int, say: Callable[[str], None], workers: int = 2
    ) -> Warmup:
        """Have worker processes compile (or load from the store) the graphs that batches of up to
        max_sentences decode with under this search, and decode with them as they come: each row class
        of batches eagerly until all its graphs are in (warmup.py; `aiayn serve`). Returns the Warmup,
        not yet started. Needs a translator of Translator.load (the workers load the same directory)
        with compile=True."""
        compiled = self._compiling()
        store = compiled.store
        if store is None:  # AIAYN_COMPILE_STORE=none: a store for this process's life, which the workers fill
            self._scratch = tempfile.TemporaryDirectory(prefix="aiayn-graphs-")
            store = Path(self._scratch.name)
        decoder = StoredDecoder(self.model, store, max_sentences=compiled.max_sentences)
        decoder.classes = set()
        self.decoder = decoder if self.shortlist is None else Shortlisted(decoder, self.shortlist)
        sizes = classes_up_to(min(max_sentences, decoder.max_sentences))
        return Warmup(self.source, decoder, [search_config], sizes, workers, say)  # type: ignore[arg-type]

    def compile_ahead(
        self, ids: list[list[int]], search_config: SearchConfig, say: Callable[[str], None], workers: int = 2
    ) -> None:
        """Compile the graphs that translating ids with this search will decode with, in worker processes
        that share the CPU's cores, and return once they are in (`aiayn translate --compile`): the row
        classes of its batches, found first by decoding each class's warm-up batch eagerly (warmup.plan),
        so that graphs already in the store start no worker; an earlier run's plan, where the store keeps
        it (warmup.stored_plan), saves that pass. A graph a worker failed to make is compiled
        here, when its batch comes."""
        compiled = self._compiling()
        if compiled.store is None:  # nowhere to hand graphs over: each compiles here when first needed
            return
        lengths = [len(x) for x in ids]
        sentences = {
            len(b) for b in self.batches(lengths, search_config.beam_size) if len(b) <= compiled.max_sentences
        }
        sizes = {cls: n for cls, n in SENTENCES.items() if cls in {row_class(b) for b in sentences}}
        if not sizes:
            return
        if stored_plan(compiled, [search_config], sizes) is not None:  # an earlier run's, all of it stored
            return
        needs = plan(self, [search_config], sizes)
        if all(compiled.package_path(key).is_file() for key in needs):
            store_plan(compiled, [search_config], sizes, needs)
            return
        warmup = Warmup(self.source, compiled, [search_config], sizes, workers, say, here=True, needs=needs)  # type: ignore[arg-type]
        warmup.start()
        try:
            warmup.compile_here(self)
            warmup.wait()
        finally:
            warmup.stop()

    def _compiling(self) -> CompiledDecoder:
        compiled = self.compiled
        if compiled is None or self.source is None or type(compiled) is not CompiledDecoder:
            raise ValueError("compiling ahead needs Translator.load(..., compile=True)")
        return compiled

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def batches(self, lengths: list[int], beam_size: int) -> Iterator[list[int]]:
        """Indices of non-empty inputs, longest first, in batches of at most batch_tokens x beam."""
        order = sorted((i for i, n in enumerate(lengths) if n > 1), key=lambda i: -lengths[i])
        batch: list[int] = []
        for i in order:
            if batch and (len(batch) + 1) * lengths[batch[0]] * beam_size > self.batch_tokens:
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def translate_ids(
        self, ids: list[list[int]], search_config: SearchConfig, progress: bool = False
    ) -> list[list[Hypothesis]]:
        """Token ids (EOS-terminated) -> n-best hypotheses per sentence, in input order.

        An input that is only EOS (an empty line) gives one empty hypothesis without running the model.
        Sinusoidal positions extend to any length (§3.5); learned ones stop at max_positions, so a longer
        input is refused and outputs end there at the latest (the decoder has no position beyond it).
        """
        results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, 0.0)] for _ in ids]
        lengths = [len(x) for x in ids]
        config = self.model.config
        if search_config.beam_size > config.tgt_vocab_size:
            raise ValueError(
                f"beam_size={search_config.beam_size} is more than the {config.tgt_vocab_size} tokens of the "
                "target vocabulary: a beam cannot hold more hypotheses than there are next tokens"
            )
        learned = config.positions == "learned"
        too_long = [i for i, n in enumerate(lengths) if learned and n > config.max_positions]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"input line {i + 1} has {lengths[i]} tokens, more than max_positions={config.max_positions} "
                f"of this model's learned positions ({len(too_long)} such lines); split long lines into "
                "sentences first"
            )
        # (a with: an error closes the bar before its line is printed)
        with (
            tqdm(total=len(ids), unit="sent", disable=not progress, leave=False) as bar,
            torch.inference_mode(),
            autocast(self.device, self.dtype),
        ):
            for batch in self.batches(lengths, search_config.beam_size):
                width = max(lengths[i] for i in batch)
                src = torch.full((len(batch), width), PAD_ID, dtype=torch.long)  # (B, S)
                for row, i in enumerate(batch):
                    src[row, : lengths[i]] = torch.tensor(ids[i])
                src = src.to(self.device)
                max_len = max_lengths(src, search_config)  # (B,)
                if learned:
                    max_len = max_len.clamp(max=config.max_positions)
                try:
                    found = search(self.decoder, src, search_config, max_len=max_len)
                except NotStored:  # compile="stored", and the store lacks a graph of this batch
                    found = search(self.eager, src, search_config, max_len=max_len)
                for i, hyps in zip(batch, found):
                    results[i] = hyps
                bar.update(len(batch))
        return results

    def translate(self, texts: list[str], beam_size: int | None = None, progress: bool = False) -> list[str]:
        """One output line per input line, in order; an empty input line gives an empty output line."""
        config = self.search_config if beam_size is None else replace(self.search_config, beam_size=beam_size)
        config = replace(config, n_best=1)
        hyps = self.translate_ids(self.tokenizer.encode_src(texts), config, progress)
        return self.tokenizer.decode_tgt([h[0].tokens for h in hyps])

    def translate_n_best(self, texts: list[str], n_best: int) -> list[list[tuple[str, float]]]:
        """n-best lists: for each input, (translation, score) best first."""
        config = self.search_config.with_n_best(n_best)
        hyps = self.translate_ids(self.tokenizer.encode_src(texts), config)
        return [
            list(zip(self.tokenizer.decode_tgt([h.tokens for h in group]), [h.score for h in group]))
            for group in hyps
        ]
