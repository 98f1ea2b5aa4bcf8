"""Tests for aiayn.training.train: label smoothing by hand, the §5.3 schedule from its formula, gradient
accumulation against one big batch, bit-identical resume, metrics and checkpoint pruning."""

import json
import math

import pytest
import sacrebleu
import torch
from conftest import run_train

from aiayn import checkpoint
from aiayn.config import SearchConfig, TrainConfig, preset
from aiayn.data.corpus import Corpus, collate, make_batches
from aiayn.data.synthetic import generate
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.tokenizer import PAD_ID, Tokenizer
from aiayn.training import train as train_module
from aiayn.training.run import Run
from aiayn.training.train import label_smoothed_loss, learning_rate, make_optimizer, rate

CPU = torch.device("cpu")

# --- §5.4 label smoothing ---------------------------------------------------------------------------


def hand_smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, eps: float, pad: int
) -> tuple[float, float]:
    """sum over non-pad positions of -q . log_softmax(logits), q = (1 - eps) onehot + eps / V; and the NLL."""
    V = logits.size(-1)
    loss = nll = 0.0
    for b in range(target.size(0)):
        for t in range(target.size(1)):
            gold = int(target[b, t])
            if gold == pad:
                continue
            logp = torch.log_softmax(logits[b, t].double(), dim=-1)
            q = torch.full((V,), eps / V, dtype=torch.float64)
            q[gold] += 1 - eps
            loss += float(-(q * logp).sum())
            nll += float(-logp[gold])
    return loss, nll


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_equals_hand_computation(eps):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3  # (B, T, V)
    target = torch.tensor(
        [[4, 7, 2, PAD_ID, PAD_ID], [5, 5, 9, 10, 2], [3, 2, PAD_ID, PAD_ID, PAD_ID]]
    )  # (B, T), padded at the end as collate makes it
    loss, nll = label_smoothed_loss(logits, target, eps)
    want_loss, want_nll = hand_smoothed_loss(logits, target, eps, PAD_ID)
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    assert nll.item() == pytest.approx(want_nll, rel=1e-5)
    if eps == 0.0:
        assert loss.item() == pytest.approx(nll.item(), rel=1e-6)


def test_label_smoothed_loss_ignores_padded_positions():
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 13, requires_grad=True)
    target = torch.tensor([[3, 8, 12, 2, PAD_ID, PAD_ID], [7, 2, PAD_ID, PAD_ID, PAD_ID, PAD_ID]])
    pad = target == PAD_ID
    loss, nll = label_smoothed_loss(logits, target, 0.1)
    loss.backward()
    # No gradient reaches a padded position: it does not take part in the loss at all.
    assert logits.grad[pad].abs().max() == 0
    assert logits.grad[~pad].abs().max() > 0

    changed = logits.detach().clone()
    changed[pad] = torch.randn(int(pad.sum()), 13) * 100 + 50  # arbitrary, huge values
    loss2, nll2 = label_smoothed_loss(changed, target, 0.1)
    assert torch.equal(loss2, loss.detach()) and torch.equal(nll2, nll)


def test_a_class_that_can_never_be_produced_takes_no_share_of_the_smoothing():
    """An imported model's PAD row has a logit of -inf (its output bias): the loss stays finite, equal to the
    hand computation with that class's -log p left out of the uniform sum, and no gradient reaches it."""
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 9) * 3
    logits[..., PAD_ID] = -math.inf
    logits.requires_grad_(True)
    target = torch.tensor([[4, 7, 2, PAD_ID], [5, 2, PAD_ID, PAD_ID]])
    never = torch.zeros(9, dtype=torch.bool)
    never[PAD_ID] = True  # what never_produced gives for such a model's output bias
    loss, nll = label_smoothed_loss(logits, target, 0.1, never)
    lprobs = logits.detach().log_softmax(-1)[target != PAD_ID]  # (n, V)
    gold = lprobs.gather(1, target[target != PAD_ID][:, None])[:, 0]
    want = (0.9 * -gold + 0.1 / 9 * -lprobs[:, 1:].sum(-1)).sum()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert nll.item() == pytest.approx(-gold.sum().item(), rel=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[..., PAD_ID] == 0).all()


