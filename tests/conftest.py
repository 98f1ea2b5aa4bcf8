"""Shared test settings and helpers: one thread (tiny models run faster without threading overhead
on 2 cores), running the CLI in-process, and checking its one-line errors."""

import contextlib
import gzip
import io
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from aiayn.cli.main import main
from aiayn.config import SearchConfig, preset
from aiayn.data.prepare import MANIFEST, open_prepared, prepare_corpus
from aiayn.data.synthetic import generate
from aiayn.inference.search import FIRST_OUTPUT, search
from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from aiayn.training.run import Run
from aiayn.training.train import Result, train

torch.set_num_threads(1)
# ... and one in the processes the tests start (the CLI, servers, their workers), unless a test says
# otherwise: `make test` keeps a worker busy on each core, and a process of two threads beside them
# spins on a core that is not free.
os.environ["OMP_NUM_THREADS"] = "1"

# Files that take longest (compiling graphs, starting processes), scheduled first: `make test` gives each
# of its workers a file at a time, and a long file started last would run on alone at the end.
LONGEST_FIRST = (
    "inference/test_compiled_store.py",
    "inference/test_compiled.py",
    "training/test_distributed.py",
    "serving/test_server.py",
    "test_faults.py",
    "inference/test_translate.py",
    "training/test_demo.py",
    "interop/test_keras_model.py",
    "interop/test_ctranslate2.py",
    "interop/test_huggingface.py",
)


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(tests).as_posix(), len(rank)))


@pytest.fixture(scope="session", autouse=True)
def compile_store(tmp_path_factory) -> Iterator[Path]:
    """The test run's own store of compiled graphs (AIAYN_COMPILE_STORE, which subprocesses inherit), empty
    at the start and shared by the run's workers (`make test`'s -n): no test reads or writes the user's
    ~/.cache/aiayn/compiled, a graph one test compiled another loads, and a command given neither
    --compile nor --no-compile finds none of its model's graphs there unless a test compiled them."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's directory is in the run's
        root = root.parent
    store = root / "compile-store"
    store.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIAYN_COMPILE_STORE", str(store))
        yield store


def run_cli(argv: list) -> tuple[int, str, str]:
    """aiayn's main() in this process; (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, stderr: str, *needles: str) -> None:
    """Exit status 2, no traceback, exactly one `aiayn: error:` line, last, holding every needle."""
    assert code == 2 and "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("aiayn: error: ")]
    assert len(errors) == 1 and stderr.rstrip("\n").endswith(errors[0]), stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def train_argv(prefix, out, *extra) -> list:
    """`aiayn train` on PREFIX.en / PREFIX.xx into OUT, quietly, with `extra` flags after (they win)."""
    return [
        "train",
        "--train",
        prefix,
        "--src-lang",
        "en",
        "--tgt-lang",
        "xx",
        "--out",
        out,
        "--quiet",
        *extra,
    ]


def run_train(
    out, model_config, train_config, tokenizer, corpus, mode: str = "new", device="cpu", **kwargs
) -> Result:
    """train() into OUT on the device (the CPU unless told), quietly, opening OUT as `aiayn train` with
    that mode would: the corpus is prepared into OUT/data with this tokenizer (or, resuming, OUT/data is used)."""
    run = Run.open(out, mode, progress=False)
    if run.resuming and (run.data_dir / MANIFEST).is_file():
        data = open_prepared(run.data_dir)
    else:
        data = prepare_corpus(run.data_dir, corpus, tokenizer=tokenizer, say=lambda line: None)
    return train(run, model_config, train_config, data, device=torch.device(device), **kwargs)


@pytest.fixture(scope="session")
def served_model(tmp_path_factory):
    """A tiny model of one layer a side (its graphs compile in about half the time of two) trained for 60
    updates on the synthetic task (outputs end, and depend on the input): what the server and page tests
    serve."""
    from aiayn.config import TrainConfig, preset
    from aiayn.data.corpus import Corpus
    from aiayn.data.synthetic import generate
    from aiayn.tokenizer import Tokenizer

    src, tgt = generate(400, seed=21)
    out = tmp_path_factory.mktemp("served") / "model"
    tokenizer = Tokenizer.train(src, tgt, vocab_size=400)
    config = preset("tiny", vocab_size=tokenizer.src_vocab_size, n_encoder_layers=1, n_decoder_layers=1)
    cfg = TrainConfig(max_updates=60, max_tokens=800, warmup_steps=20, lr_scale=2.0, dtype="fp32")
    run_train(out, config, cfg, tokenizer, Corpus(src, tgt))
    return out


