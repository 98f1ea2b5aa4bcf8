"""Export to CTranslate2: a model directory as its Transformer spec (weights as they are); search on it."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import ctranslate2
import torch
from ctranslate2.converters import Converter
from ctranslate2.specs import common_spec, model_spec, transformer_spec
from tqdm import tqdm

from aiayn.checkpoint import EXPORT_CONFIG, ModelDir, check_export_out, read_model_config
from aiayn.config import SearchConfig, save_json
from aiayn.files import staged_dir
from aiayn.inference.search import Hypothesis, length_penalty
from aiayn.inference.shortlist import VMAP_FILE
from aiayn.model import CrossAttention, FeedForward, SelfAttention, Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, UNK_ID, Tokenizer

AIAYN_CONFIG = EXPORT_CONFIG  # our ModelConfig; CTranslate2 writes its own config.json beside it
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which model.py uses; CTranslate2 would assume 1e-6


# --- Weights onto the spec --------------------------------------------------------------------------


# aiayn's activations as CTranslate2 names them: its GELU is the exact (erf) one, SWISH is SiLU
CT2_ACTIVATIONS = MappingProxyType(
    {
        "relu": common_spec.Activation.RELU,
        "swish": common_spec.Activation.SWISH,
        "gelu": common_spec.Activation.GELU,
    }
)


def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer) -> transformer_spec.TransformerSpec:
    """A CTranslate2 TransformerSpec holding the model's weights, vocabularies and special tokens.

    Every weight is copied as it is: no permutation is needed. CTranslate2 generates its own sinusoids
    ([sin, cos] halves, positions from 1) only when no table is given, so ours (interleaved, §3.5) or the
    learned ones are stored as an explicit table of `max_positions` rows.
    """
    config = model.config
    spec = transformer_spec.TransformerSpec.from_config(
        (config.n_encoder_layers, config.n_decoder_layers),
        config.n_heads,
        pre_norm=config.norm == "pre",  # post-norm: LayerNorm after each residual, no final norm
        activation=CT2_ACTIVATIONS[config.activation],  # §3.3's ReLU unless the model names another
    )
    table_rows = config.max_positions
    encoder, decoder = spec.encoder, spec.decoder
    encoder.scale_embeddings = decoder.scale_embeddings = True  # §3.4: embeddings * sqrt(d_model)
    encoder.embeddings[0].weight = _tensor(model.src_embed.tokens.weight)  # (V_src, D)
    encoder.position_encodings.encodings = _tensor(model.src_embed.position_table(table_rows))  # (P, D)
    for layer_spec, layer in zip(encoder.layer, model.encoder):
        _self_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_norm)
        _feed_forward(layer_spec.ffn, layer.feed_forward, layer.feed_forward_norm)
    decoder.embeddings.weight = _tensor(model.tgt_embed.tokens.weight)  # (V_tgt, D)
    decoder.position_encodings.encodings = _tensor(model.tgt_embed.position_table(table_rows))  # (P, D)
    for layer_spec, layer in zip(decoder.layer, model.decoder):
        _self_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_norm)
        _cross_attention(layer_spec.attention, layer.cross_attn, layer.cross_attn_norm)
        _feed_forward(layer_spec.ffn, layer.feed_forward, layer.feed_forward_norm)
    if config.norm == "pre":
        _layer_norm(encoder.layer_norm, model.encoder_norm)
        _layer_norm(decoder.layer_norm, model.decoder_norm)
    decoder.projection.weight = _tensor(model.generator.weight)  # (V_tgt, D); tied: the embedding
    if model.generator.bias is not None:  # an imported model's output bias
        decoder.projection.bias = _tensor(model.generator.bias)

    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.config.unk_token = SPECIAL_TOKENS[UNK_ID]
    spec.config.bos_token = spec.config.decoder_start_token = SPECIAL_TOKENS[BOS_ID]
    spec.config.eos_token = SPECIAL_TOKENS[EOS_ID]
    # The source ids are given with their EOS already (Tokenizer.encode_src), as in training.
    spec.config.add_source_bos = spec.config.add_source_eos = False
    spec.register_source_vocabulary(tokenizer.src_tokens())
    spec.register_target_vocabulary(tokenizer.tgt_tokens())
    return spec


def _tensor(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _linear(spec: common_spec.LinearSpec, weight: torch.Tensor, bias: torch.Tensor) -> None:
    spec.weight, spec.bias = _tensor(weight), _tensor(bias)


def _layer_norm(spec: common_spec.LayerNormSpec, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _tensor(norm.weight), _tensor(norm.bias)


def _self_attention(spec, attn: SelfAttention, norm: torch.nn.LayerNorm) -> None:
    """linear[0]: the fused (3D, D) [W^Q; W^K; W^V], our in_proj as it is; linear[1]: W^O."""
    _linear(spec.linear[0], attn.in_proj.weight, attn.in_proj.bias)
    _linear(spec.linear[1], attn.out_proj.weight, attn.out_proj.bias)
    _layer_norm(spec.layer_norm, norm)


def _cross_attention(spec, attn: CrossAttention, norm: torch.nn.LayerNorm) -> None:
    """linear[0]: queries W^Q; linear[1]: the fused (2D, D) [W^K; W^V]; linear[2]: W^O."""
    _linear(spec.linear[0], attn.q_proj.weight, attn.q_proj.bias)  # (D, D)
    _linear(spec.linear[1], attn.kv_proj.weight, attn.kv_proj.bias)  # (2D, D)
    _linear(spec.linear[2], attn.out_proj.weight, attn.out_proj.bias)
    _layer_norm(spec.layer_norm, norm)


def _feed_forward(spec, ff: FeedForward, norm: torch.nn.LayerNorm) -> None:
    _linear(spec.linear_0, ff.w_1.weight, ff.w_1.bias)  # (F, D)
    _linear(spec.linear_1, ff.w_2.weight, ff.w_2.bias)  # (D, F)
    _layer_norm(spec.layer_norm, norm)


class SpecConverter(Converter):
    """CTranslate2's converter contract: _load() returns the spec; convert() validates and writes it."""

    def __init__(self, spec: transformer_spec.TransformerSpec):
        self._spec = spec

    def _load(self) -> transformer_spec.TransformerSpec:
        return self._spec