def test_label_smoothed_loss_accepts_bf16_logits_and_sums_in_fp32():
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 9).bfloat16()
    target = torch.tensor([[1, 4, 2, PAD_ID], [5, 6, 7, 2]])
    loss, _ = label_smoothed_loss(logits, target, 0.1)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(hand_smoothed_loss(logits.float(), target, 0.1, PAD_ID)[0], rel=1e-5)


# --- §5.3 schedule and optimizer --------------------------------------------------------------------


@pytest.mark.parametrize("d_model,warmup", [(512, 4000), (64, 10), (1024, 8000)])
def test_learning_rate_is_the_papers_formula(d_model, warmup):
    for step in [1, 2, 7, warmup // 2, warmup - 1, warmup, warmup + 1, 3 * warmup, 100 * warmup]:
        want = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert learning_rate(step, d_model, warmup) == pytest.approx(want, rel=1e-12)
        assert learning_rate(step, d_model, warmup, scale=2.5) == pytest.approx(2.5 * want, rel=1e-12)


def test_learning_rate_rises_linearly_peaks_at_warmup_then_decays_as_inverse_sqrt():
    d_model, warmup = 512, 400
    rates = [learning_rate(step, d_model, warmup) for step in range(1, 4 * warmup + 1)]
    assert rates.index(max(rates)) + 1 == warmup
    assert max(rates) == pytest.approx(d_model**-0.5 * warmup**-0.5, rel=1e-12)
    assert learning_rate(10, d_model, warmup) == pytest.approx(10 * learning_rate(1, d_model, warmup))
    assert learning_rate(4 * warmup, d_model, warmup) == pytest.approx(0.5 * max(rates))
    assert learning_rate(0, d_model, warmup) > 0  # step 0 counts as step 1, never a zero or error


def test_without_a_budget_the_rate_is_the_papers():
    cfg = TrainConfig(warmup_steps=400, lr_scale=2.0, max_epochs=3)  # epochs are not a budget
    for step in (1, 10, 399, 400, 401, 5000):
        assert rate(step, 123.0, 256, cfg) == learning_rate(step, 256, 400, 2.0)
    paper = TrainConfig(max_updates=100, schedule="paper")
    assert rate(5, 0.0, 256, paper) == learning_rate(5, 256, 4000)


def test_the_budget_schedule_warms_up_then_reaches_zero_at_the_budgets_end():
    peak = 256**-0.5 * 400**-0.5  # the paper's rate at step warmup_steps
    cfg = TrainConfig(max_updates=200, warmup_steps=400)  # warmup_fraction 0.1: 20 updates
    rates = [rate(step, 0.0, 256, cfg) for step in range(1, 201)]
    for step, r in zip(range(1, 201), rates):
        used = (step - 0.5) / 200  # the middle of the update
        assert r == pytest.approx(peak * min(used / 0.1, (1 - used) / 0.9), rel=1e-12)
    assert max(rates) <= peak and rates.index(max(rates)) + 1 in (20, 21)
    assert rates[-1] == pytest.approx(peak * (0.5 / 200) / 0.9)  # half an update before zero
    assert rates[0] > 0  # the first update learns
    # a time budget: measured in minutes, whatever the updates
    timed = TrainConfig(max_minutes=30.0, warmup_steps=400)
    assert rate(7, 3.0, 256, timed) == pytest.approx(peak)  # 10% of 30 minutes: the peak
    assert rate(7, 16.5, 256, timed) == pytest.approx(peak * 0.5)  # halfway down
    assert rate(99999, 30.0, 256, timed) == 0.0 and rate(1, 45.0, 256, timed) == 0.0
    # both limits: whichever is nearer its end
    both = TrainConfig(max_minutes=30.0, max_updates=200, warmup_steps=400)
    assert rate(100, 27.0, 256, both) == pytest.approx(rate(1, 27.0, 256, timed))
    assert rate(190, 3.0, 256, both) == pytest.approx(rates[189])
    with pytest.raises(ValueError, match="schedule=budget needs a budget"):
        TrainConfig(schedule="budget")


def test_optimizer_is_adam_with_the_papers_hyperparameters():
    model = Transformer(preset("tiny", vocab_size=20, d_model=16, d_ff=32, n_heads=2))
    optimizer = make_optimizer(model, TrainConfig())
    assert isinstance(optimizer, torch.optim.Adam)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9  # §5.3
    assert sum(p.numel() for p in group["params"]) == model.num_parameters()


# --- Fixtures for training runs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def data():
    src, tgt = generate(64, seed=0)
    tokenizer = Tokenizer.train(src, tgt, vocab_size=300)
    corpus = Corpus(src[:60], tgt[:60], src[60:], tgt[60:])
    return tokenizer, corpus


def small_model(tokenizer: Tokenizer, dropout: float):
    return preset(
        "tiny",
        src_vocab_size=tokenizer.src_vocab_size,
        tgt_vocab_size=tokenizer.tgt_vocab_size,
        d_model=32,
        d_ff=64,
        dropout=dropout,
    )


def read_metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(directory) -> dict[str, torch.Tensor]:
    return checkpoint.load_model(directory).state_dict()


# --- Gradient accumulation ---------------------------------------------------------------------------


class RecordingSGD(torch.optim.SGD):
    """Plain SGD (scale-sensitive, unlike Adam's first step) that records each update's gradients and lr."""

    def __init__(self, model):
        super().__init__(model.parameters(), lr=0.0)
        self.model = model
        self.grads: list[list[torch.Tensor]] = []
        self.lrs: list[float] = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for p in self.model.parameters()])
        self.lrs.append(self.param_groups[0]["lr"])
        return super().step(closure)


