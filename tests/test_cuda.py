"""aiayn on a CUDA GPU, each part against a reference computed another way: a tiny model learns in bf16
and in fp16 (through the gradient scaler) as it does in fp32 on the CPU; a run stopped and resumed ends
where one that ran through ends; torchrun and NCCL give one process's weights and gradients; translate
(eager, compiled, bf16), evaluate, serve and plot agree with the CPU in fp32, or with translate.

Skipped without CUDA. AIAYN_TEST_DEVICE=cpu runs the same checks on the CPU (those for CUDA alone skip).
"""

import collections
import gc
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest
import sacrebleu
import torch
import torch.distributed as dist
from conftest import RecordingSGD, free_port, run_cli, run_train, train_argv

from aiayn import checkpoint
from aiayn.config import SearchConfig, TrainConfig, preset
from aiayn.data.corpus import Corpus, collate
from aiayn.data.synthetic import generate
from aiayn.inference.compiled import CompiledDecoder
from aiayn.inference.translate import Translator
from aiayn.model import Transformer, attention_maps
from aiayn.precision import translation_dtype
from aiayn.tokenizer import BOS_ID, Tokenizer
from aiayn.training import train as train_module
from aiayn.training.distributed import Ranks
from aiayn.training.train import Step, Stop, agree, dropout_seed, train_step

DEVICE_NAME = os.environ.get("AIAYN_TEST_DEVICE", "cuda")
DEVICE = torch.device(DEVICE_NAME)
ON_CUDA = DEVICE.type == "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="CUDA only")

# Two runs of one computation on CUDA may differ in their last bits: some backward kernels (attention,
# scatter-adds) add with atomics in whatever order the threads arrive, and aiayn does not ask for
# torch.use_deterministic_algorithms. After a few dozen fp32 updates that stays far below 1e-5, while an
# update with another batch, learning rate or dropout mask moves weights by about the learning rate
# (1e-2 or more here). On the CPU every such check is exact.
RERUN = 0.0 if DEVICE.type == "cpu" else 1e-5

# fp32 matmuls on CUDA run in TF32 (precision.configure: inputs rounded to 10 bits of mantissa) and bf16
# keeps 7, so two tokens whose log-probabilities are closer than that rounding moves them may swap. Greedy
# outputs are compared where that cannot happen: a sentence counts as decided when, at every step of its
# fp32 greedy output on the CPU, the chosen token leads the next one by at least CLEAR[dtype] nats. (On the
# CPU, rounding every matmul's inputs, and bf16's outputs too, moved this file's translation model's
# log-probabilities by at most 0.013 for TF32 and 0.12 for bf16: a lead changes by twice that at most.)
CLEAR = {"fp32": 0.1, "bf16": 1.0}

GREEDY = SearchConfig(beam_size=1)
SOURCES, REFERENCES = generate(40, seed=77)  # held out: the models below train on other seeds


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts of the same names and shapes."""
    assert a.keys() == b.keys()
    return max(float((a[name].float().cpu() - b[name].float().cpu()).abs().max()) for name in a)


def last_weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint.read_weights(checkpoint.list_checkpoints(out)[-1] / checkpoint.WEIGHTS)


# --- Training: bf16 and fp16 learn as fp32 does ----------------------------------------------------------

TRAIN = dict(max_tokens=800, warmup_steps=10, lr_scale=1.0, average_last=0, keep_last=2, seed=5)
UPDATES = 40


@pytest.fixture(scope="module")
def task():
    """The synthetic task (no validation data: no validation to wait for), its tokenizer and `tiny`."""
    src, tgt = generate(1000, seed=3)
    tokenizer = Tokenizer.train(src, tgt, vocab_size=400)
    return tokenizer, Corpus(src, tgt), preset("tiny", vocab_size=tokenizer.src_vocab_size)


@dataclass
class Trace:
    """What each update of a run did, recorded around train.train_step."""

    losses: list[float] = field(default_factory=list)  # label-smoothed loss per target token
    devices: set[str] = field(default_factory=set)  # where the micro-batches were
    fused: set[bool] = field(default_factory=set)  # whether Adam was the fused kernel
    scalers: list = field(default_factory=list)  # the GradScaler of each update, or None


def traced_run(out: Path, task, device, mode: str = "new", stop_at: int = 0, scaler=None, **fields):
    """run_train on the device with TRAIN and `fields`; stop_at: a Ctrl-C during that update; scaler: the
    GradScaler class fp16 gets (CountingScaler). -> (Result, Trace)"""
    tokenizer, corpus, model_config = task
    trace, real_step, real_stop = Trace(), train_module.train_step, train_module.stop_reason

    def recorded(model, optimizer, micro_batches, lr, cfg, step=None):
        loss, n_tokens = real_step(model, optimizer, micro_batches, lr, cfg, step=step)
        trace.losses.append(loss / n_tokens)
        trace.devices.add(micro_batches[0][0].device.type)
        trace.fused.add(bool(optimizer.defaults.get("fused")))
        trace.scalers.append(step.scaler if step is not None else None)
        return loss, n_tokens

    def stop_reason(state, cfg, run, signals):  # as if Ctrl-C came during update stop_at
        if stop_at and state.step == stop_at:
            return Stop("signal", "SIGINT")
        return real_stop(state, cfg, run, signals)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_module, "train_step", recorded)
        patch.setattr(train_module, "stop_reason", stop_reason)
        patch.setattr(torch.amp, "GradScaler", scaler or CountingScaler)  # what train.grad_scaler makes
        cfg = TrainConfig(**{**TRAIN, **fields})
        result = run_train(out, model_config, cfg, tokenizer, corpus, mode=mode, device=device)
    return result, trace


class CountingScaler(torch.amp.GradScaler):
    """torch's GradScaler, counting what training asks of it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = collections.Counter()

    def scale(self, outputs):
        self.calls["scale"] += 1
        return super().scale(outputs)

    def unscale_(self, optimizer):
        self.calls["unscale_"] += 1
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls["update"] += 1
        return super().update(new_scale)


