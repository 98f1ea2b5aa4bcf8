"""Training: label-smoothed loss (§5.4), the warmup schedule (§5.3) and the explicit training loop.

What the loop writes and where (checkpoints, the best model, metrics, the clock) is the run's (run.py).
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.checkpoint import TRAIN_CONFIG, Languages, averaged_model, checkpoint_path, load_model
from aiayn.config import ModelConfig, SearchConfig, TrainConfig, read_json
from aiayn.data.corpus import batch_plan, collate, filter_lengths, make_batches
from aiayn.data.prepare import Ids, Prepared, collate_ids
from aiayn.inference.evaluate import evaluate, score
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.precision import autocast, configure, cpu_class, default_device, training_dtype
from aiayn.tokenizer import PAD_ID
from aiayn.training.distributed import ONE, Ranks
from aiayn.training.run import Progress, Run

# --- §5.4 Label smoothing ---------------------------------------------------------------------------


def label_smoothed_loss(
    logits: Tensor, target: Tensor, epsilon: float, never: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed NLL (detached) over non-pad targets.

    logits (B, T, V), target (B, T); or logits (n, V) and target (n,) of the non-pad positions alone.
    The smoothed target spreads epsilon uniformly over all V classes,
    q = (1 - eps) * onehot + eps / V (the paper's eps_ls = 0.1; PyTorch's `label_smoothing` likewise), so
    -sum q log p = (1 - eps) * NLL + eps / V * sum_v -log p_v. One log-softmax serves both sums.
    never (V,): classes the model can never produce (never_produced), which add nothing to the sum, where
    their log-probability of -inf would make it infinite; None (every model aiayn trains) costs nothing.
    """
    V = logits.size(-1)
    lprobs = F.log_softmax(logits.reshape(-1, V).float(), dim=-1)  # (B*T, V)
    gold = target.reshape(-1)  # (B*T,)
    keep = gold != PAD_ID  # (B*T,)
    nll = -lprobs.gather(1, gold.unsqueeze(1)).squeeze(1)  # (B*T,)
    uniform = -(lprobs if never is None else lprobs.masked_fill(never, 0.0)).sum(dim=-1)  # (B*T,)
    loss = ((1 - epsilon) * nll + (epsilon / V) * uniform).masked_fill(~keep, 0.0).sum()
    return loss, nll.detach().masked_fill(~keep, 0.0).sum()


def never_produced(model: nn.Module) -> Tensor | None:
    """(V,) True at the classes a model can never produce, -inf in its output bias (an imported model's own
    PAD row: interop/huggingface.py); None for a model without an output bias."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    bias = model.generator.bias
    return None if bias is None else bias.detach().isneginf()


# --- §5.3 Optimizer and schedule --------------------------------------------------------------------


def budget_rate(progress: float, peak: float, warmup_fraction: float) -> float:
    """The budget schedule (a deviation, docs/deviations.md): linear warmup to `peak` over the first
    warmup_fraction of the budget, then linear to zero at its end. progress: the budget used, 0 to 1."""
    progress = min(max(progress, 0.0), 1.0)
    return peak * min(progress / warmup_fraction, (1.0 - progress) / (1.0 - warmup_fraction))


def budget_used(step: int, minutes: float, cfg: TrainConfig) -> float:
    """How much of the budget an update starting now uses up to its middle (updates), or has used
    (time); with both limits, whichever ends first."""
    used = 0.0
    if cfg.max_updates:
        used = (step - 0.5) / cfg.max_updates  # update `step`, counted from 1
    if cfg.max_minutes:
        used = max(used, minutes / cfg.max_minutes)
    return used


def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), step counted from 1."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def rate(step: int, minutes: float, d_model: int, cfg: TrainConfig) -> float:
    """The learning rate of update `step` (from 1): the paper's schedule, or the budget's, whose peak is
    the paper's (at step warmup_steps)."""
    paper = learning_rate(step, d_model, cfg.warmup_steps, cfg.lr_scale)
    if not cfg.budgeted:
        return paper
    peak = learning_rate(cfg.warmup_steps, d_model, cfg.warmup_steps, cfg.lr_scale)
    return budget_rate(budget_used(step, minutes, cfg), peak, cfg.warmup_fraction)