def test_accumulated_update_equals_one_big_batch(data, tmp_path, monkeypatch):
    """k micro-batches in one update give the gradient of one batch holding all of them.

    Through train() itself, so the loop's grouping of micro-batches is covered too (with an SGD optimizer
    patched in so the update is proportional to the gradient); the test rebuilds each update as ONE batch made of
    the same pairs, computes loss / tokens on a model with the same initial weights, and compares.
    """
    tokenizer, corpus = data
    k, max_tokens, updates = 3, 120, 2
    model_config = small_model(tokenizer, dropout=0.0)
    cfg = TrainConfig(
        accumulate=k,
        max_tokens=max_tokens,
        max_updates=updates,
        dtype="fp32",
        warmup_steps=5,
        lr_scale=3.0,
        schedule="paper",
    )
    recorders: list[RecordingSGD] = []

    def make_recorder(model, _config):
        recorders.append(RecordingSGD(model))
        return recorders[-1]

    monkeypatch.setattr(train_module, "make_optimizer", make_recorder)
    run_train(
        tmp_path / "run",
        model_config,
        cfg,
        tokenizer,
        Corpus(corpus.train_src, corpus.train_tgt),
    )
    (recorder,) = recorders
    assert len(recorder.grads) == updates  # one optimizer step per update, not per micro-batch
    # §5.3: the schedule steps once per update
    assert recorder.lrs == [
        learning_rate(s, model_config.d_model, cfg.warmup_steps, cfg.lr_scale) for s in (1, 2)
    ]

    torch.manual_seed(cfg.seed)  # train() seeds, then builds the model: the same initial weights
    reference = Transformer(model_config)
    src_ids, tgt_ids = tokenizer.encode_src(corpus.train_src), tokenizer.encode_tgt(corpus.train_tgt)
    src_lens, tgt_lens = [len(x) for x in src_ids], [len(x) for x in tgt_ids]
    batches = make_batches(src_lens, tgt_lens, max_tokens, seed=cfg.seed, epoch=0)
    for update in range(updates):
        group = batches[update * k : (update + 1) * k]
        tokens = [sum(tgt_lens[i] for i in b) for b in group]
        assert len(set(tokens)) > 1  # unequal micro-batches: dividing per micro-batch would be caught
        src, tgt_in, tgt_out = collate(src_ids, tgt_ids, sum(group, []))
        reference.zero_grad()
        loss, _ = label_smoothed_loss(reference(src, tgt_in), tgt_out, cfg.label_smoothing)
        (loss / sum(tokens)).backward()
        for p, got in zip(reference.parameters(), recorder.grads[update]):
            torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-7)
        with torch.no_grad():  # SGD: p -= lr * grad, with the lr train() used
            for p in reference.parameters():
                p -= recorder.lrs[update] * p.grad
    for p, q in zip(reference.parameters(), recorder.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)


