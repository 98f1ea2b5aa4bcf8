"""Training: label-smoothed loss (§5.4), the warmup schedule (§5.3) and the explicit training loop."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import sacrebleu
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from aiayn import checkpoint
from aiayn.config import ModelConfig, SearchConfig, TrainConfig, load_json, save_json
from aiayn.data import collate, filter_lengths, make_batches
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer
from aiayn.translate import Translator, autocast, default_device

# --- §5.4 Label smoothing ---------------------------------------------------------------------------


def label_smoothed_loss(logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed NLL (detached) over non-pad targets.

    logits (B, T, V), target (B, T); or logits (n, V) and target (n,) of the non-pad positions alone.
    The smoothed target spreads epsilon uniformly over all V classes,
    q = (1 - eps) * onehot + eps / V (the paper's eps_ls = 0.1; PyTorch's `label_smoothing` likewise), so
    -sum q log p = (1 - eps) * NLL + eps / V * sum_v -log p_v. One log-softmax serves both sums.
    """
    V = logits.size(-1)
    lprobs = F.log_softmax(logits.reshape(-1, V).float(), dim=-1)  # (B*T, V)
    gold = target.reshape(-1)  # (B*T,)
    keep = gold != pad_id  # (B*T,)
    nll = -lprobs.gather(1, gold.unsqueeze(1)).squeeze(1)  # (B*T,)
    uniform = -lprobs.sum(dim=-1)  # (B*T,)
    loss = ((1 - epsilon) * nll + (epsilon / V) * uniform).masked_fill(~keep, 0.0).sum()
    return loss, nll.detach().masked_fill(~keep, 0.0).sum()


# --- §5.3 Optimizer and schedule --------------------------------------------------------------------


def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), step counted from 1."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def make_optimizer(model: Transformer, config: TrainConfig) -> torch.optim.Optimizer:
    """Adam(beta1 0.9, beta2 0.98, eps 1e-9); the learning rate is set before every update."""
    return torch.optim.Adam(
        model.parameters(), lr=0.0, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps
    )


# --- The training loop ------------------------------------------------------------------------------


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0  # updates done
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # next micro-batch of this epoch
    best_bleu: float = -1.0
    bad_validations: int = 0  # validations since the best BLEU
    minutes: float = 0.0  # training time before this process


@dataclass
class Corpus:
    """Tokenized training and validation text."""

    src_ids: list[list[int]]
    tgt_ids: list[list[int]]
    valid_src: list[str]
    valid_tgt: list[str]


class Stop(Exception):
    """Raised by the loop to end training; carries the reason."""


