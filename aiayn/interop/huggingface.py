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

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from aiayn.checkpoint import EXPORT_CONFIG, check_export_out, load_model, load_search
from aiayn.config import ModelConfig, SearchConfig, save_json
from aiayn.files import staged_dir
from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, Tokenizer

AIAYN_CONFIG = EXPORT_CONFIG  # our ModelConfig, beside transformers' config.json
TARGET_TOKENIZER = "target_tokenizer"  # two vocabularies: the target's tokenizer, which decodes outputs
CHECK_TOLERANCE = 1e-4  # the exported model's logits against aiayn's, checked before anything is written
# aiayn's activations under transformers' names (ACT2FN): swish is SiLU, gelu the exact (erf) one
HF_ACTIVATIONS = {"relu": "relu", "swish": "swish", "gelu": "gelu"}


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


def check_logits(model: Transformer, hf, tolerance: float = CHECK_TOLERANCE) -> None:
    """A RuntimeError unless hf gives model's log-probabilities (within tolerance) on a padded batch:
    nothing wrong is ever written."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, config.src_vocab_size, (2, 7), generator=generator)
    src[:, -1], src[1, 4:] = EOS_ID, torch.tensor([EOS_ID, PAD_ID, PAD_ID])
    tgt_in = torch.randint(4, config.tgt_vocab_size, (2, 5), generator=generator)
    tgt_in[:, 0] = BOS_ID
    with torch.no_grad():
        want = model.eval()(src, tgt_in).log_softmax(-1)
        logits = hf(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=tgt_in).logits
        got = logits.log_softmax(-1)[..., : config.tgt_vocab_size]
    error = (got - want).abs().max().item()
    if not error <= tolerance:
        raise RuntimeError(
            f"the {type(hf).__name__} export differs from the model by {error:.2e} (> {tolerance:g})"
        )


def generation_config(search: SearchConfig, hf_cfg):
    """transformers' GenerationConfig for the model's own search (search.json). Its length penalty is
    score / |Y|^alpha, |Y| counting EOS and not the start token: aiayn's "average"; the paper's GNMT
    penalty has no setting there (warned about by the export). early_stopping "never" is aiayn's rule:
    a beam search ends when no live hypothesis can still win. transformers takes one output limit per
    call (max_new_tokens), where aiayn's is per sentence (a * source tokens + b)."""
    import transformers

    return transformers.GenerationConfig(
        num_beams=search.beam_size,
        num_return_sequences=1,
        length_penalty=search.alpha if search.beam_size > 1 else 1.0,
        early_stopping="never" if search.beam_size > 1 else False,
        do_sample=False,
        max_length=hf_cfg.max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
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


def write_transformers(model_dir: Path, directory: Path) -> str:
    """Write the transformers directory of model_dir into directory (existing, empty); its model type."""
    model = load_model(model_dir)
    tokenizer = Tokenizer.load(model_dir)
    search = load_search(model_dir)
    hf = to_transformers(model)
    hf.generation_config = generation_config(search, hf.config)
    hf.save_pretrained(directory, safe_serialization=True)
    files = tokenizer.files()
    src_json = files.get("tokenizer.json") or files["tokenizer.src.json"]
    for name, text in tokenizer_files(src_json, model.config.max_positions).items():
        (directory / name).write_text(text, encoding="utf-8")
    if not tokenizer.joint:  # outputs are decoded with the target's vocabulary
        (directory / TARGET_TOKENIZER).mkdir()
        for name, text in tokenizer_files(files["tokenizer.tgt.json"], model.config.max_positions).items():
            (directory / TARGET_TOKENIZER / name).write_text(text, encoding="utf-8")
    save_json(model.config, directory / AIAYN_CONFIG)
    if search.beam_size > 1 and search.length_penalty == "gnmt" and search.alpha > 0:
        print(
            f"note: transformers has no GNMT length penalty; generation_config.json divides by |Y|^{search.alpha:g} "
            "(aiayn's length_penalty=average), so beam outputs may differ from aiayn translate's",
            file=sys.stderr,
        )
    return hf.config.model_type


def export_transformers(model_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write model directory MODEL_DIR as a Hugging Face transformers directory OUT: config.json,
    model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json (and aiayn's
    config). OUT is made under a temporary name and renamed: a failed export leaves nothing half written."""
    model_dir, out = Path(model_dir), Path(out)
    check_export_out(model_dir, out, force)
    with staged_dir(out) as tmp:
        write_transformers(model_dir, tmp)
    return out


def export_onnx(model_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write model directory MODEL_DIR as ONNX models OUT: the transformers export, then Optimum's ONNX
    exporter (optimum-onnx), for ONNX Runtime: encoder_model.onnx, decoder_model.onnx,
    decoder_with_past_model.onnx and decoder_model_merged.onnx, with the tokenizer and configs, which
    `optimum.onnxruntime.ORTModelForSeq2SeqLM.from_pretrained(OUT)` loads."""
    from optimum.exporters.onnx import main_export

    model_dir, out = Path(model_dir), Path(out)
    check_export_out(model_dir, out, force)
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
        for name in ("tokenizer.json", "tokenizer_config.json", AIAYN_CONFIG):
            shutil.copyfile(Path(hf_dir) / name, tmp / name)
        if (Path(hf_dir) / TARGET_TOKENIZER).is_dir():
            shutil.copytree(Path(hf_dir) / TARGET_TOKENIZER, tmp / TARGET_TOKENIZER)
    return out
