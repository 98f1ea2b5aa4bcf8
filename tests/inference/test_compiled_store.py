"""The compiled graphs' store (compiled.py): AOTInductor packages that a later process loads instead of
compiling, named for everything they were compiled from; a damaged one compiled again, and processes
sharing a store. Apart from test_compiled.py so that the two compile-heavy files run on two workers."""

import dataclasses
import errno
import json
import shutil
import subprocess
import sys
import threading
import unittest.mock
import zipfile

import pytest
import torch
from conftest import EOS_HEAVY_V as V
from conftest import eos_heavy_model, fill, fused_attention_calls, sources
from torch._dynamo.utils import counters
from torch._inductor import codecache

from aiayn.config import SearchConfig
from aiayn.inference import compiler
from aiayn.inference.compiled import CompiledDecoder, NotStored, StoredDecoder
from aiayn.inference.graph_store import TRACED_CODE, Damaged, Package, fingerprint, load_stored
from aiayn.inference.search import greedy_candidates, search
from aiayn.model import Transformer


@pytest.fixture(scope="module")
def model():
    return eos_heavy_model()


def greedy(decoder, width: int = 9, seed: int = 12) -> tuple[list, list]:
    """Greedy over 3 sentences with decoder: its hypotheses' tokens and scores. The memory and step graphs
    of a few sentences (the sentences and the source length dynamic in them), and greedy's own work for
    more than one live sentence and for one (the sentences end at different steps): four packages, each
    costing the suite seconds of C++ compiling."""
    config = SearchConfig(beam_size=1, max_len_b=20)
    hyps = search(decoder, sources(3, width, seed=seed), config)
    return [[h.tokens for h in hs] for hs in hyps], [[h.score for h in hs] for hs in hyps]


def assert_same(got: tuple[list, list], want: tuple[list, list]) -> None:
    """The same tokens, and scores within rounding."""
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def compiled(model, tmp_path_factory):
    """A store of packages that a first decoder compiled for check's searches, giving eager's hypotheses,
    with inductor's default options (max_autotune: each product's kernel chosen, here by rule), and the
    choices inductor timed meanwhile (none found in its cache: it is not read)."""
    store = tmp_path_factory.mktemp("store")
    counters.clear()
    headers = set()  # the precompiled headers the compiles asked for (not compiler.prepare's thread)
    ask = codecache._precompile_header

    def asked(*args, **kwargs):
        header = ask(*args, **kwargs)
        if threading.current_thread() is threading.main_thread():
            headers.add(header)
        return header

    with (
        torch._inductor.config.patch(autotune_local_cache=False),
        unittest.mock.patch.object(codecache, "_precompile_header", asked),
    ):
        first = CompiledDecoder(model, store=store)
        assert_same(greedy(first), greedy(model))
    assert first.compile_seconds > 0
    return store, counters["inductor"]["select_algorithm_autotune"], headers


@pytest.fixture(scope="module")
def store(compiled):
    """The compiled store; the tests that damage it copy it first (compiling it again would cost each of
    them seconds)."""
    return compiled[0]


def package_code(path) -> str:
    """The C++ of a package: its kernels and the wrapper that calls them and the library."""
    with zipfile.ZipFile(path) as archive:
        return "".join(archive.read(n).decode() for n in archive.namelist() if n.endswith(".cpp"))


def test_a_store_serves_a_graph_only_in_the_number_format_it_was_traced_in(model, store):
    """A graph keeps the casts it was traced with: the store's fp32 packages serve an fp32 search, and a
    bf16 search of the same model finds none of its own (it decodes eagerly, as `compile="stored"` does,
    instead of running fp32's graphs, or an fp32 search bf16's)."""
    copy = Transformer(model.config).eval()
    copy.load_state_dict(model.state_dict())
    stored = StoredDecoder(copy, store)
    assert_same(greedy(stored), greedy(copy))  # fp32: every graph from the store
    with pytest.raises(NotStored) as missing, torch.autocast("cpu", dtype=torch.bfloat16):
        greedy(StoredDecoder(copy, store))
    assert missing.value.args[0][0] == "memory" and missing.value.args[0][-1] == "bf16"


def test_each_product_takes_the_kernel_of_its_rows_and_none_is_timed(compiled):
    """max_autotune (the default on a CPU) chooses between inductor's own GEMM kernel and the library's
    (oneDNN's linear) for every matrix product: by rule (compiler.TEMPLATE_ROWS), timing none, so that
    no decision is made twice, in any graph or process (test_two_processes_... below: another process
    times none either). A few sentences' greedy step, traced for 4 rows, runs inductor's kernels, inlined;
    the memory of two or more sentences (the few and the many share it: compiled.shared_class), B x S
    rows, the library's."""
    store, timed, _ = compiled
    assert timed == 0
    step = package_code(next(store.glob("step-few-*.pt2")))
    assert "micro_gemm" in step and "_linear_pointwise" not in step
    batch = package_code(next(store.glob("memory-any-*.pt2")))
    assert "_linear_pointwise" in batch and "micro_gemm" not in batch


