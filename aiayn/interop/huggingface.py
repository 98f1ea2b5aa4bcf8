"""Export to Hugging Face transformers, and through Optimum to ONNX: a directory that
`AutoModelForSeq2SeqLM.from_pretrained` and `AutoTokenizer.from_pretrained` load, giving aiayn's logits.

No transformers class is "the Transformer", but three hold one of its configurations exactly:

| aiayn                                  | transformers                              |
|----------------------------------------|-------------------------------------------|
| post-norm, sinusoids (the paper's)     | MarianMTModel (one or two vocabularies)   |
| pre-norm, sinusoids                    | PegasusForConditionalGeneration           |
| pre-norm, learned positions            | BlenderbotForConditionalGeneration        |

Two vocabularies of different sizes are padded to the larger (transformers' Marian sizes its decoder
embeddings by the source vocabulary), the padding's logits held at -inf by final_logits_bias, so that
no padding id is ever chosen and the log-probabilities are aiayn's. Post-norm with learned positions has none (BlenderbotSmall and BART normalise the embeddings, BART
reads positions from 2) and is refused, as are two vocabularies in a pre-norm model (Pegasus and
Blenderbot have one embedding matrix).

Marian and Pegasus compute their sinusoids at load time as two halves, [sin | cos]; aiayn's interleave
them, PE(pos, 2i) = sin, PE(pos, 2i+1) = cos (§3.5). A model's function does not change when the
features of its residual stream are permuted consistently: the columns of the embeddings, the gain and
bias of every LayerNorm (its mean and variance do not depend on the order), the input columns of every
matrix that reads the stream, the output rows and biases of every matrix that writes it. The heads'
projections are not permuted. With P = [0, 2, 4, ..., 1, 3, 5, ...], transformers' table is aiayn's
table[:, P], so the permuted weights with transformers' own table compute aiayn's function.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType

import torch
from torch import Tensor, nn

from aiayn.checkpoint import (
    EXPORT_CONFIG,
    LANGUAGES,
    Languages,
    ModelDir,
    check_export_out,
    is_language_code,
    load_languages,
    save_languages,
)
from aiayn.config import ModelConfig, SearchConfig, save_json
from aiayn.extras import need
from aiayn.files import staged_dir, write_contents
from aiayn.model import Transformer
from aiayn.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    SPM_FILE,
    SPM_SRC,
    SPM_TGT,
    UNK_ID,
    Tokenizer,
)

AIAYN_CONFIG = EXPORT_CONFIG  # our ModelConfig, beside transformers' config.json
TARGET_TOKENIZER = "target_tokenizer"  # two vocabularies: the target's tokenizer, which decodes outputs
CHECK_TOLERANCE = 1e-4  # the exported model's logits against aiayn's, checked before anything is written
# aiayn's activations under transformers' names (ACT2FN): swish is SiLU, gelu the exact (erf) one
HF_ACTIVATIONS = MappingProxyType({"relu": "relu", "swish": "swish", "gelu": "gelu"})


def model_type(config: ModelConfig) -> str:
    """The transformers model type that holds this configuration exactly; a ValueError saying why none does."""
    if config.norm == "post" and config.positions == "learned":
        raise ValueError(
            "a post-norm model with learned positions has no exact transformers class: Marian computes "
            "sinusoids, and BlenderbotSmall and BART add a LayerNorm of the embeddings (BART also reads "
            "positions from 2); export to ctranslate2 or keras, or train with positions=sinusoidal"
        )
    if config.norm == "pre" and not config.share_embeddings:
        raise ValueError(
            "a pre-norm model with two vocabularies has no exact transformers class: Pegasus and "
            "Blenderbot, the pre-norm ones, have one embedding matrix; export to ctranslate2 or keras"
        )
    if config.norm == "post":
        return "marian"
    return "pegasus" if config.positions == "sinusoidal" else "blenderbot"


def residual_permutation(config: ModelConfig) -> Tensor:
    """(D,) P: feature j of the exported residual stream is aiayn's feature P[j] (sinusoids' halves)."""
    D = config.d_model
    if config.positions == "learned":  # the table is stored as it is: no reordering needed
        return torch.arange(D)
    return torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])


def vocab_size(config: ModelConfig) -> int:
    """Both sides' vocabulary size in the export: the larger of the two (the smaller is padded)."""
    return max(config.src_vocab_size, config.tgt_vocab_size)


