"""The compiled graphs' store (compiled.py): AOTInductor packages that a later process loads instead of
compiling, named for everything they were compiled from. Apart from test_compiled.py so that the two
compile-heavy files run on two workers."""

import dataclasses
import errno

import pytest
import torch
from conftest import EOS_HEAVY_V as V
from conftest import eos_heavy_model, fill, fused_attention_calls, sources

from aiayn.config import SearchConfig, preset
from aiayn.inference.compiled import TRACED_CODE, CompiledDecoder, fingerprint
from aiayn.inference.search import search
from aiayn.model import Transformer


@pytest.fixture(scope="module")
def model():
    return eos_heavy_model()


def test_a_store_serves_a_later_decoder_without_compiling(model, tmp_path):
    """Graphs exported to a store (AOTInductor packages) give eager's hypotheses, and a decoder made later
    over a fresh copy of the model (a second process, as far as it can tell) loads them instead of
    compiling: the cached second run of `--compile`. Greedy over 3 sentences and beam 4 over 1 are both 4
    rows, but two steps (cross-attention keys/values of 4 rows and of 1): one must not run the other's.
    (One sentence, so one beam graph: each package costs the suite seconds of C++ compiling.)"""

    def check(decoder, width):
        for batch, beam in ((3, 1), (1, 4)):
            src = sources(batch, width, seed=batch + width)
            config = SearchConfig(beam_size=beam, n_best=beam, max_len_b=20)
            want = [[h.tokens for h in hyps] for hyps in search(model, src, config)]
            assert [[h.tokens for h in hyps] for hyps in search(decoder, src, config)] == want

    first = CompiledDecoder(model, store=tmp_path, max_autotune=False)
    check(first, 9)
    assert first.compile_seconds > 0
    # encoder, cross keys/values and step, for 4 sentences and for 1; beam search's own work for 1,
    # greedy search's for 3 and fewer live sentences and for 1
    assert (
        sorted(p.name.split("-")[0] for p in tmp_path.glob("*.pt2"))
        == ["beam"] + ["cross"] * 2 + ["encoder"] * 2 + ["greedy"] * 2 + ["step"] * 2
    )
    copy = Transformer(preset("tiny", vocab_size=V)).eval()
    copy.load_state_dict(model.state_dict())
    later = CompiledDecoder(copy, store=tmp_path, max_autotune=False)
    for width in (9, 15):  # the source length is dynamic in the packages too
        check(later, width)
    assert later.compile_seconds == 0.0 and later.load_seconds > 0
    # the packages compute attention as its arithmetic too (test_on_a_cpu_compiled_graphs_write_attention_out)
    assert fused_attention_calls(later, sources(3, 9, seed=1), SearchConfig(beam_size=1, max_len_b=8)) == 0


def test_a_package_is_named_for_the_weights_options_and_code_it_was_compiled_with(
    model, tmp_path, monkeypatch
):
    """Packages hold the weights as constants and the traced code as kernels: another model's weights,
    the same weights read as another architecture (two heads instead of four: no weight shows it), other
    compile options, or other code (an aiayn upgraded or edited in place) must never load a package
    compiled for these."""
    options = {"max_autotune": False}
    copy = Transformer(preset("tiny", vocab_size=V)).eval()
    copy.load_state_dict(model.state_dict())
    assert fingerprint(copy, options) == fingerprint(model, options)
    assert fingerprint(model, {"max_autotune": True}) != fingerprint(model, options)
    two_heads = Transformer(dataclasses.replace(model.config, n_heads=2)).eval()
    two_heads.load_state_dict(model.state_dict())
    assert fingerprint(two_heads, options) != fingerprint(model, options)
    source = tmp_path / "search.py"  # the traced code, as a file of another version
    source.write_text("# one version\n")
    monkeypatch.setattr("aiayn.inference.compiled.TRACED_CODE", (*TRACED_CODE, str(source)))
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
    with pytest.raises(OSError) as error:
        search(compiled, sources(1, 9, seed=2), SearchConfig(beam_size=1, max_len_b=5))
    assert error.value.errno == errno.ENOSPC and error.value.filename.startswith(str(store / "encoder-"))
    assert list(store.iterdir()) == []
    filler.unlink()