def export_ctranslate2(
    model_dir: str | Path | ModelDir, out: str | Path, quantization: str | None = None, force: bool = False
) -> Path:
    """Write model directory MODEL_DIR as a CTranslate2 model directory OUT (with our tokenizer files).

    quantization: one of CTranslate2's weight types (int8, float16, ...); None keeps float32.
    OUT is made under a temporary name and renamed, so a failed export leaves nothing half written.
    """
    model_dir, out = ModelDir.read(model_dir), Path(out)
    if quantization is not None and quantization not in model_spec.ACCEPTED_MODEL_TYPES:
        raise ValueError(
            f"unknown quantization {quantization!r}; "
            f"choose one of {', '.join(model_spec.ACCEPTED_MODEL_TYPES)}"
        )
    check_export_out(model_dir.path, out, force)
    model, tokenizer = model_dir.model(), model_dir.tokenizer
    spec = ctranslate2_spec(model, tokenizer)
    if (model_dir.path / VMAP_FILE).is_file():  # the shortlist, for translate_batch(use_vmap=True)
        spec.register_vocabulary_mapping(str(model_dir.path / VMAP_FILE))
    with staged_dir(out) as tmp:
        SpecConverter(spec).convert(str(tmp), quantization=quantization, force=True)
        tokenizer.save(tmp)
        save_json(model.config, tmp / AIAYN_CONFIG)
    return out


# --- Translating with the exported model -------------------------------------------------------------