class HighScaler(CountingScaler):
    """A loss scale starting at 2^40, where fp16 gradients overflow: it halves at each of the first updates
    (which skip Adam's step), so the scale a run has reached differs from the one it started with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "init_scale": 2.0**40})


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def fp32_on_the_cpu(task, tmp_path_factory) -> Trace:
    """The reference: the same run in fp32 on the CPU. train() seeds and builds the model on the CPU before
    moving it, so every run here starts from the same weights and sees the same batches."""
    _, trace = traced_run(
        tmp_path_factory.mktemp("reference") / "run", task, "cpu", max_updates=UPDATES, dtype="fp32"
    )
    assert mean(trace.losses[-10:]) < 0.8 * trace.losses[0]  # the reference itself learns
    return trace


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=cuda_only)])
def test_a_tiny_run_in_half_precision_learns_as_fp32_on_the_cpu_does(task, fp32_on_the_cpu, tmp_path, dtype):
    result, trace = traced_run(tmp_path / "run", task, DEVICE, max_updates=UPDATES, dtype=dtype)
    assert result.step == UPDATES and len(trace.losses) == UPDATES
    assert all(math.isfinite(loss) for loss in trace.losses)
    assert trace.devices == {DEVICE.type} and trace.fused == {ON_CUDA}  # Adam's fused kernel on CUDA
    if ON_CUDA:
        assert torch.backends.cuda.matmul.allow_tf32  # precision.configure
    # 40 updates take `tiny` from worse than a uniform guess (about 6.4 nats a token here) to the plateau
    # of the target's word frequencies (about 4.8), where runs that differ in rounding meet again.
    late = mean(trace.losses[-10:])
    assert late < 0.8 * trace.losses[0], trace.losses
    want = fp32_on_the_cpu.losses
    # The first update is a forward pass from the same weights on the same batch: half precision moves
    # its loss by well under 1%.
    assert trace.losses[0] == pytest.approx(want[0], rel=0.02)
    assert late == pytest.approx(mean(want[-10:]), rel=0.05)
    if dtype == "fp16":  # one scaler for the run, and every update went through it
        (scaler,) = {id(s): s for s in trace.scalers}.values()
        assert isinstance(scaler, CountingScaler)
        assert scaler.calls == {"scale": UPDATES, "unscale_": UPDATES, "step": UPDATES, "update": UPDATES}
        assert 1.0 <= scaler.get_scale() <= 2.0**16  # finite: it backs off from 2^16 only on an overflow
    else:
        assert trace.scalers == [None] * UPDATES  # bf16 has fp32's range: nothing to scale


# --- Resume ----------------------------------------------------------------------------------------------


def test_a_resumed_fp32_run_ends_where_the_uninterrupted_one_does(task, tmp_path):
    """Stopped by Ctrl-C at update 10 of 20 (a checkpoint), then resumed: the weights and Adam's moments
    at 20 are those of the run that went through, to RERUN."""
    traced_run(tmp_path / "through", task, DEVICE, max_updates=20, dtype="fp32")
    first, _ = traced_run(tmp_path / "run", task, DEVICE, max_updates=20, dtype="fp32", stop_at=10)
    assert first.step == 10 and first.stop.signal == "SIGINT"
    second, trace = traced_run(tmp_path / "run", task, DEVICE, mode="resume", max_updates=20, dtype="fp32")
    assert second.step == 20 and len(trace.losses) == 10  # the last ten updates, not all twenty
    assert trace.devices == {DEVICE.type}
    assert max_difference(last_weights(tmp_path / "run"), last_weights(tmp_path / "through")) <= RERUN
    want, got = (
        checkpoint.load_state(checkpoint.list_checkpoints(tmp_path / d)[-1]) for d in ("through", "run")
    )
    for key in ("step", "epoch", "batch"):
        assert got["progress"][key] == want["progress"][key], key
    for i, slot in want["optimizer"]["state"].items():  # Adam's moments and step, loaded back onto the device
        assert max_difference(got["optimizer"]["state"][i], slot) <= RERUN, i


def test_a_resumed_bf16_run_continues(task, tmp_path):
    """Stopped at 4 of 8 and resumed in bf16, whose gradients are rounded to 7 bits of mantissa, so the order
    of atomic additions matters more than in fp32: the weights are compared loosely, still far inside the
    1e-2 an update with a wrong batch would move them."""
    traced_run(tmp_path / "through", task, DEVICE, max_updates=8, dtype="bf16")
    first, _ = traced_run(tmp_path / "run", task, DEVICE, max_updates=8, dtype="bf16", stop_at=4)
    assert first.step == 4
    second, trace = traced_run(tmp_path / "run", task, DEVICE, mode="resume", max_updates=8, dtype="bf16")
    assert second.step == 8 and len(trace.losses) == 4 and all(map(math.isfinite, trace.losses))
    assert max_difference(last_weights(tmp_path / "run"), last_weights(tmp_path / "through")) <= 1e-3


@cuda_only
def test_a_resumed_fp16_run_goes_on_from_the_loss_scale_it_had_reached(task, tmp_path):
    """fp16's loss scale is learned as a run goes (halved at an overflow, doubled after 2,000 clean updates):
    the checkpoint holds it, and a resume starts from it, not from the initial scale again, which would
    skip updates the uninterrupted run made."""
    kwargs = dict(max_updates=24, dtype="fp16", scaler=HighScaler)
    _, through = traced_run(tmp_path / "through", task, DEVICE, **kwargs)
    first, _ = traced_run(tmp_path / "run", task, DEVICE, stop_at=12, **kwargs)
    assert first.step == 12
    saved = checkpoint.load_state(checkpoint.list_checkpoints(tmp_path / "run")[-1])
    assert saved["scaler"]["scale"] < 2.0**40  # it had learned a smaller one by then
    second, resumed = traced_run(tmp_path / "run", task, DEVICE, mode="resume", **kwargs)
    assert second.step == 24 and resumed.scalers[-1].get_scale() == through.scalers[-1].get_scale()
    assert max_difference(last_weights(tmp_path / "run"), last_weights(tmp_path / "through")) <= 1e-3


# --- torchrun and NCCL -----------------------------------------------------------------------------------


@cuda_only
@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs a machine with one GPU")
def test_more_processes_than_gpus_is_a_one_line_error(tmp_path):
    """Two ranks on a machine with one GPU: rank 1 has no GPU of its own; it says so in one line instead of
    failing inside CUDA (it failed on "invalid device ordinal" before)."""
    src, tgt = generate(300, seed=3)
    for lang, lines in (("en", src), ("xx", tgt)):
        (tmp_path / f"c.{lang}").write_text("".join(line + "\n" for line in lines))
    flags = ["--preset", "tiny", "--vocab-size", 300, "--max-updates", 2, "--device", "cuda"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "aiayn", *map(str, train_argv(tmp_path / "c", tmp_path / "o", *flags))]  # fmt: skip
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("aiayn: error: ")]
    assert errors and "2 processes on this machine but 1 GPU(s)" in errors[0], done.stderr[-2000:]


BACKEND = "nccl" if ON_CUDA else "gloo"


def test_torchrun_with_one_rank_gives_the_weights_of_one_process(tmp_path):
    """`aiayn train` under torchrun (one rank, dist_backend nccl) against the same command run plainly.
    With one rank aiayn makes no process group (distributed.Ranks.start), so what differs is torchrun's
    environment; NCCL itself is the next test's."""
    src, tgt = generate(300, seed=2)
    for lang, lines in (("en", src), ("xx", tgt)):
        (tmp_path / f"c.{lang}").write_text("".join(line + "\n" for line in lines))
    flags = ["--preset", "tiny", "--vocab-size", 300, "--max-tokens", 300, "--max-updates", 12,
             "--device", DEVICE_NAME, "--set", "dtype=fp32", "--set", f"dist_backend={BACKEND}"]  # fmt: skip
    code, stdout, stderr = run_cli(train_argv(tmp_path / "c", tmp_path / "one", *flags))
    assert code == 0, stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "-m", "aiayn", *map(str, train_argv(tmp_path / "c", tmp_path / "ddp", *flags))]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    last = ddp.stdout.splitlines()[-1]  # the stop record (from its "{": a launcher may prefix lines)
    assert json.loads(last[last.index("{") :]) == json.loads(stdout.splitlines()[-1])
    assert checkpoint.list_checkpoints(tmp_path / "ddp")[-1].name == "step_00000012"
    assert max_difference(last_weights(tmp_path / "ddp"), last_weights(tmp_path / "one")) <= RERUN