# --- Resume, metrics, pruning ------------------------------------------------------------------------

RESUME_CONFIG = dict(  # max_updates=12 makes a budget: its schedule, and averaging of 2 (at 11 and 12)
    max_tokens=200,
    dtype="fp32",
    warmup_steps=4,
    lr_scale=2.0,
    valid_every=4,
    keep_last=2,
    seed=3,
    average_last=2,
)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """12 updates in one go (several epochs), validating and checkpointing every 4; dropout on."""
    tokenizer, corpus = data
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run_train(
        out,
        small_model(tokenizer, dropout=0.1),
        TrainConfig(max_updates=12, **RESUME_CONFIG),
        tokenizer,
        corpus,
    )
    return out, result


def test_runs_several_epochs(data, uninterrupted):
    out, result = uninterrupted
    assert result.step == 12 and result.stop.reason == "max_updates"
    epochs = {r["epoch"] for r in read_metrics(out) if "epoch" in r}
    assert len(epochs) >= 2  # the resume tests below cross an epoch boundary


def interrupt_at(step: int):
    """stop_reason as if Ctrl-C came during update `step`: the budget (and so the schedule) unchanged."""
    real = train_module.stop_reason

    def stop_reason(state, cfg, run, signals):
        return train_module.Stop("signal", "SIGINT") if state.step == step else real(state, cfg, run, signals)

    return stop_reason


@pytest.mark.parametrize("stop_at", [8, 6])  # on a checkpoint (8) and between checkpoints (6)
def test_resume_reaches_the_same_weights_bit_for_bit(data, uninterrupted, tmp_path, stop_at, monkeypatch):
    """Under the budget schedule (max_updates=12 is a budget), interrupted by a signal and resumed."""
    tokenizer, corpus = data
    model_config = small_model(tokenizer, dropout=0.1)
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(train_module, "stop_reason", interrupt_at(stop_at))
        first = run_train(out, model_config, TrainConfig(max_updates=12, **RESUME_CONFIG), tokenizer, corpus)
    assert first.step == stop_at and first.stop.signal == "SIGINT"
    assert checkpoint.list_checkpoints(out)[-1].name == f"step_{stop_at:08d}"
    second = run_train(
        out,
        model_config,
        TrainConfig(max_updates=12, **RESUME_CONFIG),
        tokenizer,
        corpus,
        mode="resume",
    )
    assert second.step == 12
    assert any(r.get("event") == "resume" and r["step"] == stop_at for r in read_metrics(out))

    expected_dir, _ = uninterrupted
    want_last, got_last = (checkpoint.list_checkpoints(d)[-1] for d in (expected_dir, out))
    assert got_last.name == want_last.name == "step_00000012"
    want, got = weights(want_last), weights(got_last)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    want_state, got_state = checkpoint.load_state(want_last), checkpoint.load_state(got_last)
    for key in ("step", "epoch", "batch", "bad_validations"):
        assert got_state["progress"][key] == want_state["progress"][key], key
    # A run stopped between validations validated once more as it stopped: its best can only be better.
    want_best, got_best = want_state["progress"]["best_bleu"], got_state["progress"]["best_bleu"]
    assert got_best == want_best if stop_at % RESUME_CONFIG["valid_every"] == 0 else got_best >= want_best
    for i, slot in want_state["optimizer"]["state"].items():  # Adam moments too
        for name, value in slot.items():
            assert torch.equal(got_state["optimizer"]["state"][i][name], value), (i, name)
    assert torch.equal(got_state["rng"]["torch"], want_state["rng"]["torch"])


