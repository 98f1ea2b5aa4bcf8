"""Every CPU class's route, proven on whatever CPU runs the suite (precision.cpu_class, CPU_DEFAULTS).

Each class is taken by faking the probes it is read from, and then runs what that class runs: its
defaults (training's and translation's dtype auto, int8 routes, compiled kernels) and the promise of each
number format, on this CPU's hardware (bf16 runs everywhere, emulated where the CPU has no bf16
products): fp32 is exact (the naive decoder written here, transformers' generate, batch-invariant),
bf16 and int8 stay within their tolerance with one output per input in order. A class nobody has
tried can no longer turn the suite red.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    EOS_HEAVY_V,
    MIXED,
    assert_one_line_error,
    eos_heavy_model,
    naive_greedy,
    run_cli,
    run_train,
    word_tokenizer,
)

from aiayn import precision
from aiayn.config import PRESETS, SearchConfig, TrainConfig, preset
from aiayn.data.corpus import Corpus
from aiayn.data.synthetic import generate
from aiayn.inference import compiler
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.precision import (
    CPU_CLASS_VARIABLE,
    CPU_CLASSES,
    INT8_ROUTES,
    Int8Linear,
    Probes,
    classify,
    cpu_class,
    for_inference,
    training_dtype,
    translation_dtype,
)
from aiayn.tokenizer import BOS_ID, EOS_ID, Tokenizer
from aiayn.training.train import make_optimizer, train_step

CPU = torch.device("cpu")
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
# the probes of a CPU of each class, as /proc/cpuinfo and PyTorch report them
PROBES = {
    "avx2": Probes("AVX2", AVX2, amx=False),  # an AVX2 laptop, an EPYC Zen 3
    "avx512": Probes("AVX512", AVX512, amx=False),  # Skylake-SP, Cascade Lake without VNNI
    "avx512_vnni": Probes("AVX512", AVX512 | {"avx512_vnni"}, amx=False),  # Ice Lake
    "avx512_bf16": Probes("AVX512", AVX512 | {"avx512_vnni", "avx512_bf16"}, amx=False),  # Zen 4, Zen 5
    # Sapphire and Emerald Rapids
    "amx": Probes(
        "AVX512", AVX512 | {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}, amx=True
    ),
}
# integer dot products are vectorised (and oneDNN's int8 kernels fast) only with VNNI
HAS_VNNI = {"avx2": False, "avx512": False, "avx512_vnni": True, "avx512_bf16": True, "amx": True}


@pytest.fixture(params=CPU_CLASSES)
def cpu(request, monkeypatch) -> str:
    """This process as a CPU of one class: its probes faked, AIAYN_CPU_CLASS unset."""
    monkeypatch.delenv(CPU_CLASS_VARIABLE, raising=False)
    monkeypatch.setattr(precision, "probe", lambda: PROBES[request.param])
    return request.param


def test_the_probes_of_each_class_name_it_and_a_cap_below_avx512_is_avx2(cpu):
    assert cpu_class() == cpu
    # ATen's kernels capped at AVX2 (ATEN_CPU_CAPABILITY), or none of AVX-512's (another architecture)
    for capability in ("AVX2", "DEFAULT"):
        assert classify(dataclasses.replace(PROBES[cpu], capability=capability)) == "avx2"


def test_the_class_a_variable_names_wins_over_the_probes_and_a_wrong_name_is_refused(cpu, monkeypatch):
    for named in CPU_CLASSES:
        monkeypatch.setenv(CPU_CLASS_VARIABLE, named)
        assert cpu_class() == named
    monkeypatch.setenv(CPU_CLASS_VARIABLE, "avx1024")
    with pytest.raises(ValueError, match=f"{CPU_CLASS_VARIABLE}='avx1024'.*avx2, avx512"):
        cpu_class()
    # a command refuses it in one line before any work (even one, like translate, whose defaults need no class)
    code, _, stderr = run_cli(["translate", "no-such-model"])
    assert_one_line_error(code, stderr, f"{CPU_CLASS_VARIABLE}='avx1024'")


def test_each_class_takes_its_int8_routes_and_compiled_kernels(cpu):
    """int8 layers multiply by the routes of integer products where VNNI vectorises them; the compiled
    graphs' kernels are chosen from the same row."""
    row = "vnni" if HAS_VNNI[cpu] else "avx2"
    int8 = for_inference(torch.nn.Sequential(torch.nn.Linear(8, 8)), "int8")
    assert int8[0].routes == INT8_ROUTES[row]
    assert compiler.template_rows() == compiler.TEMPLATE_ROWS[row]


