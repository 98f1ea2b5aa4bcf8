"""What both benchmarks share: the standard workload's shapes and data, the peer models, timing and the GEMM peak."""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from aiayn.inference.search import Decoder, Seq2Seq, WrappedDecoder
from aiayn.precision import cpu_class, cpu_flags, cpu_info

PAD, BOS, EOS = 0, 1, 2

# The benchmarks' standard workload: exactly these shapes, so figures compare across runs.
CONFIGS = {
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6, vocab=10000),
    "small": dict(d_model=256, n_heads=4, d_ff=1024, n_layers=3, vocab=8000),
    # the recipe's for corpora of 10k-200k pairs (config.PRESETS), at its vocabulary size
    "low-resource": dict(d_model=128, n_heads=4, d_ff=512, n_layers=4, vocab=6000),
}


def set_threads(n: int = 2) -> None:
    torch.set_num_threads(n)
    torch.set_num_interop_threads(1)


def random_sentences(n: int, vocab: int, seed: int, lo: int = 8, hi: int = 24) -> list[list[int]]:
    """n token-id lists with lengths uniform{lo..hi}, EOS included as the last token."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi) - 1)] + [EOS] for _ in range(n)]


def pad(rows: list[list[int]], width: int | None = None) -> Tensor:
    width = width or max(len(r) for r in rows)
    out = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def steal_ticks() -> int:
    """Cumulative steal time of the VM (/proc/stat, 8th field): the host taking our CPU."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: a child started by a big
    parent inherits the parent's figure through fork, which would credit every system the same memory."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def gemm_peak(dtype: torch.dtype, sizes: tuple[int, ...] = (2048, 4096), reps: int = 3) -> float:
    """Best measured torch.matmul throughput (GFLOP/s) on square matrices: the hardware limit we compare to."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles) rather than emulating it.
    From the CPU's flags: torch 2.13 has no `torch._C._cpu._is_avx512_bf16_supported` any more."""
    if os.environ.get(ISA_VARIABLE, "native") != "native":  # a cap at AVX2 turns both off
        return False
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) or torch._C._cpu._init_amx()


def alternate(systems: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """Run each system's measurement once per round, A B C A B C ..., after one warm-up round.

    Each callable returns a rate; alternating spreads the machine's noise over all systems alike.
    """
    for fn in systems.values():
        fn()
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(reps):
        for name, fn in systems.items():
            rates[name].append(fn())
    return rates


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --- Peer 1: the plain torch.nn.Transformer model of the tutorials ----------------------------------


class TorchTransformer(nn.Module):
    """The usual tutorial model: nn.Embedding * sqrt(d) + sinusoids, nn.Transformer, a tied Linear."""

    def __init__(
        self, d_model: int, n_heads: int, d_ff: int, n_layers: int, vocab: int, dropout: float = 0.1
    ):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        pe = torch.zeros(1024, d_model)
        pos = torch.arange(1024).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(
            d_model, n_heads, n_layers, n_layers, d_ff, dropout, batch_first=True, activation="relu"
        )
        self.generator = nn.Linear(d_model, vocab, bias=False)
        self.generator.weight = self.embed.weight

    def emb(self, x: Tensor) -> Tensor:
        return self.dropout(self.embed(x) * math.sqrt(self.d_model) + self.pe[: x.size(1)])

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=tgt_in.device)
        h = self.transformer(
            self.emb(src),
            self.emb(tgt_in),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src == PAD,
            tgt_key_padding_mask=tgt_in == PAD,
            memory_key_padding_mask=src == PAD,
        )
        return self.generator(h)

    @torch.no_grad()
    def greedy_recompute(self, src: Tensor, new_tokens: int) -> Tensor:
        """The tutorials' decoding: re-run the decoder over the whole prefix for every new token."""
        memory = self.transformer.encoder(self.emb(src), src_key_padding_mask=src == PAD)
        ys = torch.full((src.size(0), 1), BOS, dtype=torch.long)
        for _ in range(new_tokens):
            causal = nn.Transformer.generate_square_subsequent_mask(ys.size(1))
            h = self.transformer.decoder(
                self.emb(ys), memory, tgt_mask=causal, memory_key_padding_mask=src == PAD
            )
            logits = self.generator(h[:, -1])
            logits[:, EOS] = -float("inf")  # exactly `new_tokens` tokens
            ys = torch.cat([ys, logits.argmax(-1, keepdim=True)], dim=1)
        return ys[:, 1:]