def test_fine_tuning_starts_from_the_models_weights_and_resumes_bit_for_bit(
    data, uninterrupted, tmp_path, monkeypatch
):
    """train(init=...) (`aiayn train --init`): the run starts from a trained model's weights, so its first
    validation loss is far below a random start's and falls from there; stopped by a signal and resumed
    (the resume takes its checkpoint's weights, not init's), it reaches the uninterrupted run's weights."""
    tokenizer, corpus = data
    init = weights(uninterrupted[0])  # 12 updates of this task
    model_config = small_model(tokenizer, dropout=0.1)
    config = TrainConfig(max_updates=8, **RESUME_CONFIG)
    whole = run_train(tmp_path / "whole", model_config, config, tokenizer, corpus, init=init)
    run_train(tmp_path / "scratch", model_config, config, tokenizer, corpus)
    losses = {run: [r["valid_loss"] for r in read_metrics(tmp_path / run) if "valid_loss" in r]
              for run in ("whole", "scratch")}  # fmt: skip
    assert losses["whole"][0] < losses["scratch"][0] - 0.5, losses  # validations at 4 and 8
    assert losses["whole"][-1] <= losses["whole"][0], losses
    with monkeypatch.context() as patch:
        patch.setattr(train_module, "stop_reason", interrupt_at(6))
        first = run_train(tmp_path / "run", model_config, config, tokenizer, corpus, init=init)
    assert first.step == 6 and first.stop.signal == "SIGINT"
    second = run_train(tmp_path / "run", model_config, config, tokenizer, corpus, mode="resume", init=init)
    assert second.step == whole.step == 8
    want, got = (weights(checkpoint.list_checkpoints(tmp_path / d)[-1]) for d in ("whole", "run"))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_resume_needs_no_random_state_because_each_micro_batch_seeds_its_dropout(
    data, uninterrupted, tmp_path, monkeypatch
):
    """The resume test has teeth: with dropout on, a micro-batch that did not seed its own dropout would
    draw where the RNG happened to stand, and the resumed run would end elsewhere."""
    tokenizer, corpus = data
    model_config = small_model(tokenizer, dropout=0.1)
    out = tmp_path / "run"
    run_train(out, model_config, TrainConfig(max_updates=8, **RESUME_CONFIG), tokenizer, corpus)
    torch.manual_seed(12345)  # the random state a new process would start from
    monkeypatch.setattr(train_module, "dropout_seed", lambda seed, update, micro: None)
    real_manual_seed = torch.manual_seed
    monkeypatch.setattr(torch, "manual_seed", lambda s: s is None or real_manual_seed(s))
    run_train(
        out, model_config, TrainConfig(max_updates=12, **RESUME_CONFIG), tokenizer, corpus, mode="resume"
    )
    want = weights(checkpoint.list_checkpoints(uninterrupted[0])[-1])
    got = weights(checkpoint.list_checkpoints(out)[-1])
    assert any(not torch.equal(got[name], want[name]) for name in want)


def test_dropout_seeds_differ_by_update_and_micro_batch_and_repeat():
    seeds = {train_module.dropout_seed(1, u, j) for u in range(1, 50) for j in range(4)}
    assert len(seeds) == 49 * 4
    assert (
        train_module.dropout_seed(1, 7, 2)
        == train_module.dropout_seed(1, 7, 2)
        != train_module.dropout_seed(2, 7, 2)
    )