def make_optimizer(model: Transformer, config: TrainConfig) -> torch.optim.Optimizer:
    """Adam(beta1 0.9, beta2 0.98, eps 1e-9); the learning rate is set before every update. On CUDA the
    fused kernel: one launch for all parameters."""
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.Adam(
        model.parameters(),
        lr=0.0,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        fused=fused,
    )


def grad_scaler(config: TrainConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 (an option on CUDA) keeps small gradients representable by scaling the loss; bf16 needs none."""
    return torch.amp.GradScaler(device.type) if config.dtype == "fp16" else None


# --- The training loop ------------------------------------------------------------------------------

# TrainConfig fields that decide which pairs make which update: a resumed run must keep them (and the
# micro-batches per update, ranks x accumulate).
DATA_ORDER = ("max_tokens", "max_len", "seed")


def train(
    run: Run,
    model_config: ModelConfig,
    cfg: TrainConfig,
    data: Prepared,
    device: torch.device | None = None,
    settings: dict[str, Any] | None = None,
    ranks: Ranks = ONE,
    init: Mapping[str, Tensor] | None = None,
    languages: Languages | None = None,
) -> Result:
    """Train on a prepared corpus into run.out until a limit, patience or a signal stops it (the Result).

    Every stop but a crash ends validated, with OUT holding the best model by validation BLEU (the
    latest without validation data); a signal saves a checkpoint and says which weights OUT holds.
    settings: what else a resume must share (run.py); ranks: torchrun's processes, `accumulate` micro-batches
    on each an update; init: weights to start from (starting_model); languages: what it translates."""
    device = device or default_device()
    configure(device)
    cfg = number_format(run, cfg, model_config, device)
    with run.checking():  # before anything is written
        pairs, scaler = TrainingPairs.of(data, cfg.max_len), grad_scaler(cfg, device)
        check_positions(model_config, cfg, data)
    model = starting_model(model_config, cfg.seed, init).to(device)
    optimizer = make_optimizer(model, cfg)
    state = run.begin(
        run_settings(model_config, cfg, data, settings, ranks), model, optimizer, data, cfg, scaler, languages
    )
    sizes = {"pairs": len(pairs.keep), "too_long": pairs.too_long, "params": model.num_parameters()}
    run.log.record({"event": "data", **sizes}, echo=True)
    validation, ddp = Validation(data, device), ranks.wrap(model.train())
    with run:  # a run that fails before its first checkpoint leaves OUT as it found it
        with stop_signals() as signals:
            stop = agree(ranks, stop_reason(state, cfg, run, signals), device)  # a resumed run may be done
            for group in update_groups(pairs.lengths, cfg, state, ranks.world) if stop is None else ():
                if group is None:  # an epoch ended: validate, unless valid_every says when
                    if not cfg.valid_every:
                        stop = validate_and_save(run, validation, model, optimizer, state)
                else:
                    lr = rate(state.step + 1, run.log.minutes(), model_config.d_model, cfg)
                    with out_of_memory_is_a_batch_size_error(cfg, state.step + 1):
                        batches, seeds, dummy = pairs.share(
                            group, ranks, cfg.seed, state.step + 1, device, state.epoch
                        )
                        step = Step(lr, seeds, dummy, ranks, scaler)
                        loss, n_tokens = train_step(ddp, optimizer, batches, lr, cfg, step=step)
                    if not math.isfinite(loss):
                        skip_nonfinite(run, cfg, state, loss)
                        continue
                    state.step += 1  # the schedule steps once per update, never per micro-batch
                    run.log.update(state, loss / n_tokens, lr, n_tokens)
                    snapshot_for_averaging(run, model, optimizer, state)
                    if cfg.valid_every and state.step % cfg.valid_every == 0:
                        stop = validate_and_save(run, validation, model, optimizer, state)
                if stop := agree(ranks, stop or stop_reason(state, cfg, run, signals), device):
                    break
            stop = stop or Stop("max_epochs")
        if stop.signal is not None:  # a second Ctrl-C from here on stops at once
            if not run.replacing:  # (else the run it replaces comes back instead, as it was)
                save_on_signal(run, model, optimizer, state)
        elif state.validated_step != state.step:  # every other stop ends on a validated model
            validate_and_save(run, validation, model, optimizer, state, scheduled=False)
    final = final_validation(run, validation, state, device) if stop.signal is None else None
    ranks.max([0], device)  # the other ranks wait for rank 0's final validation before they leave
    return finish(run, state, stop, final)


def number_format(run: Run, cfg: TrainConfig, model_config: ModelConfig, device: torch.device) -> TrainConfig:
    """cfg with its dtype resolved, said on the console (train.json then records the format the run trains
    in): "auto" continues a resumed run in the format it trained in, and starts a new one in the format
    precision.training_dtype measured faster for the model's width on this device."""
    dtype, why = cfg.dtype, "asked for"
    if dtype == "auto" and run.resuming:
        dtype = read_json(run.last_checkpoint() / TRAIN_CONFIG).get("dtype", "auto")
        why = f"auto: the format {run.last_checkpoint().name} trained in"
    if dtype == "auto":
        dtype = training_dtype("auto", device, model_config.d_model)
        where = "CUDA" if device.type == "cuda" else f"CPU class {cpu_class()}"
        why = f"auto: {where}, d_model {model_config.d_model}; --set dtype=... to choose"
    run.log.say(f"number format: {dtype} ({why})")
    return replace(cfg, dtype=dtype)


def starting_model(config: ModelConfig, seed: int, init: Mapping[str, Tensor] | None = None) -> Transformer:
    """The model a new run starts from: random weights (seeded: §5.3's run is reproducible), or init's (a
    model to fine-tune, `aiayn train --init`), loaded over them. A resume then takes its checkpoint's."""
    torch.manual_seed(seed)
    model = Transformer(config)
    if init is not None:
        model.load_state_dict(init)
    return model


@dataclass(frozen=True)
class Stop:
    """Why training stopped."""

    reason: Literal["max_epochs", "max_updates", "max_minutes", "patience", "signal"]
    signal: str | None = None  # "SIGINT" or "SIGTERM" when reason == "signal"


@dataclass(frozen=True)
class Final:
    """The validation a run ends with, with the real search: the best single model by (greedy)
    validation BLEU, and the average of the last checkpoints of a run with a budget; OUT keeps the better."""

    search: SearchConfig
    signature: str  # sacreBLEU's, of both scores
    single_bleu: float  # the best single model, with `search`
    average_steps: tuple[int, ...] = ()  # the updates of the averaged checkpoints; () = no average
    average_bleu: float | None = None

    @property
    def kept(self) -> Literal["single", "average"]:
        better = self.average_bleu is not None and self.average_bleu > self.single_bleu
        return "average" if better else "single"

    @property
    def bleu(self) -> float:
        return self.average_bleu if self.kept == "average" else self.single_bleu

    def record(self) -> dict[str, Any]:
        search = {"beam_size": self.search.beam_size, "alpha": self.search.alpha,
                  "length_penalty": self.search.length_penalty}  # fmt: skip
        average = (
            {"steps": list(self.average_steps), "bleu": self.average_bleu} if self.average_steps else None
        )
        return {"event": "final", "search": search, "signature": self.signature, "single_bleu": self.single_bleu,
                "average": average, "kept": self.kept}  # fmt: skip


@dataclass(frozen=True)
class Result:
    stop: Stop
    step: int  # updates done
    best_bleu: float  # -1 without validation data
    model_step: int  # the update whose weights OUT holds as its model
    model_validated: bool  # False: a signal stopped the run before its first validation
    checkpoint: Path | None  # the last checkpoint, to resume from (None on ranks other than 0)
    final: Final | None = None  # the end-of-run validation with the real search (rank 0, validation data)
    restored: bool = False  # stopped before its first model: OUT holds the run it replaced, as it was

    def record(self) -> dict[str, Any]:
        reason = self.stop.reason if self.stop.signal is None else f"signal {self.stop.signal}"
        return {"event": "stop", "reason": reason, "step": self.step, "best_bleu": self.best_bleu}


def finish(run: Run, state: Progress, stop: Stop, final: Final | None = None) -> Result:
    validated = state.best_step <= state.validated_step
    if run.restored:  # OUT is the replaced run again: nothing of this one is written there
        return Result(stop, state.step, state.best_bleu, -1, False, None, None, restored=True)
    last = run.last_checkpoint() if run.main else None
    result = Result(stop, state.step, state.best_bleu, state.best_step, validated, last, final)
    run.log.record(result.record())
    return result


# --- §6.1 averaging and the final validation -------------------------------------------------------


def snapshot_for_averaging(
    run: Run, model: Transformer, optimizer: torch.optim.Optimizer, state: Progress
) -> None:
    """In a run with a budget (whatever its schedule), a checkpoint at each of average_last - 1 points
    spaced evenly over the last average_fraction of the budget (the last of the N is the one it ends with)."""
    cfg, n = run.train_config, run.train_config.averaged
    if n < 2:  # no budget, or no averaging: nothing to do at any update
        return
    used = budget_used(state.step + 0.5, run.log.minutes(), cfg)  # the budget used once this update is done
    if used < 1.0 - cfg.average_fraction:
        state.averaging.clear()  # (taken for a shorter budget, before a resume with a longer one)
        return
    if (
        len(state.averaging) < n - 1
        and used >= 1.0 - cfg.average_fraction * (n - 1 - len(state.averaging)) / n
    ):
        state.averaging.append(state.step)
        run.save_checkpoint(model, optimizer, state)


def final_validation(run: Run, validation: Validation, state: Progress, device: torch.device) -> Final | None:
    """Validate OUT's model with the search it is trained for (TrainConfig.search, which OUT's
    search.json keeps and translate uses: §6.1's beam 4, alpha 0.6 unless a recipe or --set says other)
    and, in a run with a budget, the average of its last checkpoints; OUT keeps the average only if it
    scores higher."""
    if not run.main or not validation.data.valid_src:
        return None
    cfg = run.train_config
    search = cfg.search
    single = validation.score(best_model(run, state, search, device))
    # its own snapshots and the checkpoint it ended with; not the validations' checkpoints in between
    steps = sorted({*state.averaging, state.step}) if state.averaging else []
    chosen = [checkpoint_path(run.out, step) for step in steps]
    final = Final(search, single["bleu_signature"], single["bleu"])
    if len(chosen) >= 2:
        model = averaged_model(chosen)
        average = Translator(model.to(device), run.tokenizer, search)
        average_bleu = validation.score(average)["bleu"]
        final = Final(search, single["bleu_signature"], single["bleu"], tuple(steps), average_bleu)
        if final.kept == "average":
            run.save_model(model)
    run.log.record(final.record())
    average = (
        f", the average of updates {list(final.average_steps)} {final.average_bleu:.2f}" if chosen[1:] else ""
    )
    run.log.say(f"final validation, {search.describe()}: best single model {final.single_bleu:.2f}{average}; "
            f"OUT holds the {final.kept}")  # fmt: skip
    return final


def best_model(run: Run, state: Progress, search: SearchConfig, device: torch.device) -> Translator:
    """OUT's model. Removed or damaged while the run went on (a file replaced under it), it is written
    again from the checkpoint of its update, which is never pruned, so the run still ends whole."""
    try:
        return Translator.load(run.out, search, device=device)
    except ValueError as e:
        source = checkpoint_path(run.out, state.best_step)
        if not source.is_dir():
            raise ValueError(
                f"{e}: OUT's model was removed or damaged while the run went on, and so was {source}, "
                "which held it: start again with --force"
            ) from None
        print(f"aiayn: {e}: OUT's model is written again from {source}", file=sys.stderr)
        run.save_model(load_model(source))
        return Translator.load(run.out, search, device=device)


REASONS = ("max_epochs", "max_updates", "max_minutes", "patience")


def agree(ranks: Ranks, stop: Stop | None, device: torch.device) -> Stop | None:
    """What stops one rank stops all, at the same update: one small all-reduce of flags."""
    if ranks.world == 1:
        return stop
    flags = [0] * (len(REASONS) + 1)
    if stop is not None and stop.signal is not None:
        flags[0] = signal.Signals[stop.signal].value
    elif stop is not None:
        flags[1 + REASONS.index(stop.reason)] = 1
    flags = ranks.max(flags, device)
    if flags[0]:
        return Stop("signal", signal.Signals(flags[0]).name)
    return next((Stop(reason) for reason, flag in zip(REASONS, flags[1:]) if flag), None)


def run_settings(
    model_config: ModelConfig, cfg: TrainConfig, data: Prepared, extra: dict[str, Any] | None, ranks: Ranks
) -> dict[str, Any]:
    """What a resume must share with the run it continues: model, data, languages (and `extra`)."""
    model = {f"model.{k}": v for k, v in asdict(model_config).items()}
    order = {f"train.{k}": getattr(cfg, k) for k in DATA_ORDER}
    order["train.micro_batches_per_update"] = ranks.world * cfg.accumulate
    return {**data.fingerprint(), **model, **order, **(extra or {})}


@dataclass
class TrainingPairs:
    """The prepared training pairs with at most max_len tokens on both sides (in every segmentation)."""

    sides: list[tuple[Ids, Ids]]  # (src, tgt) ids: the prepared ones, or the BPE-dropout views in turn
    keep: np.ndarray  # (P,) indices of those pairs in the prepared corpus
    too_long: int

    @classmethod
    def of(cls, data: Prepared, max_len: int) -> TrainingPairs:
        sides = data.views or [(data.src, data.tgt)]
        fits = np.logical_and.reduce([(s.lengths <= max_len) & (t.lengths <= max_len) for s, t in sides])
        keep = np.flatnonzero(fits).astype(np.int32 if len(fits) < 2**31 else np.int64)
        if not len(keep):
            raise ValueError(f"no training pair has at most max_len={max_len} tokens on both sides")
        return cls(sides, keep, len(fits) - len(keep))

    def lengths(self, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(P,) source and target tokens of each kept pair in the epoch's segmentation."""
        src, tgt = self.sides[epoch % len(self.sides)]
        return src.lengths[self.keep], tgt.lengths[self.keep]

    def share(
        self,
        group: list[list[int]],
        ranks: Ranks,
        seed: int,
        update: int,
        device: torch.device,
        epoch: int = 0,
    ) -> tuple[list[list[Tensor]], list[int], bool]:
        """This rank's micro-batches of the update's global group (ranks take turns: rank r has r, r+W,
        ...), on the device, and the dropout seed of each. A rank left without one (an epoch's tail)
        gets the first with dummy=True: it computes, and its loss counts zero."""
        mine = list(range(ranks.rank, len(group), ranks.world))
        dummy = not mine
        tensors = [self.tensors(group[j], device, epoch) for j in (mine or [0])]
        return tensors, [dropout_seed(seed, update, j) for j in (mine or [0])], dummy

    def tensors(self, batch: list[int], device: torch.device, epoch: int = 0) -> list[Tensor]:
        """[src (B, S), tgt_in (B, T), tgt_out (B, T)] of one micro-batch of the epoch, on the device."""
        tensors = collate_ids(*self.sides[epoch % len(self.sides)], self.keep[batch])
        if device.type == "cuda":  # page-locked: the copy runs while the GPU computes
            return [t.pin_memory().to(device, non_blocking=True) for t in tensors]
        return [t.to(device) for t in tensors]


def dropout_seed(seed: int, update: int, micro_batch: int) -> int:
    """The random state of one micro-batch (its dropout masks): the same on any number of ranks and
    after a resume, with no random state to carry."""
    return int(np.random.SeedSequence([seed, update, micro_batch]).generate_state(1, np.uint64)[0])


def update_groups(
    lengths: Callable[[int], tuple[np.ndarray, np.ndarray]], cfg: TrainConfig, state: Progress, world: int = 1
) -> Iterator[list[list[int]] | None]:
    """The micro-batches of each update (accumulate on each of `world` ranks) from where `state` stands,
    epoch after epoch up to max_epochs, and None at the end of each epoch; state.epoch and state.batch
    follow what has been given out. lengths(epoch): (src, tgt) tokens of the pairs in that epoch's
    segmentation. Every rank computes the same groups."""
    per_update = cfg.accumulate * world
    while not cfg.max_epochs or state.epoch < cfg.max_epochs:
        batches = batch_plan(*lengths(state.epoch), cfg.max_tokens, seed=cfg.seed, epoch=state.epoch)
        while state.batch < len(batches):
            group = batches[state.batch : state.batch + per_update]
            state.batch += len(group)
            yield group
        state.epoch, state.batch = state.epoch + 1, 0
        yield None


def stop_reason(state: Progress, cfg: TrainConfig, run: Run, signals: list[str]) -> Stop | None:
    """Whether to stop after the update just done: a signal, or a limit reached."""
    if signals:
        return Stop("signal", signals[0])
    if cfg.max_updates and state.step >= cfg.max_updates:
        return Stop("max_updates")
    if cfg.max_minutes and run.log.minutes() >= cfg.max_minutes:
        return Stop("max_minutes")
    return None


@contextlib.contextmanager
def stop_signals() -> Iterator[list[str]]:
    """Ctrl-C (SIGINT) and SIGTERM are noted, not raised: the update in progress finishes first."""
    caught: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        caught.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@dataclass(frozen=True)
class Step:
    """How one update runs besides its batches: on several ranks, with seeded dropout, fp16 scaling."""

    lr: float
    seeds: list[int] | None = None  # the dropout seed of each micro-batch; None: the RNG as it stands
    dummy: bool = False  # this rank has no micro-batch in this update: its one counts zero
    ranks: Ranks = ONE
    scaler: torch.amp.GradScaler | None = None  # fp16: the loss scaled so small gradients stay normal


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[list[Tensor]],
    lr: float,
    cfg: TrainConfig,
    step: Step | None = None,
) -> tuple[float, int]:
    """One update from k micro-batches [src (B, S), tgt_in (B, T), tgt_out (B, T)]; (summed loss, tokens)
    of the whole update, over all ranks.

    Gradient accumulation: every micro-batch's summed loss is divided by the target tokens of the
    whole update (all its micro-batches on all ranks, all-reduced before any backward), so k
    micro-batches on W ranks give exactly the gradient of one batch holding them all (DDP sums the
    ranks' gradients; it synchronises on the last micro-batch only). When the loss is not finite no
    step is taken and the gradients are dropped, on every rank alike.
    """
    step = step or Step(lr)
    device = micro_batches[0][0].device
    width = (model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model).config.d_model
    dtype = training_dtype(cfg.dtype, device, width)  # (train() resolves "auto" once, for train.json)
    local = 0 if step.dummy else sum(int((tgt_out != PAD_ID).sum()) for _, _, tgt_out in micro_batches)
    n_tokens = int(step.ranks.sum([local], device)[0])
    loss_total, never = torch.zeros(()), never_produced(model)
    for j, (src, tgt_in, tgt_out) in enumerate(micro_batches):
        if step.seeds is not None:
            torch.manual_seed(step.seeds[j])
        last = j == len(micro_batches) - 1
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        with model.no_sync() if ddp and not last else contextlib.nullcontext():
            with autocast(src.device, dtype):
                real = tgt_out != PAD_ID  # (B, T)
                logits = model(src, tgt_in, where=real)  # (n, V): no vocabulary work on padding
            loss, _ = label_smoothed_loss(logits, tgt_out[real], cfg.label_smoothing, never)
            scaled = (loss * 0.0 if step.dummy else loss) / n_tokens
            (step.scaler.scale(scaled) if step.scaler else scaled).backward()
        if not step.dummy:
            loss_total += loss.detach().cpu()
    (loss_sum,) = step.ranks.sum([loss_total.item()], device)
    if math.isfinite(loss_sum):
        for group in optimizer.param_groups:
            group["lr"] = lr
        if step.scaler is not None:
            step.scaler.unscale_(optimizer)  # clipping sees the true gradients
        if cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        if step.scaler is not None:
            step.scaler.step(optimizer)  # skipped where fp16 gradients overflowed; the scale then shrinks
            step.scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, n_tokens


@contextlib.contextmanager
def out_of_memory_is_a_batch_size_error(cfg: TrainConfig, update: int) -> Iterator[None]:
    """Running out of memory is a batch too large for this machine: say which flags to change."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        raise ValueError(
            f"update {update}: out of memory on a batch of up to {cfg.max_tokens} tokens; lower --max-tokens "
            f"(e.g. {cfg.max_tokens // 2}) and keep the batch size with --set accumulate={2 * cfg.accumulate}"
        ) from None


def is_out_of_memory(error: Exception) -> bool:
    """CUDA raises OutOfMemoryError; the CPU allocator raises a RuntimeError that says so."""
    text = str(error)
    return (
        isinstance(error, torch.OutOfMemoryError)
        or "can't allocate memory" in text
        or "out of memory" in text
    )


def skip_nonfinite(run: Run, cfg: TrainConfig, state: Progress, loss: float) -> None:
    """A non-finite loss stops training unless skip_nonfinite asks to skip such batches."""
    if not cfg.skip_nonfinite:
        raise ValueError(
            f"update {state.step + 1}: the loss is {loss} (not finite); the last good checkpoint is kept "
            f"in {run.out / 'checkpoints'}. Lower lr_scale, or use --set skip_nonfinite=true to skip such batches"
        )
    run.log.record({"event": "skip_nonfinite", "update": state.step + 1}, echo=True)


# --- Validation -------------------------------------------------------------------------------------


@dataclass
class Validation:
    """Validation loss, perplexity and BLEU (sacreBLEU, detokenized, 13a) of a model being trained."""

    data: Prepared
    device: torch.device

    def score(self, translator: Translator) -> dict[str, Any]:
        """evaluate.evaluate of a translator on the validation text: sacreBLEU (cased, detokenized, 13a)."""
        return evaluate(translator, self.data.valid_src, self.data.valid_tgt)

    @torch.no_grad()
    def __call__(self, model: Transformer, cfg: TrainConfig) -> dict[str, Any]:
        """{} without validation data. cfg: the run's (its length filter, batches, number format of the
        loss, label smoothing and valid_search). BLEU is of translations in translation's own default
        number format, as `aiayn translate` and `evaluate` make them."""
        tokenizer, src_text, tgt_text = self.data.tokenizer, self.data.valid_src, self.data.valid_tgt
        if not src_text:
            return {}
        model.eval()
        src_ids, tgt_ids = tokenizer.encode_src(src_text), tokenizer.encode_tgt(tgt_text)
        keep, _ = filter_lengths(src_ids, tgt_ids, cfg.max_len)
        src_ids, tgt_ids = [src_ids[i] for i in keep], [tgt_ids[i] for i in keep]
        loss_sum = nll_sum = tokens = 0.0
        lengths = [len(x) for x in src_ids], [len(x) for x in tgt_ids]
        with autocast(self.device, training_dtype(cfg.dtype, self.device, model.config.d_model)):
            for batch in make_batches(*lengths, cfg.max_tokens, seed=0, epoch=0):
                src, tgt_in, tgt_out = (t.to(self.device) for t in collate(src_ids, tgt_ids, batch))
                real = tgt_out != PAD_ID  # (B, T)
                logits = model(src, tgt_in, real)
                loss, nll = label_smoothed_loss(
                    logits, tgt_out[real], cfg.label_smoothing, never_produced(model)
                )
                loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
                tokens += real.sum().item()
        hyps = Translator(model, tokenizer, cfg.valid_search).translate(src_text)
        bleu = score(hyps, tgt_text)["bleu"]
        model.train()
        return {
            "valid_loss": loss_sum / max(tokens, 1),
            "valid_ppl": math.exp(min(nll_sum / max(tokens, 1), 50)),
            "valid_bleu": bleu,
            "examples": list(zip(src_text[:3], tgt_text[:3], hyps[:3])),
        }


def validate_and_save(
    run: Run,
    validation: Validation,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    state: Progress,
    scheduled: bool = True,
) -> Stop | None:
    """Validate, keep the best model in OUT, save a checkpoint; Stop when patience has run out.

    scheduled=False: the validation a run ends with when it stops between validations; it may give OUT a
    better model but does not count for patience, so a run stopped and resumed stops when one run would.
    """
    # the other ranks wait for rank 0 at the next update
    metrics = validation(model, run.train_config) if run.main else {}
    examples = metrics.pop("examples", [])
    run.log.record({"step": state.step, "epoch": state.epoch, "minutes": run.log.minutes(), **metrics})
    if metrics:
        run.log.say(
            f"step {state.step}  epoch {state.epoch}  valid loss {metrics['valid_loss']:.3f}  "
            f"ppl {metrics['valid_ppl']:.2f}  BLEU {metrics['valid_bleu']:.2f}"
        )
        for source, target, predicted in examples:
            run.log.say(f"  SOURCE    {source}\n  TARGET    {target}\n  PREDICTED {predicted}")
    state.validated_step = state.step
    if not metrics or metrics["valid_bleu"] > state.best_bleu:  # without validation data: the latest
        state.best_bleu = metrics.get("valid_bleu", state.best_bleu)
        state.bad_validations, state.best_step = 0, state.step
        run.save_model(model)
    elif scheduled:
        state.bad_validations += 1
    run.save_checkpoint(model, optimizer, state)
    if run.train_config.patience and state.bad_validations >= run.train_config.patience:
        return Stop("patience")
    return None


def save_on_signal(run: Run, model: Transformer, optimizer: torch.optim.Optimizer, state: Progress) -> None:
    """Stopped by a signal: a checkpoint of this update, and a model in OUT even before any validation."""
    if state.best_step < 0:  # no validation yet: OUT gets these weights rather than none
        run.save_model(model)
        state.best_step = state.step
    if state.validated_step != state.step or not checkpoint_path(run.out, state.step).is_dir():
        run.save_checkpoint(model, optimizer, state)  # (else it was saved a moment ago)


def check_positions(model_config: ModelConfig, cfg: TrainConfig, data: Prepared) -> None:
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
    lengths = [len(ids) for ids in data.tokenizer.encode_src(data.valid_src)]
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    if too_long:
        raise ValueError(
            f"validation line {too_long[0] + 1} has {lengths[too_long[0]]} tokens, more than "
            f"max_positions={limit} of the learned positions ({len(too_long)} such lines); "
            "drop them from the validation data or raise max_positions"
        )