def hf_config(config: ModelConfig):
    """transformers' configuration of the class that holds `config`, every default that differs from
    aiayn's set: Marian's defaults are eos 0, pad and decoder start 58100, gelu, unscaled embeddings and a
    forced EOS; Blenderbot's forbid repeated trigrams of the source."""
    import transformers

    kind = model_type(config)
    common = dict(
        vocab_size=vocab_size(config),
        d_model=config.d_model,
        encoder_layers=config.n_encoder_layers,
        decoder_layers=config.n_decoder_layers,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads,
        activation_function=HF_ACTIVATIONS[config.activation],  # §3.3's relu unless the model names another
        scale_embedding=True,  # §3.4: embeddings * sqrt(d_model)
        max_position_embeddings=config.max_positions,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,  # aiayn decodes from BOS
        forced_eos_token_id=None,
        tie_word_embeddings=config.tie_output,
        use_cache=True,
    )
    if kind == "marian":
        return transformers.MarianConfig(
            **common,
            decoder_vocab_size=vocab_size(config),
            share_encoder_decoder_embeddings=config.share_embeddings,
        )
    if kind == "pegasus":
        return transformers.PegasusConfig(**common)
    # Blenderbot's own default forbids repeating a source trigram. transformers 4 takes None (the generation
    # config's 0 then holds, without a warning that it moved there); 5's typed config wants the 0 itself
    no_repeat = 0 if int(transformers.__version__.split(".")[0]) >= 5 else None
    return transformers.BlenderbotConfig(**common, encoder_no_repeat_ngram_size=no_repeat)


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """aiayn's weights under the names of transformers' BART family (Marian, Pegasus, Blenderbot), the
    residual stream's features permuted by residual_permutation."""
    config = model.config
    P = residual_permutation(config)
    weights: dict[str, Tensor] = {}

    def reads(name: str, weight: Tensor, bias: Tensor) -> None:
        """A projection that reads the stream: its input columns permuted."""
        weights[f"{name}.weight"], weights[f"{name}.bias"] = weight[:, P], bias

    def writes(name: str, linear: nn.Linear) -> None:
        """A projection that writes the stream: its output rows and bias permuted."""
        weights[f"{name}.weight"], weights[f"{name}.bias"] = linear.weight[P], linear.bias[P]

    def norm(name: str, layer_norm: nn.LayerNorm) -> None:
        weights[f"{name}.weight"], weights[f"{name}.bias"] = layer_norm.weight[P], layer_norm.bias[P]

    def attention(name: str, weight: Tensor, bias: Tensor, parts: str) -> None:
        """Fused rows [W^Q; W^K; W^V] (or [W^K; W^V]) as transformers' separate q_proj, k_proj, v_proj."""
        for part, w, b in zip(parts, weight.chunk(len(parts)), bias.chunk(len(parts)), strict=True):
            reads(f"{name}.{part}_proj", w, b)

    def feed_forward(name: str, layer) -> None:
        reads(f"{name}.fc1", layer.feed_forward.w_1.weight, layer.feed_forward.w_1.bias)
        writes(f"{name}.fc2", layer.feed_forward.w_2)
        norm(f"{name}.final_layer_norm", layer.feed_forward_norm)

    for i, layer in enumerate(model.encoder):
        name = f"model.encoder.layers.{i}"
        attention(f"{name}.self_attn", layer.self_attn.in_proj.weight, layer.self_attn.in_proj.bias, "qkv")
        writes(f"{name}.self_attn.out_proj", layer.self_attn.out_proj)
        norm(f"{name}.self_attn_layer_norm", layer.self_attn_norm)
        feed_forward(name, layer)
    for i, layer in enumerate(model.decoder):
        name = f"model.decoder.layers.{i}"
        attention(f"{name}.self_attn", layer.self_attn.in_proj.weight, layer.self_attn.in_proj.bias, "qkv")
        writes(f"{name}.self_attn.out_proj", layer.self_attn.out_proj)
        norm(f"{name}.self_attn_layer_norm", layer.self_attn_norm)
        cross = layer.cross_attn
        reads(f"{name}.encoder_attn.q_proj", cross.q_proj.weight, cross.q_proj.bias)
        attention(f"{name}.encoder_attn", cross.kv_proj.weight, cross.kv_proj.bias, "kv")
        writes(f"{name}.encoder_attn.out_proj", cross.out_proj)
        norm(f"{name}.encoder_attn_layer_norm", layer.cross_attn_norm)
        feed_forward(name, layer)
    if config.norm == "pre":  # the stacks' final LayerNorms
        norm("model.encoder.layer_norm", model.encoder_norm)
        norm("model.decoder.layer_norm", model.decoder_norm)

    V = vocab_size(config)

    def padded(matrix: Tensor) -> Tensor:
        """(V', D) -> (V, D): rows of zeros for the ids the vocabulary lacks."""
        return torch.cat([matrix, matrix.new_zeros(V - matrix.size(0), matrix.size(1))])

    weights["model.encoder.embed_tokens.weight"] = padded(model.src_embed.tokens.weight[:, P])
    weights["model.decoder.embed_tokens.weight"] = padded(model.tgt_embed.tokens.weight[:, P])
    if config.share_embeddings:
        weights["model.shared.weight"] = model.tgt_embed.tokens.weight[:, P]
    weights["lm_head.weight"] = padded(model.generator.weight[:, P])  # the target embedding when tied
    bias = torch.zeros(1, V)  # aiayn's output layer has no bias unless the config gives it one
    if model.generator.bias is not None:
        bias[0, : config.tgt_vocab_size] = model.generator.bias
    bias[:, config.tgt_vocab_size :] = float("-inf")  # ids past the target vocabulary: never chosen
    weights["final_logits_bias"] = bias
    if config.positions == "learned":  # Blenderbot stores its table (positions from 0, as aiayn's)
        weights["model.encoder.embed_positions.weight"] = model.src_embed.positions.weight[:, P]
        weights["model.decoder.embed_positions.weight"] = model.tgt_embed.positions.weight[:, P]
    return {name: tensor.detach().float().contiguous().clone() for name, tensor in weights.items()}


def to_transformers(model: Transformer):
    """The transformers model (in eval mode) computing `model`'s logits, checked on a padded batch."""
    import transformers

    config = model.config
    hf_cfg = hf_config(config)
    classes = {
        "marian": transformers.MarianMTModel,
        "pegasus": transformers.PegasusForConditionalGeneration,
        "blenderbot": transformers.BlenderbotForConditionalGeneration,
    }
    hf = classes[hf_cfg.model_type](hf_cfg).eval()
    weights = hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    computed = {
        name for name in missing if name.endswith("embed_positions.weight")
    }  # sinusoids, made at load
    left = set(missing) - computed - _tied_names(hf)
    if left or unexpected:
        raise RuntimeError(
            f"aiayn's weights do not fill {hf_cfg.model_type}: missing {sorted(left)}, unexpected {sorted(unexpected)}"
        )
    check_logits(model, hf)
    return hf