class CTranslate2Translator:
    """The Translator interface (`translate`, `translate_ids`) over an exported CTranslate2 model.

    Search follows aiayn's contract (search.py): EOS-terminated source ids, decoding from BOS, at most
    floor(a * source length + b) output tokens EOS included, per sentence. Greedy search gives the same
    tokens as aiayn's (up to floating-point ties). Beam search differs in two ways: CTranslate2 only has
    the "average" length penalty, score / |Y|^alpha, so length_penalty="gnmt" (the paper's) is refused
    for beams; and it stops a sentence once beam_size hypotheses have finished, where aiayn goes on
    until no live hypothesis can win, so in rare cases aiayn finds a better-scoring output. With alpha=0
    both searches are exact and agree. aiayn never outputs PAD or BOS, keeping their probabilities inside
    the softmax; CTranslate2's suppress_sequences would renormalise without them and change every score,
    so they stay allowed here (a trained model gives them almost nothing). The exported position table
    has max_positions rows: longer inputs or output limits are refused (aiayn's sinusoids extend, §3.5).
    """

    def __init__(
        self,
        directory: str | Path,
        search_config: SearchConfig | None = None,
        device: str = "cpu",
        compute_type: str = "float32",
        threads: int = 0,
        batch_tokens: int = 4096,
    ):
        directory = Path(directory)
        self.config = read_model_config(directory / AIAYN_CONFIG)
        self.tokenizer = Tokenizer.load(directory)
        self.search_config = search_config or SearchConfig()
        self.batch_tokens = batch_tokens  # source tokens x beam per batch, as Translator
        # threads: CTranslate2's intra_threads (0: its default); one translation at a time.
        self.engine = ctranslate2.Translator(
            str(directory), device=device, compute_type=compute_type, intra_threads=threads, inter_threads=1
        )
        self._src_tokens = self.tokenizer.src_tokens()
        self._tgt_ids = {token: i for i, token in enumerate(self.tokenizer.tgt_tokens())}

    def translate_ids(
        self, ids: list[list[int]], search_config: SearchConfig, progress: bool = False
    ) -> list[list[Hypothesis]]:
        """Token ids (EOS-terminated) -> n-best hypotheses per sentence, in input order."""
        config = search_config
        beam = config.beam_size > 1
        if beam and config.length_penalty == "gnmt" and config.alpha != 0:
            raise ValueError(
                "CTranslate2 has no GNMT length penalty ((5+|Y|)/6)^alpha for beam search; "
                "use length_penalty='average' (score / |Y|^alpha) or alpha=0"
            )
        results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, 0.0)] for _ in ids]
        limits = {}  # the maximum output length of each sentence (§6.1); only EOS: the empty output
        for i, x in enumerate(ids):
            if len(x) > 1:
                limits[i] = config.max_length(len(x))
        rows = self.config.max_positions
        for i, limit in limits.items():
            if max(len(ids[i]), limit) > rows:
                raise ValueError(
                    f"a source of {len(ids[i])} tokens with up to {limit} output tokens needs more positions "
                    f"than the {rows} (max_positions) exported to CTranslate2"
                )
            if limit < 1:
                raise ValueError(f"every maximum output length must be at least 1, got {limit}")
        # CTranslate2 takes one maximum length per call: all sentences are searched at once up to the
        # largest (a batch of mixed lengths stays one batch), and those whose output reached its own
        # limit are searched again with it. Greedy: exactly the per-limit result. Beams: a search
        # whose hypotheses all end before their limit is kept; in the rare case that it went on past
        # the limit before settling on a shorter hypothesis, it is the longer search's result.
        with tqdm(total=len(ids), unit="sent", disable=not progress, leave=False) as bar:
            first = self._search(ids, list(limits), max(limits.values(), default=0), config)
            again: dict[int, list[int]] = defaultdict(list)
            for i, hyps in first.items():
                if any(len(h.tokens) + 1 >= limits[i] for h in hyps):  # + 1: EOS
                    again[limits[i]].append(i)
                else:
                    results[i] = hyps
                    bar.update(1)
            for limit, members in sorted(again.items()):
                for i, hyps in self._search(ids, members, limit, config).items():
                    results[i] = hyps
                bar.update(len(members))
        return results

    def _search(
        self, ids: list[list[int]], members: list[int], limit: int, config: SearchConfig
    ) -> dict[int, list[Hypothesis]]:
        """One CTranslate2 call: the sentences `members` of ids, at most `limit` output tokens each."""
        if not members:
            return {}
        lp = config.alpha if config.beam_size > 1 else 0.0  # greedy: the score is computed below either way
        out = self.engine.translate_batch(
            [[self._src_tokens[t] for t in ids[i]] for i in members],
            max_batch_size=max(1, self.batch_tokens // config.beam_size),
            batch_type="tokens",
            beam_size=config.beam_size,
            num_hypotheses=config.n_best,
            length_penalty=lp,
            return_end_token=True,  # |Y| counts EOS, as search.length_penalty
            return_scores=True,
            max_input_length=0,  # never truncate the source
            max_decoding_length=limit,
            min_decoding_length=0,  # EOS may come first, as in search.py
        )
        return {
            i: [self._hypothesis(h, s, lp, config) for h, s in zip(result.hypotheses, result.scores)]
            for i, result in zip(members, out)
        }

    def _hypothesis(self, tokens: list[str], score: float, lp: float, config: SearchConfig) -> Hypothesis:
        ids = [self._tgt_ids[t] for t in tokens]  # EOS included when it was produced
        n = len(ids)
        log_prob = score * n**lp  # CTranslate2's score is log_prob / |Y|^lp
        if ids and ids[-1] == EOS_ID:
            ids = ids[:-1]
        return Hypothesis(ids, log_prob / length_penalty(n, config.alpha, config.length_penalty), log_prob)

    def translate(self, texts: list[str], beam_size: int | None = None, progress: bool = False) -> list[str]:
        """One output line per input line, in order; an empty input line gives an empty output line."""
        config = self.search_config if beam_size is None else replace(self.search_config, beam_size=beam_size)
        hyps = self.translate_ids(self.tokenizer.encode_src(texts), replace(config, n_best=1), progress)
        return self.tokenizer.decode_tgt([h[0].tokens for h in hyps])
