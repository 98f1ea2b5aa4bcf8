"""Fine-tuning on real data (`aiayn train --init`), opt-in (-m slow): minutes of CPU and the shared Multi30k,
skipped cleanly where it is absent."""

import json
from pathlib import Path

import pytest
import torch
from conftest import MULTI30K, opus_mt_directory, run_cli

QUICK = ["--src-lang", "de", "--tgt-lang", "en", "--valid", MULTI30K / "val", "--quiet",
         "--set", "dtype=fp32", "--set", "beam_size=1", "--set", "average_last=0"]  # fmt: skip


def valid_losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["valid_loss"] for r in records if "valid_loss" in r]


@pytest.mark.slow
def test_fine_tuning_a_multi30k_model_lowers_its_validation_loss_from_the_first_validation_on(tmp_path):
    """A low-resource model trained 300 updates on Multi30k de->en, then fine-tuned from its directory for
    150 more with a fresh schedule: every validation after the first is below the first, and the first
    is near where the model it starts from ended (not a random start's)."""
    if not (MULTI30K / "train.de.gz").is_file():
        pytest.skip(f"no Multi30k at {MULTI30K}")
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    code, _, err = run_cli(["train", "--train", MULTI30K / "train", "--out", base, "--preset", "low-resource",
                            "--max-updates", 300, "--set", "valid_every=300", *QUICK])  # fmt: skip
    assert code == 0, err
    code, _, err = run_cli(["train", "--train", MULTI30K / "train", "--out", tuned, "--init", base,
                            "--max-updates", 150, "--set", "valid_every=50", *QUICK])  # fmt: skip
    assert code == 0, err
    before, after = valid_losses(base), valid_losses(tuned)
    print(json.dumps({"base": before, "fine-tuned": after}))
    assert after[0] < before[-1] + 0.5, (before, after)
    assert all(loss < after[0] for loss in after[1:]), after


@pytest.mark.slow
def test_fine_tuning_an_imported_opus_mt_model_lowers_its_validation_loss(tmp_path):
    """An OPUS-MT-shaped transformers directory (SentencePiece vocabularies, swish, final_logits_bias)
    imported, then fine-tuned on Multi30k en->de with its own vocabulary: every validation after the first
    is below the first."""
    pytest.importorskip("sentencepiece")
    if not (MULTI30K / "train.de.gz").is_file():
        pytest.skip(f"no Multi30k at {MULTI30K}")
    source = opus_mt_directory(tmp_path / "hf", shared=True, activation="swish", dtype=torch.float32)
    assert run_cli(["import", source, "--out", tmp_path / "imported"])[0] == 0
    quick = ["--src-lang", "en", "--tgt-lang", "de", *QUICK[4:]]
    tuned = tmp_path / "tuned"
    code, _, err = run_cli(["train", "--train", MULTI30K / "train", "--out", tuned, "--init", tmp_path / "imported",
                            "--max-updates", 150, "--set", "valid_every=50", *quick])  # fmt: skip
    assert code == 0, err
    after = valid_losses(tuned)
    print(json.dumps({"imported, fine-tuned": after}))
    assert all(loss < after[0] for loss in after[1:]), after