def _tied_names(hf) -> set[str]:
    """Names of tensors that share storage with another name (tied embeddings): loading one fills both."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in hf.state_dict(keep_vars=True).items():
        key = tensor.data_ptr()
        if key in seen:
            tied |= {name, seen[key]}
        seen[key] = name
    return tied


def probe_batch(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """(src, tgt_in) in aiayn's ids on which an export or an import is checked: two sentences, one padded."""
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, config.src_vocab_size, (2, 7), generator=generator)
    src[:, -1], src[1, 4:] = EOS_ID, torch.tensor([EOS_ID, PAD_ID, PAD_ID])
    tgt_in = torch.randint(4, config.tgt_vocab_size, (2, 5), generator=generator)
    tgt_in[:, 0] = BOS_ID
    return src, tgt_in


def largest_difference(got: Tensor, want: Tensor) -> float:
    """The largest |got - want| of two log-probability tensors; ids that neither predicts (-inf in both: an
    imported model's own PAD row) count as equal."""
    never = want.isneginf() & got.isneginf()
    return (got - want).masked_fill(never, 0.0).abs().max().item()


def check_logits(model: Transformer, hf, tolerance: float = CHECK_TOLERANCE) -> None:
    """A RuntimeError unless hf gives model's log-probabilities (within tolerance) on a padded batch:
    nothing wrong is ever written."""
    src, tgt_in = probe_batch(model.config)
    with torch.no_grad():
        want = model.eval()(src, tgt_in).log_softmax(-1)
        logits = hf(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=tgt_in).logits
        got = logits.log_softmax(-1)[..., : model.config.tgt_vocab_size]
    error = largest_difference(got, want)
    if not error <= tolerance:
        raise RuntimeError(
            f"the {type(hf).__name__} export differs from the model by {error:.2e} (> {tolerance:g})"
        )


def generation_config(search: SearchConfig, hf_cfg):
    """transformers' GenerationConfig for the model's own search (search.json). Its length penalty is
    score / |Y|^alpha, |Y| counting EOS and not the start token: aiayn's "average"; the paper's GNMT
    penalty has no setting there (warned about by the export). early_stopping is aiayn's stopping: True
    ends a beam search at beam-size finished hypotheses ("beam"), "never" when no live one can still win
    ("exact"). transformers takes one output limit per
    call (max_new_tokens), where aiayn's is per sentence (a * source tokens + b)."""
    import transformers

    return transformers.GenerationConfig(
        num_beams=search.beam_size,
        num_return_sequences=1,
        length_penalty=search.alpha if search.beam_size > 1 else 1.0,
        early_stopping=(True if search.stopping == "beam" else "never") if search.beam_size > 1 else False,
        do_sample=False,
        max_length=hf_cfg.max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
        bad_words_ids=[[PAD_ID], [BOS_ID]],  # never output, as in aiayn's search
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
    )