def test_a_store_serves_a_later_decoder_without_compiling(model, store):
    """Graphs exported to a store (AOTInductor packages) give eager's hypotheses (the store fixture), and a
    decoder made later over a fresh copy of the model (a second process, as far as it can tell) loads
    them instead of compiling: the cached second run of `--compile`."""
    # memory (the encoder and the cross keys/values), which the few and the many share, and greedy's step
    # for a few sentences; greedy search's own work for 3 and fewer live sentences and for 1
    assert sorted("-".join(p.name.split("-")[:2]) for p in store.glob("*.pt2")) == [
        "greedy-1", "greedy-2", "memory-any", "step-few"]  # fmt: skip
    copy = Transformer(model.config).eval()
    copy.load_state_dict(model.state_dict())
    later = CompiledDecoder(copy, store=store)
    for width, seed in ((9, 12), (15, 3), (4, 5)):  # other sources, lengths and live sentences
        assert_same(greedy(later, width, seed), greedy(copy, width, seed))
    assert later.compile_seconds == 0.0 and later.load_seconds > 0
    # the packages compute attention as its arithmetic too (test_on_a_cpu_compiled_graphs_write_attention_out)
    assert fused_attention_calls(later, sources(3, 9, seed=1), SearchConfig(beam_size=1, max_len_b=8)) == 0


def flipped(data: bytes) -> bytes:
    """data with 64 bytes in the middle inverted (in a package, the middle of its compiled library)."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :]


# How each store file is damaged, from its bytes and the bytes of another graph's package
DAMAGES = {
    "truncated": lambda data, other: data[: len(data) // 2],  # a copy cut short
    "corrupted": lambda data, other: flipped(data),  # bits flipped on a disk (no error reading them)
    "foreign": lambda data, other: other,  # another graph's whole package under this name
}


# What the store's check says of each
REASONS = {"truncated": "not a whole package", "corrupted": "not a whole package", "foreign": "a package of "}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_store_file_that_is_not_a_whole_package_of_its_graph_is_damaged(store, tmp_path, damage):
    """Every way a store file can be wrong is found before PyTorch loads it (its loader raises a
    RuntimeError on a truncated file, runs another graph's package on inputs it was not compiled for, and
    checks no checksum of the library it loads: flipped bytes there crash the process or go unnoticed)."""
    (target,) = store.glob("greedy-1-*.pt2")
    (other,) = store.glob("greedy-2-*.pt2")
    damaged = tmp_path / target.name
    damaged.write_bytes(DAMAGES[damage](target.read_bytes(), other.read_bytes()))
    with pytest.raises(Damaged, match=REASONS[damage]):
        load_stored(damaged)
    assert isinstance(load_stored(target), Package)  # the whole one loads


def test_a_damaged_package_is_compiled_again_with_one_line_saying_so(model, store, tmp_path, capsys):
    """A store file that is damaged (here: bits flipped in the middle of its library) is a cache miss: that
    graph alone is compiled again and its file replaced (a new file renamed over it), with one line on
    stderr naming it, and the search gives eager's hypotheses; a decoder made later loads the new file
    without compiling. (Greedy search's own work for one live sentence is the graph damaged: the smallest
    to compile again.)"""
    damaged = shutil.copytree(store, tmp_path / "store")
    (target,) = damaged.glob("greedy-1-*.pt2")
    target.write_bytes(flipped(target.read_bytes()))
    files = {p.name: p.stat().st_ino for p in damaged.iterdir()}
    capsys.readouterr()
    decoder = CompiledDecoder(model, store=damaged)
    assert_same(greedy(decoder), greedy(model))
    assert decoder.compile_seconds > 0
    assert {p.name: p.stat().st_ino for p in damaged.iterdir()}.keys() == files.keys()  # nothing left beside
    assert [name for name, ino in files.items() if (damaged / name).stat().st_ino != ino] == [target.name]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"aiayn: {target}: ") and "compiling it again" in lines[0]
    later = CompiledDecoder(model, store=damaged)
    assert_same(greedy(later), greedy(model))
    assert later.compile_seconds == 0.0 and capsys.readouterr().err == ""


# One process of test_two_processes_compiling_one_graph_into_a_store_at_once: the model from its config and
# weights file, a decoder over the store, and (once the other process is as far) a greedy search, printed as JSON
# with the choices inductor timed (none found in its cache: it is not read).
COMPILE_IN_A_PROCESS = """
import json, sys, time
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from aiayn.config import ModelConfig, SearchConfig, from_dict
from aiayn.inference.compiled import CompiledDecoder
from aiayn.inference.search import search
from aiayn.model import Transformer
torch.set_num_threads(1)
weights, store, ready, me, src, config = sys.argv[1:]
model = Transformer(from_dict(ModelConfig, json.loads(config))).eval()
model.load_state_dict(torch.load(weights))
torch._inductor.config.autotune_local_cache = False
from torch._inductor import cpu_vec_isa
probes, probe = [], cpu_vec_isa.VecISA.check_build
def check_build(isa, code):  # inductor's probe of an instruction set: a build of ATen's vector headers
    if code == cpu_vec_isa.VecISA._avx_code:
        probes.append(str(isa))
    return probe(isa, code)