# --- Peer 2: Hugging Face MarianMTModel of the same shape -----------------------------------------------


def marian_config(d_model: int, n_heads: int, d_ff: int, n_layers: int, vocab: int, dropout: float = 0.1):
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=vocab,
        d_model=d_model,
        encoder_layers=n_layers,
        decoder_layers=n_layers,
        encoder_attention_heads=n_heads,
        decoder_attention_heads=n_heads,
        encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff,
        activation_function="relu",
        scale_embedding=True,
        dropout=dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=1024,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        decoder_start_token_id=BOS,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )


def marian_model(shape: dict, dropout: float = 0.1):
    from transformers import MarianMTModel

    return MarianMTModel(marian_config(**shape, dropout=dropout))


class NoEos(WrappedDecoder):
    """A decoder whose outputs never end (EOS gets no probability), so every system decodes exactly the
    same number of tokens in a speed benchmark; every other step is the wrapped decoder's (a compiled
    one's graphs run as they would)."""

    def __init__(self, model: Seq2Seq | Decoder, eos: int = 2):
        super().__init__(model)
        self.eos = eos

    def decode(self, tgt_in: Tensor, memory, cache=None) -> Tensor:
        logits = self.decoder.decode(tgt_in, memory, cache)
        logits[..., self.eos] = float("-inf")
        return logits


def have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --isa: every system of a run capped at one instruction set, so that an AVX-512 machine measures what an
# AVX2 laptop would run: PyTorch's kernels and inductor's generated code (ATEN_CPU_CAPABILITY), oneDNN
# (ONEDNN_MAX_CPU_ISA; no AMX, no VNNI under AVX2), MKL's GEMMs (MKL_ENABLE_INSTRUCTIONS) and CTranslate2
# (CT2_FORCE_CPU_ISA). What a cap cannot make of a CPU: another core's caches, memory bandwidth, clocks
# and execution ports (a Zen 3 is not an AVX-512 Xeon running AVX2 code).
ISA_CAPS = {
    "native": {},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
    },
}
ISA_VARIABLE = "AIAYN_BENCH_ISA"  # set in a capped process, which every child inherits


def cap_isa(isa: str) -> None:
    """Run this benchmark under the cap: the libraries read it when they load, and this process has
    loaded them, so it starts again with the cap's environment (its children inherit it)."""
    if isa == "native" or os.environ.get(ISA_VARIABLE) == isa:  # (a child inherits its parent's cap)
        return
    os.environ.update({**ISA_CAPS[isa], ISA_VARIABLE: isa})
    os.execv(sys.executable, [sys.executable, *sys.argv])


def capped() -> str | None:
    """The instruction set this process is capped at, checked where it can be: PyTorch's kernels and
    inductor's vector code (None: not capped)."""
    isa = os.environ.get(ISA_VARIABLE, "native")
    if isa == "native":
        return None
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    aten, inductor = torch.backends.cpu.get_cpu_capability(), str(pick_vec_isa())
    if aten.lower() != isa or inductor != isa:
        raise SystemExit(f"the {isa} cap did not take: PyTorch's kernels {aten}, inductor's {inductor}")
    return isa


def machine() -> str:
    """The CPU as a figure must name it: the VM's model name alone ("AMD EPYC") does not tell a Zen 4
    (family 25) from a Zen 5 (family 26), so family and model, the widest vector instructions and whether
    bf16 is native come with it."""
    info, flags = cpu_info(), cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    cpu = (
        f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')} model "
        f"{info.get('model', '?')}, {isa}, bf16 {'native' if native_bf16() else 'emulated'})"
    )
    amx = "yes" if torch._C._cpu._init_amx() else "no"
    cap = capped()
    if cap:  # the checked kernels, and what the cap turns off
        return (f"{os.cpu_count()} cores, {cpu}, torch {torch.__version__}, capped at {cap.upper()} (AMX, VNNI and "
                f"AVX-512 off), CPU class {cpu_class()}")  # fmt: skip
    return f"{os.cpu_count()} cores, {cpu}, torch {torch.__version__}, AMX {amx}, CPU class {cpu_class()}"


def save_results(path: str | Path | None, summary: dict) -> None:
    """The run's summary (the JSON line it prints) with today's date, written atomically to path: the
    README's tables are rendered from these files (benchmarks/tables.py)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    dated = {"date": today, "cpu_class": cpu_class(), **summary}  # whose defaults and routes it measured
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(dated, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