def rng_state() -> dict[str, Any]:
    """The random state training consumes (dropout); data order comes from (seed, epoch) alone."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def train_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[list[Tensor]],
    lr: float,
    cfg: TrainConfig,
) -> tuple[float, int]:
    """One update from k micro-batches [src (B, S), tgt_in (B, T), tgt_out (B, T)]; (summed loss, tokens).

    Gradient accumulation: every micro-batch's summed loss is divided by the target tokens of the
    whole update, so k micro-batches give exactly the gradient of one k-times-larger batch.
    When the loss is not finite no step is taken and the gradients are dropped.
    """
    pad = model.config.pad_id
    n_tokens = sum(int((tgt_out != pad).sum()) for _, _, tgt_out in micro_batches)
    loss_total = torch.zeros(())
    for src, tgt_in, tgt_out in micro_batches:
        with autocast(src.device, cfg.dtype):
            real = tgt_out != pad  # (B, T)
            logits = model(src, tgt_in, where=real)  # (n, V): no vocabulary work on padding
        loss, _ = label_smoothed_loss(logits, tgt_out[real], cfg.label_smoothing, pad)
        (loss / n_tokens).backward()
        loss_total += loss.detach().cpu()
    if torch.isfinite(loss_total):
        if cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_total.item(), n_tokens


def is_out_of_memory(error: Exception) -> bool:
    """CUDA raises OutOfMemoryError; the CPU allocator raises a RuntimeError that says so."""
    text = str(error)
    return (
        isinstance(error, torch.OutOfMemoryError)
        or "can't allocate memory" in text
        or "out of memory" in text
    )


def validate(
    model: Transformer,
    tokenizer: Tokenizer,
    corpus: Corpus,
    config: TrainConfig,
    device: torch.device,
) -> dict[str, Any]:
    """Validation loss, perplexity and BLEU (sacreBLEU, detokenized, 13a)."""
    model.eval()
    pad = model.config.pad_id
    src_ids, tgt_ids = tokenizer.encode_src(corpus.valid_src), tokenizer.encode_tgt(corpus.valid_tgt)
    keep, _ = filter_lengths(src_ids, tgt_ids, config.max_len)
    loss_sum = nll_sum = tokens = 0.0
    lens = [len(src_ids[i]) for i in keep], [len(tgt_ids[i]) for i in keep]
    with torch.no_grad(), autocast(device, config.dtype):
        for batch in make_batches(*lens, config.max_tokens, seed=0, epoch=0):
            src, tgt_in, tgt_out = (
                t.to(device)
                for t in collate(src_ids, tgt_ids, [keep[i] for i in batch], pad, model.config.bos_id)
            )
            real = tgt_out != pad  # (B, T)
            loss, nll = label_smoothed_loss(
                model(src, tgt_in, real), tgt_out[real], config.label_smoothing, pad
            )
            loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
            tokens += real.sum().item()
    translator = Translator(model, tokenizer, SearchConfig(beam_size=config.valid_beam_size), config.dtype)
    hyps = translator.translate(corpus.valid_src)
    bleu = sacrebleu.corpus_bleu(hyps, [corpus.valid_tgt])
    model.train()
    return {
        "valid_loss": loss_sum / max(tokens, 1),
        "valid_ppl": math.exp(min(nll_sum / max(tokens, 1), 50)),
        "valid_bleu": bleu.score,
        "examples": list(zip(corpus.valid_src[:3], corpus.valid_tgt[:3], hyps[:3])),
    }


def train(
    out: str | Path,
    model_config: ModelConfig,
    train_config: TrainConfig,
    tokenizer: Tokenizer,
    corpus: Corpus,
    resume: bool = False,
    device: torch.device | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train into OUT (a model directory plus checkpoints/); returns the final metrics.

    The model directory OUT always holds a loadable model: the best by validation BLEU so far.
    """
    check_positions(model_config, train_config, tokenizer, corpus)  # before anything is written
    out, device = Path(out), device or default_device()
    out.mkdir(parents=True, exist_ok=True)
    cfg = train_config
    torch.manual_seed(cfg.seed)
    model = Transformer(model_config).to(device)
    optimizer = make_optimizer(model, cfg)
    state = Progress()
    if resume and checkpoint.list_checkpoints(out):
        last = checkpoint.list_checkpoints(out)[-1]
        saved = checkpoint.load_state(last)
        checkpoint.load_weights(model, last / checkpoint.WEIGHTS)
        optimizer.load_state_dict(saved["optimizer"])
        state = Progress(**saved["progress"])
        set_rng_state(saved["rng"])
        log(out, {"event": "resume", "checkpoint": str(last), **asdict(state)}, progress)
    else:
        # Starting over in a directory that held a run (`--force`): its checkpoints would be pruned
        # together with this run's and a later --resume could pick one up, its metrics would mix with
        # these, and its config and tokenizer would not fit this model.
        if (out / checkpoint.CHECKPOINTS).exists():
            shutil.rmtree(out / checkpoint.CHECKPOINTS)
        (out / "metrics.jsonl").unlink(missing_ok=True)
        checkpoint.save_model(out, model, tokenizer)  # OUT is loadable from the start
    checkpoint.atomic_write(out / checkpoint.TRAIN_CONFIG, lambda p: save_json(cfg, p))

    keep, too_long = filter_lengths(corpus.src_ids, corpus.tgt_ids, cfg.max_len)
    if not keep:
        raise ValueError(f"no training pair has at most max_len={cfg.max_len} tokens on both sides")
    src_ids = [corpus.src_ids[i] for i in keep]
    tgt_ids = [corpus.tgt_ids[i] for i in keep]
    src_lens, tgt_lens = [len(x) for x in src_ids], [len(x) for x in tgt_ids]
    log(
        out,
        {"event": "data", "pairs": len(keep), "too_long": too_long, "params": model.num_parameters()},
        progress,
    )

    stop_signal: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        stop_signal.append(signal.Signals(signum).name)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    open_tensorboard(out)
    start = time.monotonic()
    model.train()
    bar = tqdm(
        desc="train",
        unit="upd",
        disable=not progress,
        dynamic_ncols=True,
        mininterval=1 if sys.stderr.isatty() else 30,
    )
    tokens_seen, tick = 0, time.monotonic()
    reason = "max_epochs"
    try:
        # A resumed run that is already done stops before taking one more update.
        if cfg.max_updates and state.step >= cfg.max_updates:
            raise Stop("max_updates")
        if cfg.max_minutes and state.minutes >= cfg.max_minutes:
            raise Stop("max_minutes")
        while not cfg.max_epochs or state.epoch < cfg.max_epochs:
            batches = make_batches(src_lens, tgt_lens, cfg.max_tokens, seed=cfg.seed, epoch=state.epoch)
            while state.batch < len(batches):
                group = batches[state.batch : state.batch + cfg.accumulate]
                state.batch += len(group)
                tensors = [
                    [
                        t.to(device)
                        for t in collate(src_ids, tgt_ids, b, model_config.pad_id, model_config.bos_id)
                    ]
                    for b in group
                ]
                lr = learning_rate(state.step + 1, model_config.d_model, cfg.warmup_steps, cfg.lr_scale)
                try:
                    loss_total, n_tokens = train_step(model, optimizer, tensors, lr, cfg)
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not is_out_of_memory(e):
                        raise
                    raise ValueError(
                        f"update {state.step + 1}: out of memory on a batch of up to {cfg.max_tokens} tokens; "
                        f"lower --max-tokens (e.g. {cfg.max_tokens // 2}) and keep the batch size with "
                        f"--set accumulate={2 * cfg.accumulate}"
                    ) from None
                if not math.isfinite(loss_total):
                    if cfg.skip_nonfinite:
                        log(out, {"event": "skip_nonfinite", "update": state.step + 1}, progress)
                        continue
                    raise ValueError(
                        f"update {state.step + 1}: the loss is {loss_total} (not finite); the last good "
                        f"checkpoint is kept in {out / checkpoint.CHECKPOINTS}. Lower lr_scale, or use "
                        "--set skip_nonfinite=true to skip such batches"
                    )
                state.step += 1  # the schedule steps once per update, never per micro-batch

                tokens_seen += n_tokens
                minutes = state.minutes + (time.monotonic() - start) / 60
                bar.update(1)
                if state.step % 10 == 0:
                    rate = tokens_seen / max(time.monotonic() - tick, 1e-9)
                    bar.set_postfix(
                        epoch=state.epoch + 1,
                        loss=f"{loss_total / n_tokens:.3f}",
                        lr=f"{lr:.2e}",
                        tok_s=f"{rate:.0f}",
                        refresh=False,
                    )
                    log_metrics(
                        out,
                        {
                            "step": state.step,
                            "epoch": state.epoch,
                            "loss": loss_total / n_tokens,
                            "lr": lr,
                            "tokens_per_s": rate,
                            "minutes": minutes,
                        },
                    )
                    tokens_seen, tick = 0, time.monotonic()

                if cfg.valid_every and state.step % cfg.valid_every == 0:
                    end_validation(out, model, tokenizer, corpus, cfg, device, state, optimizer, start, bar)
                if stop_signal:
                    raise Stop(f"signal {stop_signal[0]}")
                if cfg.max_updates and state.step >= cfg.max_updates:
                    raise Stop("max_updates")
                if cfg.max_minutes and minutes >= cfg.max_minutes:
                    raise Stop("max_minutes")
            state.epoch, state.batch = state.epoch + 1, 0
            if not cfg.valid_every:
                end_validation(out, model, tokenizer, corpus, cfg, device, state, optimizer, start, bar)
    except Stop as stop:
        reason = str(stop)
    finally:
        bar.close()
        close_tensorboard(out)
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
    last = checkpoint.list_checkpoints(out)
    if not last or not last[-1].name.endswith(f"{state.step:08d}"):
        save(out, model, tokenizer, cfg, state, optimizer, start)
    if not corpus.valid_src:  # nothing to choose the best by: OUT holds the latest weights
        checkpoint.save_weights(model, out / checkpoint.WEIGHTS)
    result = {"event": "stop", "reason": reason, "step": state.step, "best_bleu": state.best_bleu}
    log(out, result, progress)
    return result