class RecordingSGD(torch.optim.SGD):
    """SGD (the update is proportional to the gradient, so a scale error shows) recording each update's
    gradients (train_step drops them after the step)."""

    def __init__(self, model):
        super().__init__(model.parameters(), lr=0.1)
        self.model, self.grads = model, []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for p in self.model.parameters()])
        return super().step(closure)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_parallel(prefix: Path, src: list[str], tgt: list[str]) -> Path:
    """PREFIX.en and PREFIX.xx, a line a sentence."""
    for lang, lines in (("en", src), ("xx", tgt)):
        write_lines(Path(f"{prefix}.{lang}"), lines)
    return prefix


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- Compiled decoding: a model whose outputs end at different steps -----------------------------------

EOS_HEAVY_V = 60  # the eos_heavy_model's vocabulary


def eos_heavy_model(layers: int = 1) -> Transformer:
    """A random tiny model shaped like an imported OPUS-MT one (swish, an output bias), whose EOS output row
    is scaled up: its greedy outputs end after 0 to 29 tokens, or run to the limit. Its output layer is its
    own (untied): a tied random model feeds back the token it chose and repeats it to the limit. One layer a
    side unless told (the compiling tests': a graph of one compiles in about half the time of two); the
    seeds are ones whose outputs have many lengths."""
    torch.manual_seed({1: 4, 2: 1}[layers])
    config = preset("tiny", vocab_size=EOS_HEAVY_V, n_encoder_layers=layers, n_decoder_layers=layers,
                    share_embeddings=False, tie_output=False, activation="swish", output_bias=True)  # fmt: skip
    model = Transformer(config).eval()
    with torch.no_grad():
        model.generator.weight[EOS_ID] *= 1.5
        model.generator.bias.normal_(0.0, 0.5)
    return model


def word_tokenizer(src_size: int, tgt_size: int) -> Tokenizer:
    """A word tokenizer with exactly these vocabulary sizes (one, joint, when they are equal)."""
    words = [f"w{i}" for i in range(max(src_size, tgt_size))]
    joint = src_size == tgt_size
    src = [" ".join(words[: src_size - 4])]
    tgt = [" ".join(words[: tgt_size - 4])]
    tokenizer = Tokenizer.train(src, tgt if not joint else src, vocab_size=max(src_size, tgt_size), kind="word",
                                min_frequency=1, joint=joint)  # fmt: skip
    assert (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) == (src_size, tgt_size)
    return tokenizer


# The synthetic task's sentences, and lines to translate of them: long and short mixed, empty lines
# among them (not in order of length)
TASK_SRC, TASK_TGT = generate(120, seed=2)
MIXED = [
    TASK_SRC[0],
    "",
    " ".join(TASK_SRC[1:4]),
    "Dogs run.",
    TASK_SRC[4],
    " ".join(TASK_SRC[5:9]),
    "A cat.",
    "",
    TASK_SRC[9],
]


def one_layer_model(tokenizer: Tokenizer) -> Transformer:
    """A random model of one layer a side for the tokenizer (the compiling tests' graphs compile in about
    half the time of two layers)."""
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=tokenizer.src_vocab_size, d_model=32, d_ff=64, dropout=0.1,
                    n_encoder_layers=1, n_decoder_layers=1)  # fmt: skip
    return Transformer(config).eval()


@pytest.fixture(scope="module")
def task_tokenizer() -> Tokenizer:
    """A vocabulary of the synthetic task's sentences (TASK_SRC, TASK_TGT)."""
    return Tokenizer.train(TASK_SRC, TASK_TGT, vocab_size=300)


@pytest.fixture(scope="module")
def task_model(task_tokenizer) -> Transformer:
    return one_layer_model(task_tokenizer)


def naive_greedy(model: Transformer, ids: list[int], max_len: int) -> list[int]:
    """Re-run the whole decoder on the whole prefix at every step (no cache, no batch), argmax each time."""
    src = torch.tensor([ids])  # (1, S)
    out = [BOS_ID]
    with torch.no_grad():
        while len(out) - 1 < max_len:
            token = FIRST_OUTPUT + int(model(src, torch.tensor([out]))[0, -1, FIRST_OUTPUT:].argmax())
            if token == EOS_ID:
                break
            out.append(token)
    return out[1:]