def tokenizer_files(tokenizer_json: str, max_positions: int) -> dict[str, str]:
    """tokenizer.json with a post-processor appending </s> (aiayn appends it in code) and a
    tokenizer_config.json naming the fast tokenizer (else model_type marian resolves to Marian's
    sentencepiece tokenizer) and aiayn's special tokens; aiayn encodes their text literally, which
    transformers does with split_special_tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    tok = HFTokenizer.from_str(tokenizer_json)
    eos = SPECIAL_TOKENS[EOS_ID]
    tok.post_processor = TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, EOS_ID)]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": eos,
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "padding_side": "right",
        "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids, which generate refuses
    }
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=1) + "\n"}


def marian_tokenizer_files(tokenizer: Tokenizer, max_positions: int) -> dict[str, str | bytes]:
    """A SentencePiece tokenizer as MarianTokenizer's files: its two models, vocab.json (piece -> aiayn's
    id, which the export keeps; target_vocab.json too with two vocabularies) and tokenizer_config.json."""
    own = tokenizer.files()
    files = {"source.spm": own[SPM_SRC], "target.spm": own[SPM_TGT]}
    as_json = lambda pieces: json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False, indent=1)  # noqa: E731
    files["vocab.json"] = as_json(tokenizer.src_tokens())
    if not tokenizer.joint:
        files[MARIAN_TARGET_VOCABULARY] = as_json(tokenizer.tgt_tokens())
    config = {
        "tokenizer_class": "MarianTokenizer",
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "model_max_length": max_positions,
        "separate_vocabs": not tokenizer.joint,
        "clean_up_tokenization_spaces": False,
    }
    files["tokenizer_config.json"] = json.dumps(config, indent=1) + "\n"
    return files


def write_transformers(model_dir: ModelDir, directory: Path) -> str:
    """Write the transformers directory of model_dir into directory (existing, empty); its model type."""
    model, tokenizer, search = model_dir.model(), model_dir.tokenizer, model_dir.search
    hf = to_transformers(model)
    hf.generation_config = generation_config(search, hf.config)
    hf.save_pretrained(directory, safe_serialization=True)
    files = tokenizer.files()
    if SPM_FILE in files:
        if hf.config.model_type != "marian":
            raise ValueError(
                f"a SentencePiece vocabulary goes with Marian models only; this is {hf.config.model_type!r}"
            )
        for name, data in marian_tokenizer_files(tokenizer, model.config.max_positions).items():
            write_contents(directory / name, data)
    else:
        src_json = files.get("tokenizer.json") or files["tokenizer.src.json"]
        for name, text in tokenizer_files(src_json, model.config.max_positions).items():
            (directory / name).write_text(text, encoding="utf-8")
        if not tokenizer.joint:  # outputs are decoded with the target's vocabulary
            (directory / TARGET_TOKENIZER).mkdir()
            for name, text in tokenizer_files(
                files["tokenizer.tgt.json"], model.config.max_positions
            ).items():
                (directory / TARGET_TOKENIZER / name).write_text(text, encoding="utf-8")
    save_json(model.config, directory / AIAYN_CONFIG)
    if model_dir.languages is not None:  # for the import that brings it back
        save_languages(model_dir.languages, directory / LANGUAGES)
    if search.beam_size > 1 and search.length_penalty == "gnmt" and search.alpha > 0:
        print(
            f"note: transformers has no GNMT length penalty; generation_config.json divides by |Y|^{search.alpha:g} "
            "(aiayn's length_penalty=average), so beam outputs may differ from aiayn translate's",
            file=sys.stderr,
        )
    return hf.config.model_type


def export_transformers(model_dir: str | Path | ModelDir, out: str | Path, force: bool = False) -> Path:
    """Write model directory MODEL_DIR as a Hugging Face transformers directory OUT: config.json,
    model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json (and aiayn's
    config, and languages.json where the model has one). OUT is made under a temporary name and renamed: a
    failed export leaves nothing half written."""
    model_dir, out = ModelDir.read(model_dir), Path(out)
    check_export_out(model_dir.path, out, force)
    with staged_dir(out) as tmp:
        write_transformers(model_dir, tmp)
    return out


def export_onnx(model_dir: str | Path | ModelDir, out: str | Path, force: bool = False) -> Path:
    """Write model directory MODEL_DIR as ONNX models OUT: the transformers export, then Optimum's ONNX
    exporter (optimum-onnx), for ONNX Runtime: encoder_model.onnx, decoder_model.onnx,
    decoder_with_past_model.onnx and decoder_model_merged.onnx, with the tokenizer and configs, which
    `optimum.onnxruntime.ORTModelForSeq2SeqLM.from_pretrained(OUT)` loads."""
    from optimum.exporters.onnx import main_export

    model_dir, out = ModelDir.read(model_dir), Path(out)
    check_export_out(model_dir.path, out, force)
    with tempfile.TemporaryDirectory(prefix="aiayn-hf-") as hf_dir, staged_dir(out) as tmp:
        write_transformers(model_dir, Path(hf_dir))
        main_export(
            model_name_or_path=hf_dir,
            output=tmp,
            task="text2text-generation-with-past",
            device="cpu",
            do_validation=False,  # tests/interop compare ONNX Runtime's tokens with aiayn's
            library_name="transformers",
        )
        vocabulary = ("tokenizer.json", "tokenizer_config.json", *MARIAN_VOCABULARY, MARIAN_TARGET_VOCABULARY)
        for name in (*vocabulary, AIAYN_CONFIG, LANGUAGES):
            if (Path(hf_dir) / name).is_file():  # the fast tokenizer's files, or MarianTokenizer's
                shutil.copyfile(Path(hf_dir) / name, tmp / name)
        if (Path(hf_dir) / TARGET_TOKENIZER).is_dir():
            shutil.copytree(Path(hf_dir) / TARGET_TOKENIZER, tmp / TARGET_TOKENIZER)
    return out


# --- Import: a transformers Marian model as an aiayn model -----------------------------------------
#
# The inverse of the export above: the same names, the residual features permuted back (P^-1). Marian's
# ids put </s> and <unk> first and <pad>, which is also the decoder's start token, last (OPUS-MT's
# checkpoints); aiayn's specials are ids 0-3 (tokenizer.py), so the rows are reordered: aiayn id i is the
# model's id order[i]. Where the model's pad is its start token, aiayn's BOS takes that row and aiayn's
# PAD is a row of its own: zero (source padding is masked) and never predicted (an output bias of -inf,
# so that the softmax over the other rows is the model's).

# transformers' activation names (ACT2FN) -> aiayn's: "swish" and "silu" are one function, "gelu" erf's
FROM_HF_ACTIVATIONS = MappingProxyType({"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"})


def id_order(size: int, pad: int, start: int, eos: int, unk: int) -> list[int | None]:
    """aiayn's ids in the model's: [PAD, BOS, EOS, UNK, then the model's other ids in order]; None for a
    row the model lacks (aiayn's PAD where the model's pad is its start token). A ValueError where a
    special id is outside the vocabulary or two of them are one."""
    for name, i in (("pad", pad), ("decoder start", start), ("eos", eos), ("unk", unk)):
        if not 0 <= i < size:
            raise ValueError(f"the {name} id {i} is outside the vocabulary of {size}")
    if len({pad, eos, unk}) < 3 or len({start, eos, unk}) < 3:
        raise ValueError(
            f"pad ({pad}), decoder start ({start}), eos ({eos}) and unk ({unk}) must be other ids"
        )
    specials = [None if pad == start else pad, start, eos, unk]
    assert [PAD_ID, BOS_ID, EOS_ID, UNK_ID] == [0, 1, 2, 3]  # the order of `specials`
    return specials + [i for i in range(size) if i not in (pad, start, eos, unk)]


def marian_config(hf_cfg, unk_id: int) -> tuple[ModelConfig, list[int | None], list[int | None]]:
    """aiayn's ModelConfig of a transformers MarianConfig, and the id orders of its source and target
    vocabularies (id_order); a ValueError naming what aiayn cannot hold exactly."""
    if hf_cfg.model_type != "marian":
        raise ValueError(f"aiayn imports Marian models (OPUS-MT's); this is a {hf_cfg.model_type!r} model")
    activation = FROM_HF_ACTIVATIONS.get(hf_cfg.activation_function)
    if activation is None:
        raise ValueError(
            f"activation_function {hf_cfg.activation_function!r} has no aiayn equivalent "
            f"(aiayn has {', '.join(FROM_HF_ACTIVATIONS)})"
        )
    unequal = [
        f"{a}={getattr(hf_cfg, a)} and {b}={getattr(hf_cfg, b)}"
        for a, b in (
            ("encoder_ffn_dim", "decoder_ffn_dim"),
            ("encoder_attention_heads", "decoder_attention_heads"),
        )
        if getattr(hf_cfg, a) != getattr(hf_cfg, b)
    ]
    if unequal:
        raise ValueError(
            f"aiayn's encoder and decoder share their sizes; this model has {'; '.join(unequal)}"
        )
    if not hf_cfg.scale_embedding:
        raise ValueError("scale_embedding is false: aiayn always scales embeddings by sqrt(d_model) (§3.4)")
    if hf_cfg.d_model % 2:
        raise ValueError(f"Marian's sinusoids of an odd d_model ({hf_cfg.d_model}) are not aiayn's")
    shared = hf_cfg.share_encoder_decoder_embeddings
    src_size = hf_cfg.vocab_size
    tgt_size = src_size if shared else hf_cfg.decoder_vocab_size
    ids = dict(
        pad=hf_cfg.pad_token_id, start=hf_cfg.decoder_start_token_id, eos=hf_cfg.eos_token_id, unk=unk_id
    )
    src_order, tgt_order = id_order(src_size, **ids), id_order(tgt_size, **ids)
    config = ModelConfig(
        src_vocab_size=len(src_order),
        tgt_vocab_size=len(tgt_order),
        d_model=hf_cfg.d_model,
        d_ff=hf_cfg.encoder_ffn_dim,
        n_heads=hf_cfg.encoder_attention_heads,
        n_encoder_layers=hf_cfg.encoder_layers,
        n_decoder_layers=hf_cfg.decoder_layers,
        dropout=hf_cfg.dropout,
        attention_dropout=hf_cfg.attention_dropout,
        max_positions=hf_cfg.max_position_embeddings,
        norm="post",
        positions="sinusoidal",
        share_embeddings=shared,
        tie_output=hf_cfg.tie_word_embeddings,
        activation=activation,
        output_bias=True,
    )
    return config, src_order, tgt_order


def from_transformers(hf, unk_id: int = 1) -> tuple[Transformer, list[int | None], list[int | None]]:
    """A transformers MarianMTModel (in float32) as an aiayn Transformer (eval mode) computing its
    log-probabilities, checked on a padded batch; with the id orders of its two vocabularies (aiayn id i is
    the model's order[i]). unk_id: the model's <unk> (the vocabulary's, which the model does not know)."""
    config, src_order, tgt_order = marian_config(hf.config, unk_id)
    hf_weights = {name: t.detach().float() for name, t in hf.state_dict().items()}
    if (
        None not in tgt_order
        and "final_logits_bias" in hf_weights
        and not hf_weights["final_logits_bias"].any()
    ):
        config = dataclasses.replace(config, output_bias=False)  # none to hold (an aiayn export's, say)
    Pinv = torch.argsort(residual_permutation(config))  # feature j of aiayn's stream is the model's Pinv[j]
    model = Transformer(config).eval()
    weights: dict[str, Tensor] = {}

    def hf_tensor(name: str) -> Tensor:
        if name not in hf_weights:
            raise ValueError(f"the model has no {name}: not a whole Marian model")
        return hf_weights[name]

    def reads(name: str) -> tuple[Tensor, Tensor]:
        return hf_tensor(f"{name}.weight")[:, Pinv], hf_tensor(f"{name}.bias")

    def writes(ours: str, name: str) -> None:
        weights[f"{ours}.weight"], weights[f"{ours}.bias"] = (
            hf_tensor(f"{name}.weight")[Pinv],
            hf_tensor(f"{name}.bias")[Pinv],
        )

    def norm(ours: str, name: str) -> None:
        writes(ours, name)  # a LayerNorm's gain and bias are features of the stream

    def fused(ours: str, name: str, parts: str) -> None:
        pairs = [reads(f"{name}.{part}_proj") for part in parts]
        weights[f"{ours}.weight"] = torch.cat([w for w, _ in pairs])
        weights[f"{ours}.bias"] = torch.cat([b for _, b in pairs])

    def sublayers(ours: str, name: str) -> None:
        fused(f"{ours}.self_attn.in_proj", f"{name}.self_attn", "qkv")
        writes(f"{ours}.self_attn.out_proj", f"{name}.self_attn.out_proj")
        norm(f"{ours}.self_attn_norm", f"{name}.self_attn_layer_norm")
        weights[f"{ours}.feed_forward.w_1.weight"], weights[f"{ours}.feed_forward.w_1.bias"] = reads(
            f"{name}.fc1"
        )
        writes(f"{ours}.feed_forward.w_2", f"{name}.fc2")
        norm(f"{ours}.feed_forward_norm", f"{name}.final_layer_norm")

    for i in range(config.n_encoder_layers):
        sublayers(f"encoder.{i}", f"model.encoder.layers.{i}")
    for i in range(config.n_decoder_layers):
        sublayers(f"decoder.{i}", f"model.decoder.layers.{i}")
        name = f"model.decoder.layers.{i}.encoder_attn"
        weights[f"decoder.{i}.cross_attn.q_proj.weight"], weights[f"decoder.{i}.cross_attn.q_proj.bias"] = (
            reads(f"{name}.q_proj")
        )
        fused(f"decoder.{i}.cross_attn.kv_proj", name, "kv")
        writes(f"decoder.{i}.cross_attn.out_proj", f"{name}.out_proj")
        norm(f"decoder.{i}.cross_attn_norm", f"model.decoder.layers.{i}.encoder_attn_layer_norm")

    def rows(matrix: Tensor, order: list[int | None], fill: float = 0.0) -> Tensor:
        """matrix's rows (or entries) in aiayn's id order; `fill` for a row the model lacks."""
        out = matrix.new_full((len(order), *matrix.shape[1:]), fill)
        have = torch.tensor([i for i, j in enumerate(order) if j is not None])
        out[have] = matrix[torch.tensor([j for j in order if j is not None])]
        return out

    tgt_embed = hf_tensor("model.decoder.embed_tokens.weight")[:, Pinv]
    weights["tgt_embed.tokens.weight"] = rows(tgt_embed, tgt_order)
    if not config.share_embeddings:
        weights["src_embed.tokens.weight"] = rows(
            hf_tensor("model.encoder.embed_tokens.weight")[:, Pinv], src_order
        )
    if not config.tie_output:
        weights["generator.weight"] = rows(hf_tensor("lm_head.weight")[:, Pinv], tgt_order)
    if config.output_bias:
        weights["generator.bias"] = rows(hf_tensor("final_logits_bias")[0], tgt_order, float("-inf"))
    for name, same in (
        ("src_embed.tokens.weight", config.share_embeddings),
        ("generator.weight", config.tie_output),
    ):
        if same:  # one matrix under two names (§3.4)
            weights[name] = weights["tgt_embed.tokens.weight"]
    model.load_state_dict(weights, strict=True)
    check_imported(model, hf, src_order, tgt_order)
    return model, src_order, tgt_order


def check_imported(
    model: Transformer, hf, src_order: list, tgt_order: list, tolerance: float = CHECK_TOLERANCE
) -> None:
    """A ValueError unless model's log-probabilities are hf's (within tolerance) on a padded batch in
    aiayn's ids, each of the model's ids at its own place: nothing wrong is ever written."""
    src, tgt_in = probe_batch(model.config)
    hf_pad = hf.config.pad_token_id
    to_hf = lambda ids, order: torch.tensor([hf_pad if j is None else j for j in order])[ids]  # noqa: E731
    hf_tgt = torch.tensor([j for j in tgt_order if j is not None])  # the model's ids in aiayn's order
    ours = torch.tensor([i for i, j in enumerate(tgt_order) if j is not None])
    with torch.no_grad():
        want = model.eval()(src, tgt_in).log_softmax(-1)[..., ours]
        hf_src = to_hf(src, src_order)
        logits = hf.eval()(input_ids=hf_src, attention_mask=src.ne(PAD_ID),
                                   decoder_input_ids=to_hf(tgt_in, tgt_order)).logits  # fmt: skip
        got = logits.log_softmax(-1)[..., hf_tgt]
    error = largest_difference(got, want)
    if not error <= tolerance:
        raise ValueError(
            f"the imported model differs from the {type(hf).__name__} by {error:.2e} (> {tolerance:g})"
        )


def generation_search(generation) -> SearchConfig:
    """aiayn's search for a transformers GenerationConfig: its beams and its length penalty, which divides by
    |Y|^alpha (aiayn's "average"), and its stopping: "never" is aiayn's "exact", any other (True, or the
    heuristic of False, which aiayn has not) "beam"; the output limit stays aiayn's per-sentence one (input
    + 50, §6.1), as transformers' max_length is one cap for every call."""
    return SearchConfig(
        beam_size=generation.num_beams,
        alpha=float(generation.length_penalty),
        length_penalty="average",
        stopping="exact" if generation.early_stopping == "never" else "beam",
    )


MARIAN_VOCABULARY = ("source.spm", "target.spm", "vocab.json")  # what MarianTokenizer reads (OPUS-MT's)
MARIAN_TARGET_VOCABULARY = "target_vocab.json"  # beside them where the model has two vocabularies


@dataclasses.dataclass(frozen=True)
class MarianVocabulary:
    """An OPUS-MT directory's SentencePiece vocabulary as transformers' MarianTokenizer reads it: two
    SentencePiece models, vocab.json (piece -> the model's id; target_vocab.json too with two
    vocabularies), and the special tokens' names (tokenizer_config.json)."""

    source_spm: bytes
    target_spm: bytes
    vocab: dict[str, int]
    target_vocab: dict[str, int] | None
    specials: dict[str, str]  # "eos", "unk", "pad" -> the token
    where: Path

    @property
    def unk_id(self) -> int:
        return self.vocab[self.specials["unk"]]

    def tokenizer(self, src_order: list[int | None], tgt_order: list[int | None]) -> Tokenizer:
        """aiayn's SentencePiece tokenizer of it, the pieces in aiayn's id order (id_order)."""
        src = _pieces(self.vocab, src_order, self.where / "vocab.json")
        tgt = None if self.target_vocab is None else _pieces(
            self.target_vocab, tgt_order, self.where / MARIAN_TARGET_VOCABULARY)  # fmt: skip
        ours = {j: i for i, j in enumerate(src_order) if j is not None}
        # the special tokens written in the text become the ids MarianTokenizer gives them, in aiayn's order
        text_specials = {token: ours[self.vocab[token]] for token in self.specials.values()}
        return Tokenizer.sentencepiece(
            self.source_spm, self.target_spm, src, tgt, text_specials, str(self.where)
        )


def _pieces(vocab: dict[str, int], order: list[int | None], path: Path) -> list[str]:
    """One piece per aiayn id: aiayn's names for its specials (ids 0-3), the vocabulary's for the rest; an
    id the vocabulary does not name gets a name no text can produce (it holds a space)."""
    piece_of = {j: piece for piece, j in vocab.items()}
    if len(piece_of) != len(vocab):
        raise ValueError(f"{path}: two pieces share an id")
    known = {j for j in order if j is not None}
    if outside := sorted(set(piece_of) - known):
        raise ValueError(f"{path}: id {outside[0]} is outside the model's vocabulary of {len(known)}")
    pieces = [SPECIAL_TOKENS[i] if i in SPECIAL_TOKENS else piece_of.get(j, f"<unused {j}>")
              for i, j in enumerate(order)]  # fmt: skip
    if taken := [p for p in pieces[len(SPECIAL_TOKENS) :] if p in SPECIAL_TOKENS.values()]:
        raise ValueError(f"{path}: the piece {taken[0]!r} is aiayn's special token, at another id")
    return pieces


def read_marian_vocabulary(source: Path) -> MarianVocabulary:
    """The SentencePiece vocabulary of an OPUS-MT directory; a ValueError naming a missing or broken file."""
    for name in MARIAN_VOCABULARY:
        if not (source / name).is_file():
            raise ValueError(f"{source}: no {name} (an OPUS-MT vocabulary is {', '.join(MARIAN_VOCABULARY)})")
    tokenizer_config = _json_file(source / "tokenizer_config.json", dict) if (
        source / "tokenizer_config.json").is_file() else {}  # fmt: skip
    specials = {}
    for name, default in (("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>")):
        token = tokenizer_config.get(f"{name}_token", default)
        specials[name] = token.get("content") if isinstance(token, dict) else token
    vocabularies = [source / "vocab.json"]
    if tokenizer_config.get("separate_vocabs"):
        vocabularies.append(source / MARIAN_TARGET_VOCABULARY)
    read = []
    for path in vocabularies:
        vocab = _json_file(path, dict)
        if not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in vocab.items()):
            raise ValueError(f"{path}: not a vocabulary (piece -> id)")
        if missing := [t for t in specials.values() if t not in vocab]:
            raise ValueError(f"{path}: no {missing[0]!r}, one of the special tokens")
        read.append(vocab)
    return MarianVocabulary(
        (source / "source.spm").read_bytes(), (source / "target.spm").read_bytes(), read[0],
        read[1] if len(read) > 1 else None, specials, source,
    )  # fmt: skip


def _json_file(path: Path, kind: type):
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not UTF-8 JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, kind):
        raise ValueError(f"{path}: expected a JSON {kind.__name__}")
    return data


def read_transformers(source: Path) -> tuple:
    """(model in float32, its vocabulary: a Tokenizer (aiayn's export's tokenizer.json) or a
    MarianVocabulary (OPUS-MT's), its generation config) of a local transformers directory; a ValueError
    naming what is missing, broken or not importable."""
    import transformers
    from safetensors import SafetensorError

    if not (source / "config.json").is_file():
        raise ValueError(f"{source}: no config.json, not a transformers model directory")
    if (source / "source.spm").is_file() or (source / "vocab.json").is_file():
        need("a SentencePiece vocabulary (source.spm)", "sentencepiece", "sentencepiece")
        vocabulary = read_marian_vocabulary(source)
    else:
        target = source / TARGET_TOKENIZER / "tokenizer.json"
        vocabulary = Tokenizer.from_files(source / "tokenizer.json", target if target.is_file() else None)
    try:
        config = transformers.AutoConfig.from_pretrained(source)
        if config.model_type != "marian":
            raise ValueError(f"aiayn imports Marian models; {source} holds a {config.model_type!r} model")
        # "dtype" since transformers 4.56, which warns of "torch_dtype" on every import
        dtype = {
            "dtype" if hasattr(transformers.PretrainedConfig(), "dtype") else "torch_dtype": torch.float32
        }
        hf = transformers.MarianMTModel.from_pretrained(source, **dtype).eval()
        generation = transformers.GenerationConfig.from_pretrained(source) if (
            source / "generation_config.json").is_file() else None  # fmt: skip
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError, SafetensorError) as e:  # a damaged file
        raise ValueError(f"{source}: cannot load it with transformers: {str(e).splitlines()[0]}") from None
    return hf, vocabulary, generation


