"""The built-in job end to end (`aiayn demo`, what `make demo` runs), shrunk to seconds: it trains,
scores with sacreBLEU, draws its plots, and given more minutes it continues the same run."""

import functools
import json

from conftest import run_cli

from aiayn import checkpoint
from aiayn.data import synthetic


def test_the_demo_trains_scores_draws_and_continues(tmp_path, monkeypatch):
    # a smaller task: seconds of training validate a model that has learnt little, whose beam search runs
    # to the length limit on every validation sentence (500 of them, twice a run, were most of the test)
    monkeypatch.setattr(
        synthetic, "write_task", functools.partial(synthetic.write_task, n_train=4000, n_valid=40)
    )
    code, stdout, stderr = run_cli(["demo", "--out", tmp_path, "--minutes", 0.05])
    assert code == 0, stderr
    result = json.loads(stdout.splitlines()[-1])
    assert 0 <= result["valid_bleu"] <= 100 and "tok:13a" in result["signature"]
    assert [p.rsplit("/", 1)[-1] for p in result["plots"]] == [
        "curves.png", "attention_encoder.png", "attention_decoder.png", "attention_cross.png"
    ]  # fmt: skip
    assert all((tmp_path / p.rsplit("/", 1)[-1]).stat().st_size > 1000 for p in result["plots"])
    records = [json.loads(line) for line in (tmp_path / "model" / "metrics.jsonl").read_text().splitlines()]
    (final,) = [r for r in records if r.get("event") == "final"]  # the figure is the run's own, not a rerun
    kept = final["average"]["bleu"] if final["kept"] == "average" else final["single_bleu"]
    assert result["valid_bleu"] == kept and result["signature"] == final["signature"]
    # English -> the invented language, by its files' names, in the model and its checkpoints
    en_xx = checkpoint.Languages(("en",), ("xx",))
    saved = [tmp_path / "model", *checkpoint.list_checkpoints(tmp_path / "model")]
    assert all(checkpoint.ModelDir.read(path).languages == en_xx for path in saved)
    first_stop = [r for r in records if r.get("event") == "stop"][-1]["step"]
    assert first_stop > 0 and [r for r in records if "valid_bleu" in r][-1]["step"] == first_stop
    # more time than the run has used (its clock counts validation too, which a GPU's start-up can make
    # longer than the first budget): it goes on
    used = checkpoint.load_state(checkpoint.list_checkpoints(tmp_path / "model")[-1])["progress"]["minutes"]
    code, stdout, stderr = run_cli(["demo", "--out", tmp_path, "--minutes", used + 0.05])
    assert code == 0, stderr
    records = [json.loads(line) for line in (tmp_path / "model" / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records if r.get("event") in ("resume",)] == ["resume"]
    assert [r for r in records if r.get("event") == "stop"][-1]["step"] > first_stop