def sources(batch: int, width: int, seed: int) -> torch.Tensor:
    """(batch, width) ids of the eos_heavy_model's vocabulary, every other sentence padded after half its
    width."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(4, EOS_HEAVY_V, (batch, width), generator=generator)
    src[1::2, width // 2 :] = PAD_ID
    return src


def fused_attention_calls(decoder, src: torch.Tensor, config: SearchConfig) -> int:
    """How many times a search with decoder calls PyTorch's SDPA operator (the profiler records every
    ATen operator call, an AOTInductor package's included; inductor's own kernels are not operators)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        search(decoder, src, config)
    return sum(event.count for event in profile.key_averages() if "scaled_dot_product" in event.key)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 16 MB tmpfs at tmp_path/disk: mounting needs root (CI runs as root); skipped where it is refused."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small disk needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Write zeros into disk/filler until the disk is full; removing it gives the space back."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


# --- OPUS-MT-shaped directories (transformers' Marian with SentencePiece vocabularies) ------------

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
TAGS = (">>de<<", ">>fr<<")  # OPUS-MT's target-language tags: tokens of their own at a text's start


def multi30k_lines(name: str, count: int, skip: int = 0) -> list[str]:
    with gzip.open(MULTI30K / name, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(skip + count), f)][skip:]


def train_spm(texts: list[str], byte_fallback: bool) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=300, model_type="unigram",
        byte_fallback=byte_fallback, character_coverage=0.98, minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


def opus_vocab(models: list[bytes]) -> dict[str, int]:
    """OPUS-MT's order: </s> 0, <unk> 1, the pieces (some left out: a piece the corpus never showed is
    <unk>), the language tags, <pad> last."""
    import sentencepiece as spm

    pieces: list[str] = []
    for model in models:
        sp = spm.SentencePieceProcessor(model_proto=model)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)) and sp.id_to_piece(i) not in pieces:
                pieces.append(sp.id_to_piece(i))
    pieces = [p for k, p in enumerate(pieces) if k % 40 != 7]
    return {p: i for i, p in enumerate(["</s>", "<unk>", *pieces, *TAGS, "<pad>"])}


def opus_mt_directory(directory: Path, *, shared: bool, activation: str, dtype: torch.dtype) -> Path:
    """An OPUS-MT-shaped directory: English source.spm, German target.spm (byte fallback), one vocab.json
    or two (separate_vocabs; of one size, as transformers' Marian needs), a MarianMTModel whose pad is its
    decoder start, a non-zero final_logits_bias, saved in dtype, and OPUS-MT's generation config."""
    import transformers

    directory.mkdir()
    models = [
        train_spm(multi30k_lines("train.en.gz", 2000), False),
        train_spm(multi30k_lines("train.de.gz", 2000), True),
    ]
    (directory / "source.spm").write_bytes(models[0])
    (directory / "target.spm").write_bytes(models[1])
    vocab = opus_vocab(models)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    extra = {}
    if not shared:  # the target's own order: the same pieces, reversed between the specials
        middle = [p for p in vocab if p not in ("</s>", "<unk>", "<pad>")][::-1]
        target = {p: i for i, p in enumerate(["</s>", "<unk>", *middle, "<pad>"])}
        (directory / "target_vocab.json").write_text(json.dumps(target, ensure_ascii=False))
        extra = {"separate_vocabs": True, "target_vocab_file": str(directory / "target_vocab.json")}
    tokenizer = transformers.MarianTokenizer(
        str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json"), **extra
    )
    V = len(vocab)
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=128,
        activation_function=activation, pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0,
        share_encoder_decoder_embeddings=shared, tie_word_embeddings=shared, scale_embedding=True,
    )  # fmt: skip
    hf = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        hf.final_logits_bias.normal_(0.0, 1.0)
    hf.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[V - 1]], bos_token_id=0, decoder_start_token_id=V - 1, eos_token_id=0, max_length=128,
        num_beams=4, pad_token_id=V - 1,
    )  # fmt: skip
    hf.to(dtype).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