def test_resuming_a_finished_run_takes_no_extra_update(data, uninterrupted, tmp_path):
    tokenizer, corpus = data
    out = tmp_path / "run"
    cfg = TrainConfig(max_updates=4, **RESUME_CONFIG)
    model_config = small_model(tokenizer, dropout=0.1)
    run_train(out, model_config, cfg, tokenizer, corpus)
    before = weights(checkpoint.list_checkpoints(out)[-1])
    result = run_train(out, model_config, cfg, tokenizer, corpus, mode="resume")
    assert result.step == 4
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_00000004"]
    after = weights(checkpoint.list_checkpoints(out)[-1])
    assert all(torch.equal(after[name], before[name]) for name in before)
    # The same for a time budget already spent.
    timed = TrainConfig(max_minutes=1e-9, **RESUME_CONFIG)
    result = run_train(out, model_config, timed, tokenizer, corpus, mode="resume")
    assert (result.step, result.stop.reason) == (4, "max_minutes")
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_00000004"]


def test_metrics_jsonl_has_loss_and_validation_records(uninterrupted):
    out, result = uninterrupted
    records = read_metrics(out)
    losses = [r for r in records if "loss" in r]
    assert [r["step"] for r in losses] == [10]  # every 10 updates
    assert math.isfinite(losses[0]["loss"]) and 0 < losses[0]["loss"] < math.log(300) + 1
    # max_updates is a budget: the budget schedule, whose peak is the paper's at warmup_steps (4)
    used = (10 - 0.5) / 12
    assert losses[0]["lr"] == pytest.approx(learning_rate(4, 32, 4, 2.0) * (1 - used) / 0.9)
    valid = [r for r in records if "valid_bleu" in r]
    assert [r["step"] for r in valid] == [4, 8, 12]
    for r in valid:
        assert 0 <= r["valid_bleu"] <= 100 and math.isfinite(r["valid_loss"])
        assert 1 < r["valid_ppl"] < 300  # exp(NLL per token), below the vocabulary size once trained a bit
    assert result.best_bleu == max(r["valid_bleu"] for r in valid)
    assert records[-1] == {
        "event": "stop",
        "reason": "max_updates",
        "step": 12,
        "best_bleu": result.best_bleu,
    }


def test_keep_last_prunes_old_checkpoints_but_the_best_and_out_stays_loadable(data, uninterrupted):
    out, result = uninterrupted
    best = {f"step_{result.model_step:08d}"}  # OUT's model: its checkpoint is never pruned
    # validations at 4, 8, 12 and the averaging snapshot at 11 (0.9 of the budget): the last 2 stay
    assert {p.name for p in checkpoint.list_checkpoints(out)} == {"step_00000011", "step_00000012"} | best
    assert not [p for p in (out / checkpoint.CHECKPOINTS).iterdir() if p.name.startswith(".")]
    tokenizer, corpus = data
    translator = Translator.load(out, device="cpu")  # OUT holds the best model by validation BLEU
    assert len(translator.translate(corpus.valid_src, beam_size=1)) == len(corpus.valid_src)