cpu_vec_isa.VecISA.check_build = check_build
decoder = CompiledDecoder(model, store=store)
Path(ready, me).touch()
deadline = time.monotonic() + 120
while len(list(Path(ready).iterdir())) < 2:
    if time.monotonic() > deadline:
        sys.exit("the other process never came")
    time.sleep(0.01)
hyps = search(decoder, torch.tensor(json.loads(src)), SearchConfig(beam_size=1, max_len_b=20))
print(json.dumps({"tokens": [[h.tokens for h in hs] for hs in hyps], "scores": [[h.score for h in hs] for hs in hyps],
                  "compiled": decoder.compile_seconds > 0, "timed": counters["inductor"]["select_algorithm_autotune"],
                  "probes": probes, "isa": str(cpu_vec_isa.pick_vec_isa()),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def test_two_processes_compiling_one_graph_into_a_store_at_once(model, store, tmp_path):
    """Two processes sharing a store both miss one graph at the same moment and both compile it: each
    renames its own whole file over the other's (temporary names never collide), both give eager's
    hypotheses, and the store is left holding only whole packages, which a later decoder loads. Neither
    times a kernel (the graph's products choose theirs by rule), nor prints inductor's tables or
    warnings, nor builds inductor's probes of the CPU's instruction sets (compiler._isas_by_flags asks
    the compiler instead), and the set each compiles for is the one PyTorch's own kernels run with."""
    shared = shutil.copytree(store, tmp_path / "store")
    # the graph both compile: the encoder's, the smallest with matrix products (whose kernels are chosen)
    (shared / next(store.glob("memory-any-*.pt2")).name).unlink()
    weights, ready = tmp_path / "weights.pt", tmp_path / "ready"
    torch.save(model.state_dict(), weights)
    ready.mkdir()
    src = json.dumps(sources(3, 9, seed=12).tolist())
    argv = [sys.executable, "-c", COMPILE_IN_A_PROCESS, weights, shared, ready]
    processes = [
        subprocess.Popen(
            [*argv, str(i), src, json.dumps(dataclasses.asdict(model.config))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [process.communicate(timeout=300) for process in processes]
    want = greedy(model)
    for process, (out, err) in zip(processes, results):
        assert process.returncode == 0, err
        result = json.loads(out)
        assert result["compiled"]  # both missed the graph: neither found the other's file
        assert result["timed"] == 0 and "AUTOTUNE" not in err and "Warning" not in err, err
        if compiler._candidate_isas():
            assert result["probes"] == []
        assert result["isa"].split()[0] == result["capability"].lower()  # "avx512 avx512_vnni": AVX512
        assert_same((result["tokens"], result["scores"]), want)
    assert sorted(p.name for p in shared.iterdir()) == sorted(p.name for p in store.iterdir())
    for package in shared.iterdir():
        with zipfile.ZipFile(package) as archive:
            assert archive.testzip() is None
    later = CompiledDecoder(model, store=shared)
    assert_same(greedy(later), want)
    assert later.compile_seconds == 0.0


def test_a_package_is_named_for_the_weights_options_and_code_it_was_compiled_with(
    model, tmp_path, monkeypatch
):
    """Packages hold the weights as constants and the traced code as kernels: another model's weights,
    the same weights read as another architecture (two heads instead of four: no weight shows it), other
    compile options, or other code (an aiayn upgraded or edited in place) must never load a package
    compiled for these."""
    options = {"max_autotune": False}
    copy = Transformer(model.config).eval()
    copy.load_state_dict(model.state_dict())
    assert fingerprint(copy, options) == fingerprint(model, options)
    assert fingerprint(model, {"max_autotune": True}) != fingerprint(model, options)
    two_heads = Transformer(dataclasses.replace(model.config, n_heads=2)).eval()
    two_heads.load_state_dict(model.state_dict())
    assert fingerprint(two_heads, options) != fingerprint(model, options)
    source = tmp_path / "search.py"  # the traced code, as a file of another version
    source.write_text("# one version\n")
    monkeypatch.setattr("aiayn.inference.graph_store.TRACED_CODE", (*TRACED_CODE, str(source)))
    before = fingerprint(model, options)
    source.write_text("# another version\n")
    assert fingerprint(model, options) != before
    with torch.no_grad():
        copy.decoder[0].feed_forward.w_2.bias[0] += 1e-6
    assert fingerprint(copy, options) != fingerprint(model, options)


def test_a_store_that_cannot_be_written_is_a_clear_error(model, tmp_path):
    """AIAYN_COMPILE_STORE naming a file (or a read-only place): a ValueError naming it, before any compile."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    compiled = CompiledDecoder(model, store=blocker / "store", max_autotune=False)
    with pytest.raises(ValueError, match="cannot keep compiled graphs there"):
        search(compiled, sources(1, 5, seed=7), SearchConfig(beam_size=1, max_len_b=5))
    assert compiled.compile_seconds == 0.0


def test_a_store_on_a_full_disk_is_an_error_naming_the_package(model, small_disk):
    """A package that cannot be written (a full disk) is an OSError naming it, which the command line
    says in one line; PyTorch's own package writer, left unfinished by the full disk, aborted the whole
    process when it was collected. Nothing half written stays in the store."""
    store = small_disk / "store"
    filler = fill(small_disk)
    compiled = CompiledDecoder(model, store=store, max_autotune=False)
    logits, log_prob, limit, length = torch.randn(2, V), torch.zeros(2), torch.full((2,), 9), torch.ones(1)
    with (
        pytest.raises(OSError) as error,
        torch.inference_mode(),
    ):  # greedy search's own work: the smallest graph
        compiled.greedy_candidates(logits, log_prob, limit, length.long())
    assert error.value.errno == errno.ENOSPC and error.value.filename.startswith(str(store / "greedy-"))
    assert list(store.iterdir()) == []
    filler.unlink()


def test_ahead_of_time_the_headers_a_compile_asks_for_are_built(compiled):
    """compiler.prepare builds, before a process's first package needs them, the very precompiled headers
    its compile asks inductor for (the same header, flags and options): else its work is lost and the
    compile waits for its own."""
    assert compiled[2] == {compiler._precompiled_header(which) for which in ("wrapper", "kernel")}


def test_a_wrapper_is_split_into_the_part_every_graph_shares_and_its_own(store):
    """A package's wrapper (the C++ that calls its kernels: the store fixture's greedy work) splits into the
    runtime's C interface with the model base class instantiated, built once and shared, and the graph's
    own part, which uses that instantiation instead of making its own; a source laid out otherwise is not
    split."""
    (package,) = store.glob("greedy-2-*.pt2")
    with zipfile.ZipFile(package) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".wrapper.cpp")]
        wrapper = archive.read(name).decode()
    shared, graph = compiler._split_wrapper(wrapper)
    assert "AOTInductorModelContainerCreateWithDevice(" in shared and "::run_impl(" not in shared
    assert (
        "AOTInductorModelContainerCreateWithDevice(" not in graph and "AOTInductorModel::run_impl(" in graph
    )
    assert (
        f"\ntemplate class {compiler._MODEL_BASE};" in shared
        and f"extern template class {compiler._MODEL_BASE};" in graph
    )
    assert compiler._split_wrapper("int main() { return 0; }") is None


@pytest.mark.parametrize("broken", [0, 1], ids=["shared part", "graph's part"])
def test_a_wrapper_whose_parts_do_not_build_is_built_whole(model, tmp_path, monkeypatch, broken):
    """Where either part of a split wrapper does not build (a wrapper laid out otherwise by another
    PyTorch, say), the whole wrapper is built as inductor builds it: the package compiles, loads and
    computes what the eager function does. (Greedy search's own work: the smallest graph. The shared
    part broken is given its own text, so that no object the cache holds is taken for it.)"""
    split = compiler._split_wrapper

    def broken_split(source):
        parts = list(split(source))
        parts[broken] = f"#error not this layout {tmp_path}\n"
        return tuple(parts)

    monkeypatch.setattr(compiler, "_split_wrapper", broken_split)
    compiled = CompiledDecoder(model, store=tmp_path / "store", max_autotune=False)
    generator = torch.Generator().manual_seed(3)
    args = (torch.randn(3, V, generator=generator), torch.zeros(3), torch.full((3,), 9), torch.full((1,), 4))
    with torch.inference_mode():
        got = compiled.greedy_candidates(*args)
    assert compiled.compile_seconds > 0 and len(list((tmp_path / "store").glob("greedy-2-*.pt2"))) == 1
    for a, b in zip(got, greedy_candidates(*args)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
