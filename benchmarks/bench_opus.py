"""A pretrained model's shape, side by side in one run: one OPUS-MT-shaped transformers directory decoded by
aiayn (after `aiayn import`), by CTranslate2 (after `ct2-transformers-converter` of the same directory)
and by transformers' generate.

The directory is what Helsinki-NLP's OPUS-MT models are: MarianMTModel with d_model 512, 6 + 6 layers, 8
heads, d_ff 2048, swish, a final_logits_bias, one vocabulary of 58,101 (</s> 0, <unk> 1, <pad> last and
the decoder's start), shared and tied embeddings, beside source.spm, target.spm and vocab.json, with
random weights. The workload is bench_translate.py's: source sentences of seed 4321 with lengths
uniform{8..24} (ids of the model's vocabulary, no specials), exactly 24 new tokens each (EOS suppressed,
so that random weights cannot stop early), greedy and beam 4, 1 sentence a batch (latency) and 32
(throughput), fp32 and int8. aiayn decodes eagerly and compiled (its graphs in a store of this run's,
so a cell's first batch includes compiling them); CTranslate2 in a child process of its own with 1 and
with 2 threads, from one converted model (its compute type chosen at load); generate in fp32. Reports
sentences per second, the median of alternating rounds.

    python benchmarks/bench_opus.py [--sentences 128] [--reps 3] [--results docs/bench_opus_cpu.json]

The last line printed is JSON with every figure and ratio.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_translate import (  # noqa: E402
    NEW_TOKENS,
    InChildProcess,
    measure_cell,
    print_rows,
    ratios,
    versions,
)
from common import NoEos, machine, pad, random_sentences, save_results, set_threads, steal_ticks  # noqa: E402

from aiayn.checkpoint import load_model  # noqa: E402
from aiayn.config import SearchConfig  # noqa: E402
from aiayn.inference.compiled import CompiledDecoder  # noqa: E402
from aiayn.inference.search import search  # noqa: E402
from aiayn.interop.huggingface import import_transformers  # noqa: E402
from aiayn.precision import for_inference  # noqa: E402
from aiayn.tokenizer import EOS_ID  # noqa: E402

VOCAB = 58_101  # opus-mt-en-de's
SHAPE = dict(d_model=512, encoder_layers=6, decoder_layers=6, heads=8, ffn=2048)
PEERS = ("ctranslate2", "transformers")  # the systems that take the model's own ids
MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"


def opus_mt_directory(directory: Path) -> Path:
    """The OPUS-MT-shaped directory: SentencePiece models of 6,000 pieces each side (trained on Multi30k
    where it is there, else on the model's own filler words), vocab.json in OPUS-MT's order filled up to
    58,101 with pieces no text produces, a random MarianMTModel saved with save_pretrained, and
    MarianTokenizer's files."""
    import io

    import sentencepiece as spm
    import transformers

    directory.mkdir(parents=True)
    models = []
    for lang in ("en", "de"):
        path = MULTI30K / f"train.{lang}.gz"
        if path.is_file():
            import gzip

            with gzip.open(path, "rt", encoding="utf-8") as f:
                texts = [line.strip() for line in f]
        else:
            texts = [" ".join(f"w{(i * 7 + j) % 5000}" for j in range(12)) for i in range(20000)]
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=6000,
                                       model_type="unigram", minloglevel=2)  # fmt: skip
        models.append(model.getvalue())
    (directory / "source.spm").write_bytes(models[0])
    (directory / "target.spm").write_bytes(models[1])
    pieces: list[str] = []
    for model in models:
        sp = spm.SentencePieceProcessor(model_proto=model)
        pieces += [
            sp.id_to_piece(i)
            for i in range(sp.get_piece_size())
            if not (sp.is_control(i) or sp.is_unknown(i))
        ]
    pieces = list(dict.fromkeys(pieces))
    pieces += [f"▁filler{i}" for i in range(VOCAB - 3 - len(pieces))]
    vocab = {p: i for i, p in enumerate(["</s>", "<unk>", *pieces, "<pad>"])}
    assert len(vocab) == VOCAB
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=VOCAB, decoder_vocab_size=VOCAB, d_model=SHAPE["d_model"], encoder_layers=SHAPE["encoder_layers"],
        decoder_layers=SHAPE["decoder_layers"], encoder_attention_heads=SHAPE["heads"],
        decoder_attention_heads=SHAPE["heads"], encoder_ffn_dim=SHAPE["ffn"], decoder_ffn_dim=SHAPE["ffn"],
        activation_function="swish", max_position_embeddings=512, pad_token_id=VOCAB - 1,
        decoder_start_token_id=VOCAB - 1, eos_token_id=0, scale_embedding=True, dropout=0.1,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )  # fmt: skip
    hf = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        hf.final_logits_bias.normal_(0.0, 1.0)
    hf.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[VOCAB - 1]], bos_token_id=0, decoder_start_token_id=VOCAB - 1, eos_token_id=0,
        forced_eos_token_id=0, max_length=512, num_beams=4, pad_token_id=VOCAB - 1,
    )  # fmt: skip
    hf.save_pretrained(directory)
    transformers.MarianTokenizer(
        str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json")
    ).save_pretrained(directory)
    return directory


def aiayn_translator(model_dir: Path, dtype: str, store: Path | None):
    model = for_inference(load_model(model_dir), dtype)  # as Translator.load prepares it
    if store is not None:
        model = CompiledDecoder(model, store=store)
    model = NoEos(model, eos=EOS_ID)

    def run(batch: list[list[int]], beam: int) -> None:
        with torch.inference_mode():
            search(model, pad(batch), SearchConfig(beam_size=beam), max_len=NEW_TOKENS)

    return run