def test_translation_is_fp32_on_every_class_and_training_bf16_only_where_amx_multiplies_it(cpu):
    """dtype auto: translation fp32 on every class (exact and batch-invariant); training bf16 only on AMX,
    and only for a model wide enough that AMX's products outweigh autocast's casts."""
    assert translation_dtype("auto", CPU) == "fp32"
    for name in PRESETS:
        d_model = PRESETS[name]["d_model"]
        want = "bf16" if cpu == "amx" and d_model >= 256 else "fp32"
        assert training_dtype("auto", CPU, d_model) == want, name
        for given in ("fp32", "bf16"):  # what the user names, whatever the class
            assert training_dtype(given, CPU, d_model) == translation_dtype(given, CPU) == given
    with pytest.raises(ValueError, match="fp16 is for CUDA"):
        training_dtype("fp16", CPU, 512)


def test_the_amx_training_default_is_the_faster_format_measured_per_preset():
    """The AMX row of CPU_DEFAULTS against benchmarks/bench_train.py's figures on an AMX CPU (docs/
    bench_train_cpu.json, fp32 against bf16 autocast, one run): for each preset measured, the format
    training_dtype takes trains at least 97% as fast as the faster of the two."""
    results = json.loads((Path(__file__).parents[1] / "docs" / "bench_train_cpu.json").read_text())
    assert results["cpu_class"] == "amx", results["machine"]
    rates: dict[str, dict[str, float]] = {}
    for row in results["results"]:
        if row["system"] == "aiayn":
            rates.setdefault(row["config"], {})[row["dtype"]] = row["tokens_per_s"]
    assert {"low-resource", "small", "base"} <= set(rates)
    default = precision.CPU_DEFAULTS["amx"].train_bf16_from
    for config, rate in rates.items():
        assert set(rate) == {"fp32", "bf16"}, config
        chosen = "bf16" if PRESETS[config]["d_model"] >= default else "fp32"
        assert rate[chosen] >= 0.97 * max(rate.values()), (config, rate)


# --- Each number format's promise, on this CPU, by class ---------------------------------------------

INPUTS = MIXED


def one_output_per_input_in_order(translator: Translator) -> list[str]:
    """The translations of INPUTS, checked: one a line, empty for an empty line, the same as each line
    translated alone."""
    outputs = translator.translate(INPUTS)
    assert len(outputs) == len(INPUTS)
    assert [output == "" for output in outputs] == [text == "" for text in INPUTS]
    return outputs


def test_the_default_of_each_class_is_exact_and_batch_invariant(cpu, task_model, task_tokenizer):
    """No dtype given, as a user translates: greedy == the naive decoder, and beam 4 gives every
    sentence the same translation alone as among the others."""
    translator = Translator(task_model, task_tokenizer, SearchConfig(beam_size=4))
    ids = task_tokenizer.encode_src(INPUTS)
    for source, hyps in zip(ids, translator.translate_ids(ids, SearchConfig(beam_size=1))):
        assert hyps[0].tokens == (
            naive_greedy(task_model, source, len(source) + 50) if len(source) > 1 else []
        )
    together = one_output_per_input_in_order(translator)
    assert together == [translator.translate([text])[0] for text in INPUTS]


