"""An output-layer shortlist: the target tokens a batch may produce, chosen from its source tokens.

The vocabulary projection costs V x D multiply-adds per output token, a third of a small model's
decoding step. As CTranslate2's vocabulary map (`use_vmap`) and Marian's lexical shortlists do, a batch
computes it only for its candidates: the most frequent target tokens, plus for each of its source tokens
the target tokens that occur most with it in the training pairs (by the Dice coefficient
2 c(s, t) / (c(s) + c(t)) over sentence pairs). Other tokens get probability 0; search is unchanged.

Saved as CTranslate2's vmap.txt (one rule per line, `source token<TAB>target tokens` separated by
spaces; the empty source names the tokens always allowed), so `aiayn export` hands the same file on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from aiayn.files import write_text
from aiayn.inference.search import Decoder, Seq2Seq, WrappedDecoder
from aiayn.model import Memory
from aiayn.tokenizer import EOS_ID, PAD_ID, SPECIAL_TOKENS, Tokenizer

VMAP_FILE = "vmap.txt"
ALWAYS_SPECIALS = tuple(i for i in SPECIAL_TOKENS if i != PAD_ID)  # bos, eos, unk (CTranslate2's too)


@dataclass(frozen=True)
class Shortlist:
    """always (A,) target ids every batch may produce; by_source (V_src, K) the K best target ids of each
    source id, padded with EOS (always allowed anyway)."""

    always: Tensor
    by_source: Tensor

    def candidates(self, src: Tensor) -> Tensor:
        """src (B, S) source ids -> (V',) sorted target ids this batch may produce."""
        by_source = self.by_source.to(src.device)
        return torch.cat([self.always.to(src.device), by_source[src].flatten()]).unique()  # (V',)

    @classmethod
    def learn(
        cls,
        src: list[np.ndarray],
        tgt: list[np.ndarray],
        src_vocab_size: int,
        tgt_vocab_size: int,
        per_token: int = 20,
        frequent: int = 100,
    ) -> Shortlist:
        """From training pairs of ids: the `frequent` most frequent target tokens (by sentences they occur
        in), and for each source token the `per_token` target tokens of the highest Dice coefficient."""
        if per_token < 1 or frequent < 0:
            raise ValueError(f"per_token must be >= 1 and frequent >= 0, got {per_token} and {frequent}")
        s_count = np.zeros(src_vocab_size, dtype=np.int64)  # sentences each source id occurs in
        t_count = np.zeros(tgt_vocab_size, dtype=np.int64)
        keys, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)  # s * V_tgt + t, c(s, t)
        for start in range(0, len(src), 50_000):  # chunks keep the pairs of pairs in memory bounds
            s_sent, s_ids = _unique_per_sentence(src[start : start + 50_000])
            t_sent, t_ids = _unique_per_sentence(tgt[start : start + 50_000])
            np.add.at(s_count, s_ids, 1)
            np.add.at(t_count, t_ids, 1)
            n = len(src[start : start + 50_000])
            t_start = np.searchsorted(t_sent, np.arange(n))  # first target of each sentence
            t_len = np.bincount(t_sent, minlength=n)
            repeat = t_len[s_sent]  # each source id meets every target id of its sentence
            first = np.repeat(t_start[s_sent], repeat)
            offset = np.arange(repeat.sum()) - np.repeat(np.cumsum(repeat) - repeat, repeat)
            pair = np.repeat(s_ids.astype(np.int64), repeat) * tgt_vocab_size + t_ids[first + offset]
            keys, inverse = np.unique(np.concatenate([keys, pair]), return_inverse=True)
            counts = np.bincount(inverse, weights=np.concatenate([counts, np.ones(len(pair))])).astype(
                np.int64
            )
        s, t = keys // tgt_vocab_size, keys % tgt_vocab_size
        dice = 2 * counts / (s_count[s] + t_count[t])
        order = np.lexsort((t, -dice, s))  # by source id, then best first (ties: lower target id)
        s, t = s[order], t[order]
        rank = np.arange(len(s)) - np.searchsorted(s, s)  # place within its source id's list
        keep = rank < per_token
        by_source = np.full((src_vocab_size, per_token), EOS_ID, dtype=np.int64)
        by_source[s[keep], rank[keep]] = t[keep]
        by_frequency = [i for i in np.argsort(-t_count, kind="stable") if t_count[i] > 0 and i != PAD_ID]
        always = sorted({*ALWAYS_SPECIALS, *(int(i) for i in by_frequency[:frequent])})
        return cls(torch.tensor(always), torch.from_numpy(by_source))

    def save(self, path: str | Path, tokenizer: Tokenizer) -> None:
        """CTranslate2's vmap.txt: the always-allowed tokens after an empty source, then one rule per
        source token that has targets."""
        src_tokens, tgt_tokens = tokenizer.src_tokens(), tokenizer.tgt_tokens()
        lines = ["\t" + " ".join(tgt_tokens[i] for i in self.always.tolist())]
        for s, targets in enumerate(self.by_source.tolist()):
            targets = [t for t in dict.fromkeys(targets) if t != EOS_ID]
            if targets and s not in SPECIAL_TOKENS:
                lines.append(src_tokens[s] + "\t" + " ".join(tgt_tokens[t] for t in targets))
        write_text(path, "\n".join(lines) + "\n")

    @classmethod
    def load(cls, path: str | Path, tokenizer: Tokenizer) -> Shortlist:
        """A vmap.txt of single-token rules (what `save` writes; longer source n-grams are refused)."""
        src_ids = {token: i for i, token in enumerate(tokenizer.src_tokens())}
        tgt_ids = {token: i for i, token in enumerate(tokenizer.tgt_tokens())}
        always, rules = set(ALWAYS_SPECIALS), {}
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read the shortlist ({e})") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            source, tab, targets = line.partition("\t")
            if not tab or " " in source:
                raise ValueError(
                    f"{path}, line {number}: expected one source token, a tab and target tokens, got {line[:80]!r}"
                )
            ids = []
            for token in targets.split(" "):
                if token not in tgt_ids:
                    raise ValueError(f"{path}, line {number}: {token!r} is not in the target vocabulary")
                ids.append(tgt_ids[token])
            if source == "":
                always.update(ids)
            elif source not in src_ids:
                raise ValueError(f"{path}, line {number}: {source!r} is not in the source vocabulary")
            else:
                rules[src_ids[source]] = ids
        width = max((len(ids) for ids in rules.values()), default=1)
        by_source = torch.full((tokenizer.src_vocab_size, width), EOS_ID, dtype=torch.long)
        for s, ids in rules.items():
            by_source[s, : len(ids)] = torch.tensor(ids)
        return cls(torch.tensor(sorted(always)), by_source)