def test_the_run_ends_validated_with_beam_search_and_keeps_the_average_only_if_better(data, uninterrupted):
    out, result = uninterrupted
    tokenizer, corpus = data
    (final,) = [r for r in read_metrics(out) if r.get("event") == "final"]
    assert final["search"] == {"beam_size": 4, "alpha": 0.6, "length_penalty": "gnmt"}  # translate's default
    assert final["average"]["steps"] == [11, 12] and final["kept"] in ("single", "average")

    def beam_bleu(directory) -> float:
        hyps = Translator.load(directory, device="cpu").translate(corpus.valid_src)
        return sacrebleu.corpus_bleu(hyps, [corpus.valid_tgt]).score

    best_single = checkpoint.checkpoint_path(out, result.model_step)
    assert final["single_bleu"] == pytest.approx(beam_bleu(best_single))
    mean = {
        name: (a + b) / 2
        for (name, a), b in zip(weights(checkpoint.checkpoint_path(out, 11)).items(),
                                weights(checkpoint.checkpoint_path(out, 12)).values())
    }  # fmt: skip
    held = weights(out)
    expected = mean if final["average"]["bleu"] > final["single_bleu"] else weights(best_single)
    assert final["kept"] == ("average" if expected is mean else "single")
    for name in held:
        assert torch.allclose(held[name], expected[name], atol=1e-6), name
    if final["kept"] == "average":
        assert final["average"]["bleu"] == pytest.approx(beam_bleu(out))
    assert result.final is not None and result.final.bleu == max(
        final["single_bleu"], final["average"]["bleu"]
    )


def test_the_average_is_of_its_own_snapshots_not_of_the_validations_checkpoints_between(data, tmp_path):
    """40 updates, average_last 3: snapshots when 80% + 20%/3 and 80% + 40%/3 of the budget are used
    (updates 35 and 38) and the last update; the validation checkpoint at 36 lies between them, and
    keep_last 2 would prune 35 but for its part in the average."""
    tokenizer, corpus = data
    cfg = TrainConfig(max_updates=40, valid_every=9, average_last=3, keep_last=2, max_tokens=200,
                      dtype="fp32", warmup_steps=4, seed=3)  # fmt: skip
    run_train(tmp_path, small_model(tokenizer, dropout=0.0), cfg, tokenizer, corpus)
    (final,) = [r for r in read_metrics(tmp_path) if r.get("event") == "final"]
    assert final["average"]["steps"] == [35, 38, 40]
    assert {35, 38, 40} <= {checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)}
    assert 36 in [r["step"] for r in read_metrics(tmp_path) if "valid_bleu" in r]


def test_train_refuses_a_corpus_with_nothing_short_enough(data, tmp_path):
    tokenizer, corpus = data
    with pytest.raises(ValueError, match="max_len=3"):
        run_train(
            tmp_path,
            small_model(tokenizer, 0.0),
            TrainConfig(max_len=3),
            tokenizer,
            corpus,
        )


def test_patience_stops_after_that_many_validations_without_a_better_bleu(data, tmp_path):
    """With a learning rate too small to change the greedy outputs, BLEU stays where the first
    validation put it: the next `patience` validations are not better, and training stops there."""
    tokenizer, corpus = data
    cfg = TrainConfig(max_updates=50, valid_every=2, patience=2, lr_scale=1e-9, dtype="fp32", max_tokens=200)
    result = run_train(tmp_path / "run", small_model(tokenizer, 0.0), cfg, tokenizer, corpus)
    assert (result.stop.reason, result.step, result.model_step) == ("patience", 6, 2)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "valid_bleu" in r] == [2, 4, 6]  # no extra validation at the stop
    assert len({r["valid_bleu"] for r in records if "valid_bleu" in r}) == 1
    assert records[-1]["reason"] == "patience"