def fetch_from_hub(name: str) -> Path:
    """A Hub model's files (those aiayn reads) through huggingface_hub's cache; offline or unknown, a
    ValueError saying so in one line."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.spm", "*.safetensors", "pytorch_model.bin", TARGET_TOKENIZER + "/*"]
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - the hub's errors have no common base; each becomes one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{name}: not a local directory, and it cannot be fetched from the Hugging Face hub "
            f"(offline? {first})"
        ) from None


# ISO 639-5's language families and groups, and ISO 639-2's "mul": what OPUS-MT names a side of a
# multilingual model by (opus-mt-tc-big-en-zle, opus-mt-mul-en), never a language it reads or writes.
LANGUAGE_GROUPS = frozenset(
    "aav afa alg alv apa aqa aql art ath auf aus awd azc bad bai bat ber bih bnt btk cai cau cba ccn ccs cdc "
    "cdd cel cmc cpe cpf cpp crp csu cus day dmn dra egx esx euq fiu fox gem gme gmq gmw grk hmx hok hyx iir "
    "ijo inc ine ira iro itc jpx kar kdo khi kro map mkh mno mun myn nah nai ngf nic nub omq omv oto paa phi "
    "plf poz pqe pqw pra qwe roa sai sal sdv sem sgn sio sit sla smi son sqj ssa syd tai tbq trk tup tut tuw "
    "urj wak wen xgn xnd ypk zhx zle zls zlw znd mul".split()
)
# Helsinki-NLP's names: opus-mt-SRC-TGT, opus-mt-tc-big-SRC-TGT and the like (the last two fields)
_OPUS_MT_NAME = re.compile(r"opus-mt-(?:\w+-)*(?P<source>[^-]+)-(?P<target>[^-]+)")
_TAG = re.compile(r">>(?P<code>.+)<<")  # OPUS-MT's target-language tag, a token of its own


def opus_mt_name(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(source, target) languages an OPUS-MT model's name (opus-mt-de-en) gives, () for a side it names by
    a group (en-ROMANCE, mul-en, en-zle) or for a name of another shape."""
    match = _OPUS_MT_NAME.fullmatch(name)
    if match is None:
        return (), ()
    codes = [match["source"], match["target"]]
    source, target = ((c,) if is_language_code(c) and c not in LANGUAGE_GROUPS else () for c in codes)
    return source, target


