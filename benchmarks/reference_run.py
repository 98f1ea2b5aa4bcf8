"""Fingerprints of a fixed-seed `tiny` training run, to show a refactor kept behaviour bit for bit.

50 updates that validate and checkpoint at updates 25 and 50, then the validation set translated with
greedy and beam-4 search. Prints one JSON object: a digest of the tensors of OUT/model.safetensors and
of each checkpoint's weights (by name, so files written with other headers still compare), the bytes'
digest too, every metrics.jsonl record with its times removed, and digests of both translations. Run it
on two commits and diff the output:

    python benchmarks/reference_run.py > before.json; git checkout NEW; python benchmarks/reference_run.py > after.json

Data: the first 2,000 training and 200 validation pairs of Multi30k de-en when ../shared/data has them,
else the built-in synthetic task (the same check, other numbers).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
TIMES = {"minutes", "tokens_per_s", "checkpoint"}  # differ from run to run
# Parameter names from before the layer norms left their Residual wrappers: mapped to today's.
RENAMED = {
    "res_attn.norm.": "self_attn_norm.",
    "res_self.norm.": "self_attn_norm.",
    "res_cross.norm.": "cross_attn_norm.",
    "res_ff.norm.": "feed_forward_norm.",
}


def tensors_digest(path: Path) -> str:
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            new = name
            for old, renamed in RENAMED.items():
                new = new.replace(old, renamed)
            tensors[new] = f.get_tensor(name)
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes())
    return f"tensors {h.hexdigest()[:16]}, bytes {hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"


def write_data(work: Path) -> tuple[str, str]:
    """work/train.{src,tgt} and work/val.*; returns the two languages."""
    if (MULTI30K / "train.de.gz").is_file():
        for split, n in (("train", 2000), ("val", 200)):
            for lang in ("de", "en"):
                lines = gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8").read().split("\n")
                (work / f"{split}.{lang}").write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")
        return "de", "en"
    from aiayn.data.synthetic import SRC_LANG, TGT_LANG, generate

    print("Multi30k not found: using the synthetic task", file=sys.stderr)
    src, tgt = generate(2200, seed=1)
    for split, rows in (("train", slice(0, 2000)), ("val", slice(2000, 2200))):
        (work / f"{split}.{SRC_LANG}").write_text("\n".join(src[rows]) + "\n", encoding="utf-8")
        (work / f"{split}.{TGT_LANG}").write_text("\n".join(tgt[rows]) + "\n", encoding="utf-8")
    return SRC_LANG, TGT_LANG


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="aiayn-reference-"))
    src, tgt = write_data(work)
    aiayn = [sys.executable, "-m", "aiayn"]
    out = work / "run"
    train = [
        "train",
        "--train",
        work / "train",
        "--valid",
        work / "val",
        "--src-lang",
        src,
        "--tgt-lang",
        tgt,
    ]
    flags = [
        "--out",
        out,
        "--preset",
        "tiny",
        "--vocab-size",
        2000,
        "--max-updates",
        50,
        "--max-tokens",
        1024,
    ]
    settings = ["--set", "valid_every=25", "--set", "warmup_steps=20", "--set", "dtype=fp32", "--quiet"]
    subprocess.run([*aiayn, *map(str, train + flags + settings)], check=True, stdout=subprocess.DEVNULL)
    result = {"model": tensors_digest(out / "model.safetensors")}
    for ckpt in sorted((out / "checkpoints").iterdir()):
        result[ckpt.name] = tensors_digest(ckpt / "model.safetensors")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result["metrics"] = [{k: v for k, v in r.items() if k not in TIMES} for r in records]
    for beam in (1, 4):
        command = ["translate", out, "--input", work / f"val.{src}", "--beam-size", beam, "--quiet"]
        command += ["--dtype", "fp32"]
        text = subprocess.run([*aiayn, *map(str, command)], check=True, capture_output=True).stdout
        result[f"translations_beam{beam}"] = hashlib.sha256(text).hexdigest()[:16]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