def check_positions(
    model_config: ModelConfig, cfg: TrainConfig, tokenizer: Tokenizer, corpus: Corpus
) -> None:
    """Learned positions stop at max_positions (sinusoids extend, §3.5): refuse before training what would
    fail in the middle of it. Training pairs are filtered by max_len, so max_len must fit; validation
    sentences are translated whole, so each must fit."""
    if model_config.positions != "learned":
        return
    limit = model_config.max_positions
    if cfg.max_len > limit:
        raise ValueError(
            f"max_len={cfg.max_len} is more than max_positions={limit} of the learned positions; "
            f"use --set max_len={limit} (or a larger max_positions)"
        )
    lengths = [len(ids) for ids in tokenizer.encode_src(corpus.valid_src)]
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    if too_long:
        raise ValueError(
            f"validation line {too_long[0] + 1} has {lengths[too_long[0]]} tokens, more than "
            f"max_positions={limit} of the learned positions ({len(too_long)} such lines); "
            "drop them from the validation data or raise max_positions"
        )


def end_validation(
    out: Path,
    model: Transformer,
    tokenizer: Tokenizer,
    corpus: Corpus,
    cfg: TrainConfig,
    device: torch.device,
    state: Progress,
    optimizer: torch.optim.Optimizer,
    start: float,
    bar: tqdm,
) -> None:
    """Validate, save a checkpoint, keep the best model in OUT; raise Stop when patience runs out."""
    metrics = validate(model, tokenizer, corpus, cfg, device) if corpus.valid_src else {}
    examples = metrics.pop("examples", [])
    minutes = state.minutes + (time.monotonic() - start) / 60
    log_metrics(out, {"step": state.step, "epoch": state.epoch, "minutes": minutes, **metrics})
    if metrics:
        lines = [
            f"step {state.step}  epoch {state.epoch}  valid loss {metrics['valid_loss']:.3f}  "
            f"ppl {metrics['valid_ppl']:.2f}  BLEU {metrics['valid_bleu']:.2f}"
        ]
        for source, target, predicted in examples:
            lines += [f"  SOURCE    {source}", f"  TARGET    {target}", f"  PREDICTED {predicted}"]
        if not bar.disable:
            bar.write("\n".join(lines))
    improved = not metrics or metrics["valid_bleu"] > state.best_bleu
    if improved:
        state.best_bleu = metrics.get("valid_bleu", state.best_bleu)
        state.bad_validations = 0
        checkpoint.save_weights(model, out / checkpoint.WEIGHTS)  # OUT holds the best model
    else:
        state.bad_validations += 1
    save(out, model, tokenizer, cfg, state, optimizer, start)
    if cfg.patience and state.bad_validations >= cfg.patience:
        raise Stop(f"no better BLEU in {cfg.patience} validations")


