"""The built-in default job: generate the synthetic task, train on it, score, translate and plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from aiayn.config import TrainConfig, preset
from aiayn.data import synthetic
from aiayn.data.corpus import Corpus, read_parallel
from aiayn.data.prepare import MANIFEST, TokenizerOptions, open_prepared, prepare_corpus
from aiayn.inference.plots import plot_attention, plot_curves
from aiayn.inference.translate import Translator
from aiayn.training.run import Run, run_languages
from aiayn.training.train import train

EXAMPLES = (  # not in the generated training data
    "The small dogs see a red bird.",
    "That tall woman carried my old books behind the river yesterday.",
    "Some happy children found this green key.",
)


def run_demo(out: Path, minutes: float = 2.5) -> dict[str, Any]:
    """Train a small model on the synthetic task for `minutes` (it resumes a demo run in OUT, or
    continues it when given more minutes); returns BLEU and the plot paths."""
    if not minutes > 0:
        raise ValueError(f"the demo needs a time budget of more than 0 minutes, got {minutes}")
    run = Run.open(out / "model", mode="resume")
    data = out / "data"
    train_prefix, valid_prefix = synthetic.write_task(data)
    src, tgt = read_parallel(train_prefix, synthetic.SRC_LANG, synthetic.TGT_LANG)
    valid_src, valid_tgt = read_parallel(valid_prefix, synthetic.SRC_LANG, synthetic.TGT_LANG)
    corpus = Corpus(src, tgt, valid_src, valid_tgt, synthetic.SRC_LANG, synthetic.TGT_LANG)
    if run.resuming and (run.data_dir / MANIFEST).is_file():
        prepared = open_prepared(run.data_dir)
    else:  # a vocabulary large enough for every word to be one token
        tokenizer = run.saved_tokenizer() if run.resuming else None
        options = TokenizerOptions(vocab_size=2000)
        prepared = prepare_corpus(
            run.data_dir, corpus, tokenizer=tokenizer, options=options, say=lambda line: None
        )
    tokenizer = prepared.tokenizer
    # A smaller model than the `small` preset: it has to learn the task in a few CPU minutes.
    model_config = preset(
        "small",
        src_vocab_size=tokenizer.src_vocab_size,
        tgt_vocab_size=tokenizer.tgt_vocab_size,
        d_model=128,
        d_ff=512,
        n_encoder_layers=2,
        n_decoder_layers=2,
    )
    train_config = TrainConfig(
        max_minutes=minutes, max_tokens=1500, warmup_steps=200, lr_scale=0.5, valid_every=200
    )
    # en -> xx, as the task's files are named: English, and the invented language under a code that no
    # language of ISO 639-1 has
    result = train(run, model_config, train_config, prepared, languages=run_languages(prepared))
    if result.stop.signal is not None:  # Ctrl-C: the run is saved and resumable; no scoring and plots now
        return {"stopped": result.stop.signal, "resume": "run the same command again"}
    model_dir = run.out

    final = result.final  # the run's own last validation, with the search translate uses
    search = f"beam {final.search.beam_size}, alpha {final.search.alpha}"
    print(
        f"\nvalidation BLEU {final.bleu:.2f}  ({final.signature}; {search}; the {final.kept})",
        file=sys.stderr,
    )
    translator = Translator.load(model_dir)
    for source, target in zip(EXAMPLES, translator.translate(list(EXAMPLES))):
        print(f"  {source}\n    -> {target}", file=sys.stderr)
    plots = [plot_curves(model_dir / "metrics.jsonl", out / "curves.png")]
    plots += plot_attention(translator, EXAMPLES[1], out)
    print("plots: " + ", ".join(str(p) for p in plots), file=sys.stderr)
    return {
        "valid_bleu": final.bleu,
        "signature": final.signature,
        "plots": [str(p) for p in plots],
    }