def test_the_search_a_run_is_trained_for_is_its_final_validation_and_its_models(data, tmp_path):
    """--set beam_size/alpha/length_penalty: the final validation decodes with it, and OUT and every
    checkpoint keep it in search.json, which Translator.load then uses without being told."""
    tokenizer, corpus = data
    cfg = TrainConfig(max_updates=12, valid_every=6, max_tokens=200, dtype="fp32", warmup_steps=4,
                      lr_scale=2.0, search=SearchConfig(beam_size=3, alpha=1.0, length_penalty="average"))  # fmt: skip
    result = run_train(tmp_path, small_model(tokenizer, dropout=0.0), cfg, tokenizer, corpus)
    wanted = SearchConfig(beam_size=3, alpha=1.0, length_penalty="average")
    (final,) = [r for r in read_metrics(tmp_path) if r.get("event") == "final"]
    assert final["search"] == {"beam_size": 3, "alpha": 1.0, "length_penalty": "average"}
    for directory in [tmp_path, *checkpoint.list_checkpoints(tmp_path)]:
        assert checkpoint.load_search(directory) == wanted, directory
    best_single = checkpoint.checkpoint_path(tmp_path, result.model_step)
    told = Translator.load(best_single, wanted, device="cpu").translate(corpus.valid_src)
    untold = Translator.load(best_single, device="cpu")
    assert untold.search_config == wanted and untold.translate(corpus.valid_src) == told
    assert final["single_bleu"] == pytest.approx(sacrebleu.corpus_bleu(told, [corpus.valid_tgt]).score)


def test_each_epoch_trains_on_its_bpe_dropout_view_and_a_resume_reaches_the_same_weights(
    data, tmp_path, monkeypatch
):
    """With BPE-dropout the epochs take the prepared views in turn (batches planned on that view's
    lengths); a pair is kept only if it fits max_len in every view; a run stopped in its second epoch
    and resumed ends with the weights of one that was not."""
    from aiayn.data.prepare import TokenizerOptions, prepare_corpus

    tokenizer, corpus = data
    options = TokenizerOptions(bpe_dropout=0.3, views=2)
    prepared = prepare_corpus(
        tmp_path / "data", corpus, tokenizer=tokenizer, options=options, say=lambda line: None
    )
    views = [([s.tolist() for s in src], [t.tolist() for t in tgt]) for src, tgt in prepared.views]
    max_len = sorted(len(s) for s in views[1][0])[len(views[1][0]) // 2]  # about half the pairs fit
    pairs = train_module.TrainingPairs.of(prepared, max_len)
    fits = [
        i for i in range(len(prepared.src)) if all(len(v[k][i]) <= max_len for v in views for k in (0, 1))
    ]
    assert pairs.keep.tolist() == fits and pairs.too_long == len(prepared.src) - len(fits) > 0
    for epoch in range(3):
        src, tgt = views[epoch % 2]
        assert [a.tolist() for a in pairs.lengths(epoch)] == [
            [len(src[i]) for i in fits],
            [len(tgt[i]) for i in fits],
        ]
        got = pairs.tensors([0, 2], CPU, epoch)
        want = collate(src, tgt, [fits[0], fits[2]])
        assert all(torch.equal(g, w) for g, w in zip(got, want))

    model_config = small_model(tokenizer, dropout=0.1)
    cfg = TrainConfig(max_updates=12, **(RESUME_CONFIG | {"max_tokens": 600}))  # the views are longer

    def train_on(data, out, mode="new"):  # as `aiayn train --data DATA`: the views are those of DATA
        return train_module.train(Run.open(out, mode, progress=False), model_config, cfg, data, device=CPU)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_on(prepared, straight)
    epochs = {r["step"]: r["epoch"] for r in read_metrics(straight) if "epoch" in r}
    assert epochs[12] > epochs[8] > 0  # stopped in its second epoch or later, and crosses one more
    with monkeypatch.context() as patch:
        patch.setattr(train_module, "stop_reason", interrupt_at(8))
        assert train_on(prepared, resumed).step == 8
    assert train_on(prepared, resumed, mode="resume").step == 12
    want, got = (weights(checkpoint.list_checkpoints(d)[-1]) for d in (straight, resumed))
    assert all(torch.equal(got[name], want[name]) for name in want)
    plain = tmp_path / "plain"  # the same run on plain BPE
    train_on(
        prepare_corpus(tmp_path / "plain-data", corpus, tokenizer=tokenizer, say=lambda line: None), plain
    )
    plain_weights = weights(checkpoint.list_checkpoints(plain)[-1])
    assert not all(torch.equal(plain_weights[name], want[name]) for name in want)