def test_nccl_collectives_and_ddp_give_one_processs_numbers(tmp_path):
    """What several ranks run on CUDA: NCCL all-reduces of token counts (float64) and stop flags (int64),
    a broadcast, and DDP with aiayn's summing hook. This machine may have one GPU, and NCCL refuses two
    ranks on one, so the group has one member and every collective is an identity; a Ranks told the world
    is 2 takes the collective path all the same (world 1 returns before it), and must give one process's
    loss and gradients."""
    ids = [[5, 9, 12, 7, 2], [14, 6, 2], [8, 8, 30, 11, 19, 2]]
    batch = [t.to(DEVICE) for t in collate(ids, ids, [0, 1, 2])]

    def one_update(ranks: Ranks):
        torch.manual_seed(0)
        model = Transformer(preset("tiny", vocab_size=40, dropout=0.1)).to(DEVICE)
        optimizer = RecordingSGD(model)
        step = Step(0.1, seeds=[dropout_seed(1, 1, 0)], ranks=ranks)
        loss, n_tokens = train_step(
            ranks.wrap(model.train()), optimizer, [batch], 0.1, TrainConfig(dtype="fp32"), step
        )
        return loss, n_tokens, optimizer.grads[0]

    want_loss, want_tokens, want_grads = one_update(Ranks())
    dist.init_process_group(BACKEND, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ranks = Ranks(rank=0, world=2, local_rank=DEVICE.index or 0)
        assert ranks.sum([3.0, 0.25], DEVICE) == [3.0, 0.25] and ranks.max([0, 7], DEVICE) == [0, 7]
        assert ranks.share({"data": "prepared"}) == {"data": "prepared"}
        assert agree(ranks, Stop("signal", "SIGTERM"), DEVICE) == Stop("signal", "SIGTERM")
        assert agree(ranks, Stop("max_updates"), DEVICE) == Stop("max_updates")
        assert agree(ranks, None, DEVICE) is None
        loss, n_tokens, grads = one_update(ranks)
    finally:
        gc.collect()  # the DDP wrapper, in reference cycles, goes before its group (Ranks.close)
        dist.destroy_process_group()
    assert n_tokens == want_tokens == 14
    assert loss == pytest.approx(want_loss, rel=RERUN, abs=0)
    names = [name for name, _ in Transformer(preset("tiny", vocab_size=40)).named_parameters()]
    assert max_difference(dict(zip(names, grads)), dict(zip(names, want_grads))) <= RERUN
    assert max(float(g.abs().max()) for g in grads) > 0


# --- Translation: eager, bf16, compiled; evaluate, serve, plot ---------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model trained (in fp32, on the device: it is quick there) until it translates the synthetic
    task: most of its greedy decisions on SOURCES are clear (CLEAR). A model of a few dozen updates would
    not do: it writes one word over and over whatever the input."""
    src, tgt = generate(2000, seed=21)
    out = tmp_path_factory.mktemp("translation") / "model"
    tokenizer = Tokenizer.train(src, tgt, vocab_size=2000)  # a token per word
    config = preset("tiny", vocab_size=tokenizer.src_vocab_size)
    cfg = TrainConfig(
        max_updates=600, max_tokens=1000, warmup_steps=30, lr_scale=0.5, dtype="fp32", average_last=0
    )
    run_train(out, config, cfg, tokenizer, Corpus(src, tgt), device=DEVICE)
    return out


@torch.no_grad()
def decided_by(model: Transformer, src: list[int], tokens: list[int]) -> float:
    """The smallest lead, in nats, of each chosen token (EOS included) over the runner-up along a greedy output."""
    logits = model(torch.tensor([src]), torch.tensor([[BOS_ID, *tokens]]))[0]  # (T, V)
    top = logits.log_softmax(-1).topk(2, dim=-1).values  # (T, 2)
    return float((top[:, 0] - top[:, 1]).min())


class Reference(NamedTuple):
    """fp32 greedy translations of SOURCES on the CPU."""

    ids: list[list[int]]  # the sources
    tokens: list[list[int]]  # the outputs
    margins: list[float]  # decided_by, for each


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    translator = Translator.load(model_dir, GREEDY, dtype="fp32", device="cpu")
    ids = translator.tokenizer.encode_src(SOURCES)
    tokens = [h[0].tokens for h in translator.translate_ids(ids, GREEDY)]
    assert sacrebleu.corpus_bleu(translator.tokenizer.decode_tgt(tokens), [REFERENCES]).score > 50
    return Reference(ids, tokens, [decided_by(translator.model, s, t) for s, t in zip(ids, tokens)])


def assert_same_where_decided(got: list[list[int]], reference: Reference, clear: float) -> None:
    """The outputs `got` of the first len(got) sources have the CPU's tokens wherever the CPU decided each
    step by at least `clear` nats (and at least half of them were)."""
    margins = reference.margins[: len(got)]
    decided = [i for i, margin in enumerate(margins) if margin >= clear]
    assert len(decided) >= len(got) // 2, f"too few clear sentences to compare: {sorted(margins)}"
    differ = [i for i in decided if got[i] != reference.tokens[i]]
    assert not differ, [(i, margins[i], got[i], reference.tokens[i]) for i in differ]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_on_the_device_gives_the_cpus_fp32_tokens_where_rounding_cannot_swap_them(
    model_dir, reference, dtype
):
    translator = Translator.load(model_dir, GREEDY, dtype=dtype, device=DEVICE)
    assert translator.device.type == DEVICE.type
    outputs = translator.translate_ids(reference.ids, GREEDY)
    assert_same_where_decided([h[0].tokens for h in outputs], reference, CLEAR[dtype])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    (root / "src.txt").write_text("".join(line + "\n" for line in SOURCES))
    (root / "ref.txt").write_text("".join(line + "\n" for line in REFERENCES))
    return root


@pytest.fixture(scope="module")
def translated(model_dir, files) -> list[str]:
    """`aiayn translate --device DEVICE` of SOURCES: the model's own search (beam 4), dtype auto (bf16 on CUDA)."""
    code, stdout, stderr = run_cli(
        ["translate", model_dir, "--device", DEVICE_NAME, "--input", files / "src.txt", "--quiet"]
    )
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert len(lines) == len(SOURCES) and all(lines)
    return lines


def test_evaluate_on_the_device_scores_what_translate_writes_with_sacrebleu(
    model_dir, files, translated, tmp_path
):
    argv = ["evaluate", model_dir, "--src", files / "src.txt", "--ref", files / "ref.txt", "--device", DEVICE_NAME,
            "--output", tmp_path / "hyp.txt", "--quiet"]  # fmt: skip
    code, stdout, stderr = run_cli(argv)
    assert code == 0, stderr
    assert (tmp_path / "hyp.txt").read_text().splitlines() == translated
    bleu = json.loads(stdout.splitlines()[-1])["bleu"]
    assert bleu == pytest.approx(sacrebleu.corpus_bleu(translated, [REFERENCES]).score, abs=1e-9)


def http(port: int, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_serve_on_the_device_answers_what_translate_writes(model_dir, translated, tmp_path):
    """`aiayn serve --device DEVICE` as a user starts it: the lines of one request make the batches the
    file's lines make in translate, so the same kernels give the same translations, exactly."""
    port = free_port()
    command = [sys.executable, "-m", "aiayn", "serve", model_dir, "--device", DEVICE_NAME, "--port", port]
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr:
        server = subprocess.Popen(list(map(str, command)), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server did not come up: {log.read_text()}")
            try:
                assert http(port, "/health") == {"status": "ok"}
                break
            except OSError:  # not listening yet
                time.sleep(0.2)
        info = http(port, "/info")
        assert torch.device(info["device"]).type == DEVICE.type
        assert info["dtype"] == translation_dtype("auto", DEVICE) and (info["dtype"] == "bf16" or not ON_CUDA)
        assert http(port, "/translate", {"text": SOURCES}) == {"translations": translated}
        maps = http(port, "/attention", {"text": SOURCES[0]})
        for kind in ("encoder", "decoder", "cross"):
            weights = torch.tensor(maps[kind])  # (layers, H, rows, columns)
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5, rtol=0)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()


def test_attention_maps_on_the_device_are_the_cpus(model_dir, reference, tmp_path):
    """`aiayn plot --sentence --device DEVICE` draws the maps; the weights themselves, for the same source
    and target, are the CPU's up to TF32's rounding (the maps run in fp32, whatever --dtype): a CPU
    emulation of that rounding moved weights by up to 0.01. They stay distributions that never look ahead."""
    code, stdout, stderr = run_cli(
        ["plot", model_dir, "--sentence", SOURCES[0], "--device", DEVICE_NAME, "--out", tmp_path]
    )
    assert code == 0, stderr
    pictures = {Path(p).name: Path(p).read_bytes() for p in json.loads(stdout)["plots"]}
    names = {"curves.png", "attention_encoder.png", "attention_decoder.png", "attention_cross.png"}
    assert set(pictures) == names
    assert all(data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000 for data in pictures.values())
    src, tgt_in = torch.tensor(reference.ids[:1]), torch.tensor([[BOS_ID, *reference.tokens[0]]])
    want = attention_maps(checkpoint.load_model(model_dir), src, tgt_in)
    got = attention_maps(checkpoint.load_model(model_dir, DEVICE), src.to(DEVICE), tgt_in.to(DEVICE))
    for kind, layers in want.items():
        for w, g in zip(layers, got[kind], strict=True):
            assert g.device.type == DEVICE.type
            g = g.cpu()
            torch.testing.assert_close(g, w, atol=0.03, rtol=0, msg=kind)
            torch.testing.assert_close(g.sum(-1), torch.ones(g.shape[:-1]), atol=1e-5, rtol=0)
            if kind == "decoder":
                assert g.triu(1).abs().max() == 0


def test_a_compiled_step_on_the_device_gives_eager_translations(model_dir, reference):
    """`--compile` on the device: graphs compiled by torch.compile (no CUDA graphs), with frozen weights;
    in memory, and without max_autotune, which CompiledDecoder leaves off on a GPU (it would time Triton
    GEMM templates for every product of every graph). 20 sentences, padded to 32 rows, greedy and then beam 4 (the beam's cache table), one decoder:
    the encoder's graph serves both. Last in this file: compiling is most of its time."""
    ids = reference.ids[:20]
    compiled = Translator.load(model_dir, GREEDY, dtype="fp32", device=DEVICE, compile=True)
    assert isinstance(compiled.decoder, CompiledDecoder)  # what --compile makes; it compiles on first use
    compiled.decoder = CompiledDecoder(compiled.model)  # in memory: no AOTInductor packages to build
    assert compiled.decoder.options["max_autotune"] is not ON_CUDA  # Triton's GEMM autotuning: minutes
    greedy = [h[0].tokens for h in compiled.translate_ids(ids, GREEDY)]
    assert compiled.decoder.compile_seconds > 0  # graphs were made, and used
    assert_same_where_decided(greedy, reference, CLEAR["fp32"])
    # A beam has no one margin to go by: cuBLAS and inductor's kernels round TF32 differently, and may swap
    # two hypotheses scored within that rounding of each other; in one sentence of ten at most.
    beam = SearchConfig(beam_size=4)
    eager = Translator(compiled.model, compiled.tokenizer, beam, "fp32").translate_ids(ids, beam)
    fast = compiled.translate_ids(ids, beam)
    assert sum(a[0].tokens == b[0].tokens for a, b in zip(fast, eager)) >= 0.9 * len(ids)
