"""Pictures of training and of attention: loss/BLEU curves and attention heatmaps (matplotlib, PNG)."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure  # drawn to files, never to a screen: no pyplot, no backend to choose

from aiayn.files import atomic_write
from aiayn.inference.translate import Translator
from aiayn.tokenizer import BOS_ID


def plot_curves(metrics: str | Path, out: str | Path) -> Path:
    """Training loss against updates and validation BLEU against minutes, from metrics.jsonl."""
    records = read_metrics(Path(metrics))
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "valid_bleu" in r]
    fig = Figure(figsize=(11, 4))
    ax_loss, ax_bleu = fig.subplots(1, 2)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    if valid:
        ax_loss.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="validation")
        ax_loss.legend()
    ax_loss.set(xlabel="update", ylabel="label-smoothed loss per token", title="Loss")
    ax_loss.grid(alpha=0.3)
    ax_bleu.plot([r["minutes"] for r in valid], [r["valid_bleu"] for r in valid], "o-", color="C2")
    ax_bleu.set(xlabel="minutes of training", ylabel="sacreBLEU", title="Validation BLEU")
    ax_bleu.grid(alpha=0.3)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, Path(out), dpi=110)
    return Path(out)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a damaged line is a ValueError naming it, except a last line that
    a killed run left half written."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON record: {line[:80]!r}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object: {line[:80]!r}")
        records.append(record)
    return records


def save_figure(fig: Figure, path: Path, dpi: int) -> None:
    """A PNG written whole or not at all."""
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))


def plot_attention(translator: Translator, source: str, out_dir: str | Path, layer: int = -1) -> list[Path]:
    """Heatmaps of encoder self, decoder self and encoder-decoder attention for one sentence.

    The target side is the model's own greedy translation; one panel per head of `layer`.
    Returns the three PNG paths.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = translator.tokenizer
    src_ids = tok.encode_src([source])[0]
    hyp, maps = translator.attention(src_ids)
    tgt_in = [BOS_ID] + hyp
    src_labels, tgt_labels = tok.labels(src_ids, "src"), tok.labels(tgt_in, "tgt")
    panels = {
        "encoder": ("Encoder self-attention", src_labels, src_labels),
        "decoder": ("Decoder masked self-attention", tgt_labels, tgt_labels),
        "cross": ("Encoder-decoder attention", tgt_labels, src_labels),
    }
    paths = []
    for name, (title, rows, cols) in panels.items():
        weights = maps[name][layer][0].float().cpu()  # (H, L, M)
        H = weights.size(0)
        ncols = min(H, 2 if H == 4 else 4)
        nrows = (H + ncols - 1) // ncols
        width, height = min(12.0, 1.5 + 0.3 * len(cols)), min(12.0, 1.2 + 0.3 * len(rows))
        fig = Figure(figsize=(width * ncols, height * nrows + 0.6))
        axes = fig.subplots(nrows, ncols, squeeze=False)
        for h, ax in enumerate(axes.flat):
            if h >= H:
                ax.axis("off")
                continue
            ax.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=8)
            ax.set_yticks(range(len(rows)), rows, fontsize=8)
            ax.set_title(f"head {h + 1}", fontsize=9)
        n_layers = len(maps[name])
        fig.suptitle(f"{title}, layer {layer % n_layers + 1} of {n_layers} (rows attend to columns)")
        fig.tight_layout()
        path = out_dir / f"attention_{name}.png"
        save_figure(fig, path, dpi=100)
        paths.append(path)
    return paths