@pytest.fixture(scope="module")
def opus_shaped(tmp_path_factory):
    """(a model shaped like an imported OPUS-MT one, its tokenizer, sources, transformers' greedy token ids
    of them): the eos_heavy_model, whose outputs end after 0 to 29 tokens, through `aiayn export --format
    transformers`, its generation config included."""
    transformers = pytest.importorskip("transformers")
    from aiayn.checkpoint import save_model
    from aiayn.interop.huggingface import export_transformers

    model, tokenizer = eos_heavy_model(), word_tokenizer(EOS_HEAVY_V, EOS_HEAVY_V)
    root = tmp_path_factory.mktemp("opus-shaped")
    save_model(root / "model", model, tokenizer)
    export_transformers(root / "model", root / "hf")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(root / "hf").eval()
    generator = torch.Generator().manual_seed(3)
    sources = [
        torch.randint(4, EOS_HEAVY_V, (n,), generator=generator).tolist() + [EOS_ID] for n in range(3, 23)
    ]
    want = []
    for ids in sources:
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor([ids]), num_beams=1, max_new_tokens=len(ids) + 50)
        row = out[0, 1:].tolist()
        want.append(row[: row.index(EOS_ID)] if EOS_ID in row else row)
    assert len({len(tokens) for tokens in want}) >= 4  # outputs that end at different steps
    return model, tokenizer, sources, want


def test_the_default_of_each_class_gives_transformers_tokens_for_an_opus_mt_shaped_model(cpu, opus_shaped):
    model, tokenizer, sources, want = opus_shaped
    greedy = SearchConfig(beam_size=1)
    got = Translator(model, tokenizer, greedy).translate_ids(sources, greedy)
    assert [hyps[0].tokens for hyps in got] == want


def test_int8_of_each_class_keeps_its_lines_and_stays_close_to_fp32(cpu, task_model, task_tokenizer):
    """int8 by the class's routes (integer products where VNNI is faked on a CPU without it run PyTorch's
    plain loop: slower, the same numbers): one output per input in order; log-probabilities near fp32's."""
    int8 = for_inference(task_model, "int8")
    assert {str(m.routes) for m in int8.modules() if isinstance(m, Int8Linear)} == {
        str(INT8_ROUTES["vnni" if HAS_VNNI[cpu] else "avx2"])
    }
    one_output_per_input_in_order(Translator(int8, task_tokenizer, SearchConfig(beam_size=2), dtype="int8"))
    src = torch.tensor([task_tokenizer.encode_src(INPUTS[:1])[0]])
    tgt_in = torch.tensor([[BOS_ID, 5, 6, 7]])  # 4 rows: int8 weights on every class
    with torch.no_grad():
        exact, approx = task_model(src, tgt_in).log_softmax(-1), int8(src, tgt_in).log_softmax(-1)
    assert 0 < (exact - approx).abs().max() < 0.1


def test_bf16_runs_here_with_its_lines_and_close_to_fp32(task_model, task_tokenizer):
    """bf16 autocast, native or emulated: one output per input in order; log-probabilities near fp32's."""
    one_output_per_input_in_order(
        Translator(task_model, task_tokenizer, SearchConfig(beam_size=2), dtype="bf16")
    )
    src = torch.tensor([task_tokenizer.encode_src(INPUTS[:1])[0]])
    tgt_in = torch.tensor([[BOS_ID, 5, 6, 7]])
    with torch.no_grad(), precision.autocast(CPU, "bf16"):
        approx = task_model(src, tgt_in).float().log_softmax(-1)
    with torch.no_grad():
        exact = task_model(src, tgt_in).log_softmax(-1)
    assert 0 < (exact - approx).abs().max() < 0.1


def test_each_class_trains_in_its_default_format(cpu):
    """A training update in dtype auto of a model 256 wide: on AMX bf16 autocast (within bf16's tolerance
    of fp32's loss, and not equal to it), elsewhere fp32 (the same loss, exactly)."""
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=64, d_model=256, d_ff=256, n_encoder_layers=1, n_decoder_layers=1)
    start = Transformer(config).state_dict()
    src = torch.randint(4, 64, (4, 9))
    tgt_in, tgt_out = torch.randint(4, 64, (4, 7)), torch.randint(4, 64, (4, 7))
    losses = {}
    for dtype in ("auto", "fp32"):
        model = Transformer(config)
        model.load_state_dict(start)
        cfg = TrainConfig(dtype=dtype)
        torch.manual_seed(1)  # the same dropout masks
        losses[dtype], _ = train_step(
            model.train(), make_optimizer(model, cfg), [[src, tgt_in, tgt_out]], 1e-4, cfg
        )
    if cpu == "amx":
        assert losses["auto"] != losses["fp32"]
        assert abs(losses["auto"] - losses["fp32"]) < 0.02 * losses["fp32"]
    else:
        assert losses["auto"] == losses["fp32"]