def import_languages(
    name: str,
    tokens: list[str],
    source: Sequence[str] = (),
    target: Sequence[str] = (),
    saved: Languages | None = None,
) -> Languages | None:
    """What an imported model translates: the languages given (source, target: --src-lang, --tgt-lang),
    else those an aiayn export saved (its languages.json), else its OPUS-MT name's (the Hub name or the
    directory's: name); its targets else the languages of its >>xx<< tags (tokens: its source
    vocabulary), which choose them. None where the source or the targets stay unknown."""
    named_source, named_target = opus_mt_name(name)
    tags = {
        m["code"]: token for token in tokens if (m := _TAG.fullmatch(token)) and is_language_code(m["code"])
    }
    source = tuple(source) or (saved.source if saved else ()) or named_source
    target = tuple(target) or (saved.target if saved else ()) or tuple(tags) or named_target
    if not source or not target:
        return None
    if tags and (untagged := [code for code in target if code not in tags]):
        raise ValueError(
            f"{name}: the model chooses its target language by a tag, and its vocabulary has no tag for "
            f"{untagged[0]} (its tags: {', '.join(tags.values())})"
        )
    return Languages(source, target, {code: tags[code] for code in target} if tags else {})


def import_transformers(
    source: str | Path,
    out: str | Path,
    force: bool = False,
    src_lang: Sequence[str] = (),
    tgt_lang: Sequence[str] = (),
) -> Path:
    """Write the Marian model of transformers directory SOURCE (or of a Hub name, fetched first) as an
    aiayn model directory OUT (config.json, safetensors, tokenizer, search.json and, where they are known,
    languages.json: import_languages), its log-probabilities checked against transformers' first. OUT is
    made under a temporary name and renamed: a failed import leaves nothing."""
    from aiayn.checkpoint import save_model
    from aiayn.files import check_replaceable

    out = Path(out)
    check_replaceable(out, force)
    if Path(source).is_dir():
        source = Path(source)
        name = source.resolve().name
    elif str(source).count("/") == 1 and not Path(source).exists() and not str(source).startswith((".", "/")):
        name = str(source).split("/")[1]  # (the cache's directory is named otherwise)
        source = fetch_from_hub(str(source))
    else:
        raise ValueError(f"{source}: no such directory, and not a Hub model name (OWNER/NAME)")
    hf, vocabulary, generation = read_transformers(source)
    if isinstance(vocabulary, MarianVocabulary):
        model, src_order, tgt_order = from_transformers(hf, unk_id=vocabulary.unk_id)
        tokenizer = vocabulary.tokenizer(src_order, tgt_order)
    else:
        model, src_order, tgt_order = from_transformers(hf, unk_id=UNK_ID)
        tokenizer = vocabulary
    sizes = (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    if (len(src_order), len(tgt_order)) != sizes:
        raise ValueError(f"{source}: the model's vocabularies ({len(src_order)}, {len(tgt_order)}) are not its "
                         f"tokenizer's {sizes}")  # fmt: skip
    search = generation_search(generation) if generation is not None else SearchConfig()
    saved = load_languages(source) if (source / AIAYN_CONFIG).is_file() else None  # an aiayn export's
    languages = import_languages(name, tokenizer.src_tokens(), src_lang, tgt_lang, saved)
    with staged_dir(out) as tmp:
        save_model(tmp, model, tokenizer, search, languages)
    if languages is None:
        print(
            f"aiayn: the languages of {name} are unknown, so {out} records none (no languages.json); give "
            "them with --src-lang and --tgt-lang",
            file=sys.stderr,
        )
    return out