def load_shortlist(directory: str | Path, tokenizer: Tokenizer) -> Shortlist:
    """A model directory's shortlist (its vmap.txt), or a ValueError saying how to make one."""
    path = Path(directory) / VMAP_FILE
    if not path.is_file():
        raise ValueError(f"{directory} has no {VMAP_FILE}: make one with `aiayn shortlist {directory}`")
    return Shortlist.load(path, tokenizer)


class Shortlisted(WrappedDecoder):
    """A decoder (eager, or compiled.CompiledDecoder) whose batches decode only their shortlist's
    candidates: the memory of each batch names them, its cache gathers their output rows. Every other step
    is the wrapped decoder's, the search's own work included (a compiled one keeps its graphs)."""

    def __init__(self, decoder: Seq2Seq | Decoder, shortlist: Shortlist):
        super().__init__(decoder)
        self.shortlist = shortlist

    def encode(self, src: Tensor) -> Memory:
        memory = self.decoder.encode(src)
        memory.vocabulary = self.shortlist.candidates(src)  # (V',)
        return memory


def _unique_per_sentence(sentences: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids of each sentence: (sentence index, id) pairs sorted by sentence, then id."""
    lengths = np.array([len(x) for x in sentences], dtype=np.int64)
    ids = np.concatenate(sentences).astype(np.int64) if len(sentences) else np.zeros(0, dtype=np.int64)
    sentence = np.repeat(np.arange(len(sentences)), lengths)
    width = int(ids.max(initial=0)) + 1
    key = np.unique(sentence * width + ids)
    return key // width, key % width