def test_a_run_records_the_format_it_chose_and_a_resume_keeps_it(tmp_path, monkeypatch):
    """dtype auto, resolved once a run: train.json records the format the run trains in, and a resume on
    another class of CPU continues in it; a new run there takes that class's own."""
    src, tgt = generate(60, seed=5)
    tokenizer = Tokenizer.train(src, tgt, vocab_size=300)
    config = preset("tiny", vocab_size=tokenizer.src_vocab_size, d_model=256, d_ff=256,
                    n_encoder_layers=1, n_decoder_layers=1)  # fmt: skip
    corpus = Corpus(src, tgt)

    def trained(out: Path, updates: int, mode: str) -> str:
        cfg = TrainConfig(max_updates=updates, max_tokens=400, valid_every=1000)
        run_train(out, config, cfg, tokenizer, corpus, mode)
        return json.loads((out / "train.json").read_text())["dtype"]

    monkeypatch.setenv(CPU_CLASS_VARIABLE, "amx")
    assert trained(tmp_path / "run", 1, "new") == "bf16"
    monkeypatch.setenv(CPU_CLASS_VARIABLE, "avx2")
    assert trained(tmp_path / "run", 2, "resume") == "bf16"
    assert trained(tmp_path / "other", 1, "new") == "fp32"


# --- A process whose kernels are capped below its CPU ------------------------------------------------

CAPPED = """
import torch
from aiayn.config import SearchConfig, TrainConfig, preset
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.precision import INT8_ROUTES, cpu_class, for_inference, training_dtype, translation_dtype
from aiayn.tokenizer import Tokenizer
from aiayn.training.train import make_optimizer, train_step

cpu = torch.device("cpu")
int8 = for_inference(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int8")
print(cpu_class(), translation_dtype("auto", cpu), training_dtype("auto", cpu, 512), int8[0].routes == INT8_ROUTES["avx2"])
# bf16 with sequences long enough for PyTorch's CPU flash attention to split its keys into blocks
words = [f"w{i}" for i in range(40)]
text = " ".join(words * 2)
tokenizer = Tokenizer.train([text], [text], vocab_size=60, kind="word", min_frequency=1)
torch.manual_seed(0)
model = Transformer(preset("tiny", vocab_size=tokenizer.src_vocab_size, n_encoder_layers=1, n_decoder_layers=1))
search = SearchConfig(beam_size=2, max_len_a=0, max_len_b=70)
print(len(Translator(model.eval(), tokenizer, search, dtype="bf16").translate([text, "", text])))
ids = torch.tensor([tokenizer.encode_src([text])[0]] * 2)
cfg = TrainConfig(dtype="bf16")
loss, _ = train_step(model.train(), make_optimizer(model, cfg), [[ids, ids, ids]], 1e-4, cfg)
print(loss > 0)
"""


def test_a_process_capped_at_avx2_is_the_avx2_class_and_runs_bf16():
    """ATEN_CPU_CAPABILITY=avx2 (what an AVX2 laptop runs; the benchmarks' --isa avx2 caps oneDNN too):
    the AVX2 class's defaults and int8 routes, whatever the CPU has; and bf16, asked for, runs: on an AMX
    CPU PyTorch's bf16 flash attention would pack for AMX with AVX-512 code the cap leaves out, so the
    reference attention runs there instead (precision.autocast)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", CPU_CLASS_VARIABLE)}
    out = subprocess.run([sys.executable, "-c", CAPPED], env={**env, "ATEN_CPU_CAPABILITY": "avx2"},
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["avx2", "fp32", "fp32", "True", "3", "True"]