def save(
    out: Path,
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: TrainConfig,
    state: Progress,
    optimizer: torch.optim.Optimizer,
    start: float,
) -> None:
    saved = replace(state, minutes=state.minutes + (time.monotonic() - start) / 60)
    payload = {"optimizer": optimizer.state_dict(), "progress": asdict(saved), "rng": rng_state()}
    checkpoint.save_checkpoint(out, state.step, model, tokenizer, cfg, payload)
    checkpoint.prune_checkpoints(out, cfg.keep_last)


_tensorboard: dict[Path, Any] = {}  # OUT -> SummaryWriter, open while train() runs


def log_metrics(out: Path, record: dict[str, Any]) -> None:
    """Append to OUT/metrics.jsonl; numbers also go to TensorBoard (OUT/tensorboard) when it is installed."""
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    writer = _tensorboard.get(out)
    if writer is not None and "step" in record:
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                writer.add_scalar(key, value, record["step"])


def open_tensorboard(out: Path) -> None:
    if importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter

        _tensorboard[out] = SummaryWriter(str(out / "tensorboard"))


def close_tensorboard(out: Path) -> None:
    writer = _tensorboard.pop(out, None)
    if writer is not None:
        writer.close()


def log(out: Path, record: dict[str, Any], progress: bool) -> None:
    log_metrics(out, record)
    if progress:
        tqdm.write(json.dumps(record))


def load_train_config(out: str | Path) -> TrainConfig:
    return load_json(TrainConfig, Path(out) / checkpoint.TRAIN_CONFIG)