def generate_translator(source: Path):
    import transformers

    model = transformers.MarianMTModel.from_pretrained(source).eval()
    pad_id = model.config.pad_token_id

    def run(batch: list[list[int]], beam: int) -> None:
        src = _pad(batch, pad_id)
        with torch.inference_mode():
            model.generate(input_ids=src, attention_mask=src != pad_id, num_beams=beam, do_sample=False,
                           min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS, early_stopping=False)  # fmt: skip

    return run


def _pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows])


def ctranslate2_translator(converted: Path, dtype: str, threads: int):
    import ctranslate2

    vocab = json.loads((converted / "shared_vocabulary.json").read_text(encoding="utf-8"))
    compute = {"fp32": "float32", "int8": "int8"}[dtype]
    translator = ctranslate2.Translator(
        str(converted), compute_type=compute, intra_threads=threads, inter_threads=1
    )

    def run(batch: list[list[int]], beam: int) -> None:
        translator.translate_batch([[vocab[i] for i in sentence] for sentence in batch], beam_size=beam,
                                   max_batch_size=len(batch), min_decoding_length=NEW_TOKENS,
                                   max_decoding_length=NEW_TOKENS, return_scores=False)  # fmt: skip

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=128, help="sentences for batch 32")
    ap.add_argument("--latency-sentences", type=int, default=16, help="sentences for batch 1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default="fp32,int8")
    ap.add_argument(
        "--no-compiled", action="store_true", help="leave out aiayn compiled (minutes of compiling)"
    )
    ap.add_argument("--results", help="write the JSON summary here (docs/bench_opus_cpu.json)")
    args = ap.parse_args()
    set_threads()
    started = time.perf_counter()
    print(f"machine: {machine()}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="aiayn-bench-opus-"))
    notes: list[str] = []
    results = []
    try:
        source = opus_mt_directory(workdir / "opus-mt")
        import_transformers(source, workdir / "aiayn")
        converted = workdir / "ct2"
        subprocess.run([str(Path(sys.executable).parent / "ct2-transformers-converter"), "--model", str(source),
                        "--output_dir", str(converted)], check=True, capture_output=True)  # fmt: skip
        print(f"[{time.perf_counter() - started:4.0f} s] imported and converted", flush=True)
        vocab = json.loads((source / "vocab.json").read_text(encoding="utf-8"))
        ours = {j: i for i, j in enumerate(_order(workdir / "aiayn", vocab))}
        # the model's ids of ordinary pieces (not </s>, <unk>, <pad>), EOS appended
        marian = [
            [2 + i % (VOCAB - 3) for i in s[:-1]] + [0]
            for s in random_sentences(args.sentences, VOCAB, seed=4321)
        ]
        aiayn_ids = [[ours[j] for j in s] for s in marian]
        s0 = steal_ticks()
        for dtype in args.dtypes.split(","):
            runs = {"aiayn": aiayn_translator(workdir / "aiayn", dtype, None)}
            if not args.no_compiled:
                runs["aiayn compiled"] = aiayn_translator(workdir / "aiayn", dtype, workdir / "store")
            for threads in (1, 2):
                runs[f"ctranslate2 {threads}t"] = InChildProcess(
                    ctranslate2_translator, converted, dtype, threads
                )
            if dtype == "fp32":
                runs["transformers generate"] = generate_translator(source)
            for beam in (1, 4):
                name = "greedy" if beam == 1 else f"beam{beam}"
                for batch, n in ((1, args.latency_sentences), (32, args.sentences)):
                    where = f"opus-mt {dtype} {name} bs{batch}"
                    print(f"[{time.perf_counter() - started:4.0f} s] {where}", flush=True)
                    # each system is given the sentences in its own ids
                    both = list(zip(aiayn_ids, marian))[:n]
                    cell = {
                        system: _side(run, 1 if system.startswith(PEERS) else 0)
                        for system, run in runs.items()
                    }
                    rows = measure_cell(cell, both, batch, beam, torch.device("cpu"), args.reps, notes, where)
                    results += [{"config": "opus-mt", "dtype": dtype, "search": name, **row} for row in rows]
                    print_rows(results[len(results) - len(rows) :])
        steal = (steal_ticks() - s0) / 100
    except KeyboardInterrupt:
        notes.append(f"interrupted after {time.perf_counter() - started:.0f} s")
        steal = None
    summary = ratios(results)
    for line in summary["lines"]:
        print(line)
    report = {
        "benchmark": "opus-mt",
        "machine": machine(),
        "command": shlex.join(["python", *sys.argv]),
        "versions": versions(),
        "results": results,
        "ratios": summary["ratios"],
        "steal_s_total": steal,
        "wall_s": time.perf_counter() - started,
        "notes": sorted(set(notes)),
    }
    print(json.dumps(report))
    save_results(args.results, report)
    shutil.rmtree(workdir, ignore_errors=True)


def _order(model_dir: Path, vocab: dict[str, int]) -> list[int]:
    """The model's id of each aiayn id (aiayn's PAD, a row of its own, as the model's pad)."""
    record = json.loads((model_dir / "sentencepiece.json").read_text(encoding="utf-8"))
    named = {"<pad>": vocab["<pad>"], "<s>": vocab["<pad>"], "</s>": vocab["</s>"], "<unk>": vocab["<unk>"]}
    return [named.get(p, vocab.get(p)) for p in record["pieces"]]


def _side(run, side: int):
    """run on one side of (aiayn's ids, the model's ids) pairs."""
    return lambda pairs, beam: run([pair[side] for pair in pairs], beam)


if __name__ == "__main__":
    main()
