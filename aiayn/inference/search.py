"""Greedy and beam search over token ids (knows nothing about text).

Shapes: B sentences still being searched (finished ones are dropped), S source length,
T target tokens so far, N beam, K = 2N candidates per sentence, V vocabulary.

The contract, the same for greedy and beam search:
- src (B, S) is padded with the pad id (tokenizer.py); output starts from BOS and ends at EOS;
  results come back in input order.
- Each sentence may produce at most floor(a * its non-pad source length + b) tokens, EOS included
  (SearchConfig.max_len_a/max_len_b; §6.1 "input length + 50"). A hypothesis that reaches that
  length without EOS is finished there.
- One decoder position per step on the model's key/value cache; log-softmax in float32; sentences
  that are done leave the batch, so no work is spent on them.
- Scores are log-probabilities divided by a length penalty lp(|Y|), where |Y| counts the EOS token.
- PAD and BOS are never output (transformers' bad_words_ids for Marian's pad); their probabilities stay
  inside the softmax, so a score is the model's log-probability.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.config import SearchConfig
from aiayn.model import DecoderCache, Memory
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID

# The first id an output may hold: below it, PAD and BOS, which are inputs only.
FIRST_OUTPUT = EOS_ID
assert {PAD_ID, BOS_ID} == set(range(FIRST_OUTPUT)), "the ids search never outputs come first"


class Seq2Seq(Protocol):
    """The narrow model interface search uses: `Transformer` has it; the tests script a toy one."""

    def encode(self, src: Tensor) -> Memory: ...

    def new_cache(self, memory: Memory, max_len: int) -> DecoderCache: ...

    def decode(self, tgt_in: Tensor, memory: Memory | None, cache: DecoderCache | None = None) -> Tensor: ...


class GreedyStep(NamedTuple):
    """What one greedy step's tensor work gives (greedy_candidates)."""

    token: Tensor  # (B,) the most probable next token of each live sentence
    log_prob: Tensor  # (B,) its summed log-probability, that token's included
    done: Tensor  # (B,) the sentences that end now (EOS, or their maximum length)
    any_done: Tensor  # () whether there is one


class BeamLive(NamedTuple):
    """What one beam step's tensor work reads of the live sentences (BeamState holds it)."""

    scores: Tensor  # (B, N) summed log-probabilities of the live hypotheses, float32
    limit: Tensor  # (B,) maximum output length, EOS included
    limit_penalty: Tensor  # (B,) lp(limit)
    best_finished: Tensor  # (B, n_best) the best finished scores, descending; -inf where there are fewer
    n_finished: Tensor  # (B,) finished hypotheses so far


class BeamStep(NamedTuple):
    """What one beam step's tensor work gives (beam_candidates); K = 2N candidates a sentence."""

    top: Tensor  # (B, K) candidate log-probabilities, best first
    parent: Tensor  # (B, K) the row in the batch each extends
    token: Tensor  # (B, K)
    final: Tensor  # (B, K) the finished ones
    penalised: Tensor  # (B, K) top / lp(length)
    best_finished: Tensor  # (B, n_best) the new best finished scores
    n_finished: Tensor  # (B,)
    scores: Tensor  # (B, N) of the live hypotheses
    live_parent: Tensor  # (B, N)
    live_token: Tensor  # (B, N)
    done: Tensor  # (B,) sentences that are done
    flags: Tensor  # (2,) whether any candidate is final, whether any sentence is done


class Decoder(ABC):
    """What search runs: the model's three steps (Seq2Seq) and the search's own tensor work after each
    decoding step. EagerDecoder runs a model as it is; compiled.CompiledDecoder runs each as a graph; a
    wrapper of a decoder (shortlist.Shortlisted) passes on all five, or cannot be made (abstract)."""

    @abstractmethod
    def encode(self, src: Tensor) -> Memory: ...

    @abstractmethod
    def new_cache(self, memory: Memory, max_len: int) -> DecoderCache: ...

    @abstractmethod
    def decode(self, tgt_in: Tensor, memory: Memory | None, cache: DecoderCache | None = None) -> Tensor: ...

    @abstractmethod
    def greedy_candidates(
        self, logits: Tensor, log_prob: Tensor, limit: Tensor, length: Tensor
    ) -> GreedyStep:
        """search.greedy_candidates, or what computes the same."""

    @abstractmethod
    def beam_candidates(
        self,
        logits: Tensor,
        live: BeamLive,
        length: Tensor,
        n_best: int,
        alpha: float,
        kind: str,
        stopping: str,
    ) -> BeamStep:
        """search.beam_candidates, or what computes the same."""


class EagerDecoder(Decoder):
    """A model (Transformer, or a test's scripted one) run as it is, with the search's work in eager PyTorch."""

    def __init__(self, model: Seq2Seq):
        self.model = model

    def encode(self, src: Tensor) -> Memory:
        return self.model.encode(src)

    def new_cache(self, memory: Memory, max_len: int) -> DecoderCache:
        return self.model.new_cache(memory, max_len)

    def decode(self, tgt_in: Tensor, memory: Memory | None, cache: DecoderCache | None = None) -> Tensor:
        return self.model.decode(tgt_in, memory, cache)

    def greedy_candidates(
        self, logits: Tensor, log_prob: Tensor, limit: Tensor, length: Tensor
    ) -> GreedyStep:
        return greedy_candidates(logits, log_prob, limit, length)

    def beam_candidates(
        self,
        logits: Tensor,
        live: BeamLive,
        length: Tensor,
        n_best: int,
        alpha: float,
        kind: str,
        stopping: str,
    ) -> BeamStep:
        return beam_candidates(logits, live, length, n_best, alpha, kind, stopping)


class WrappedDecoder(Decoder):
    """A decoder around another that passes every step on to it, the search's own work included; a
    subclass changes only the steps it is about (shortlist.Shortlisted the memory of a batch)."""

    def __init__(self, decoder: Seq2Seq | Decoder):
        self.decoder = as_decoder(decoder)

    def encode(self, src: Tensor) -> Memory:
        return self.decoder.encode(src)

    def new_cache(self, memory: Memory, max_len: int) -> DecoderCache:
        return self.decoder.new_cache(memory, max_len)

    def decode(self, tgt_in: Tensor, memory: Memory | None, cache: DecoderCache | None = None) -> Tensor:
        return self.decoder.decode(tgt_in, memory, cache)

    def greedy_candidates(
        self, logits: Tensor, log_prob: Tensor, limit: Tensor, length: Tensor
    ) -> GreedyStep:
        return self.decoder.greedy_candidates(logits, log_prob, limit, length)

    def beam_candidates(
        self,
        logits: Tensor,
        live: BeamLive,
        length: Tensor,
        n_best: int,
        alpha: float,
        kind: str,
        stopping: str,
    ) -> BeamStep:
        return self.decoder.beam_candidates(logits, live, length, n_best, alpha, kind, stopping)


def as_decoder(model: Seq2Seq | Decoder) -> Decoder:
    """A decoder as it is; a model (the Seq2Seq interface alone) run eagerly."""
    return model if isinstance(model, Decoder) else EagerDecoder(model)


@dataclass
class Hypothesis:
    """One finished output."""

    tokens: list[int]  # without BOS and without the final EOS
    score: float  # log_prob / length_penalty: what hypotheses are ranked by
    log_prob: float  # sum of the token log-probabilities, EOS included when it was produced


def length_penalty(length: int | Tensor, alpha: float, kind: str = "gnmt") -> float | Tensor:
    """lp(|Y|), which a hypothesis' log-probability is divided by; |Y| counts EOS (as fairseq does).

    gnmt: ((5 + |Y|) / 6)^alpha, Wu et al. 2016 (eq. 14), what the paper used with alpha 0.6 (§6.1).
    average: |Y|^alpha, as fairseq and Hugging Face (a deviation, see docs/deviations.md).
    """
    if isinstance(length, Tensor):
        length = length.float()
    if kind == "gnmt":
        return ((5 + length) / 6) ** alpha
    if kind == "average":
        return length**alpha
    raise ValueError(f"unknown length penalty {kind!r}; choose 'gnmt' or 'average'")


def max_lengths(src: Tensor, config: SearchConfig) -> Tensor:
    """(B,) most output tokens per sentence, EOS included: floor(a * source length + b) (§6.1)."""
    src_len = (src != PAD_ID).sum(dim=1).tolist()  # in Python floats: exact for any a and b
    limit = [config.max_length(n) for n in src_len]
    return torch.tensor(limit, dtype=torch.long, device=src.device)  # (B,)


def _limits(max_len: Tensor | int, src: Tensor) -> Tensor:
    """max_len as (B,) on src's device, checked."""
    if src.dim() != 2:
        raise ValueError(f"src must be (batch, source length) token ids, got shape {tuple(src.shape)}")
    B = src.size(0)
    if isinstance(max_len, int):
        limit = torch.full((B,), max_len, dtype=torch.long, device=src.device)  # (B,)
    else:
        limit = max_len.to(device=src.device, dtype=torch.long)
        if limit.shape != (B,):
            raise ValueError(f"max_len must be an int or a ({B},) tensor, got shape {tuple(limit.shape)}")
    if B and int(limit.min()) < 1:
        raise ValueError(f"every maximum output length must be at least 1, got {limit.tolist()}")
    return limit


# --- Greedy ----------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_search(model: Seq2Seq | Decoder, src: Tensor, *, max_len: Tensor | int) -> list[list[int]]:
    """The most probable next token at every step; tokens without BOS and EOS, in input order.

    max_len: an int for every sentence or a (B,) tensor (`max_lengths` computes the §6.1 one).
    """
    return [h.tokens for h in _greedy(model, src, _limits(max_len, src), 0.0, "gnmt")]


def _greedy(
    model: Seq2Seq | Decoder, src: Tensor, limit: Tensor, alpha: float, kind: str
) -> list[Hypothesis]:
    B = src.size(0)
    if B == 0:
        return []
    model = as_decoder(model)
    T = int(limit.max())
    memory = model.encode(src)  # states (B, S, D)
    cache = model.new_cache(memory, T)  # T decoder positions: BOS and the first T-1 outputs
    rows = torch.arange(B, device=src.device)  # (B,) input position of each live sentence
    out = src.new_full((B, T), PAD_ID)  # (B, T) all sentences, live or done
    log_prob = torch.zeros(B, device=src.device)  # (B,) float32, all sentences; set when one stops
    length = limit.clone()  # (B,) tokens produced, EOS included; set when a sentence stops
    live_log_prob, live_limit = log_prob.clone(), limit  # (B,) of the live sentences
    produced = torch.ones(1, dtype=torch.long, device=src.device)  # (1,) t + 1
    last = src.new_full((B, 1), BOS_ID)  # (B, 1)
    for t in range(T):
        logits = model.decode(last, None, cache)[:, -1]  # (B, V); the cache holds what it needs of memory
        token, live_log_prob, done, any_done = model.greedy_candidates(
            logits, live_log_prob, live_limit, produced
        )
        out[rows, t] = token
        produced += 1
        if bool(any_done):  # the step's one sync
            length[rows[done]] = t + 1
            log_prob[rows[done]] = live_log_prob[done]
            keep = (~done).nonzero().squeeze(1)  # (B',)
            if keep.numel() == 0:
                break
            cache.reorder(keep, sentences=keep)  # the finished sentences leave the batch
            rows, token = rows[keep], token[keep]  # (B',)
            live_log_prob, live_limit = live_log_prob[keep], live_limit[keep]
        last = token[:, None]  # (B, 1)
    penalty = length_penalty(length, alpha, kind)  # (B,)
    score = (log_prob / penalty).tolist()
    results = []
    for tokens, n, lp, s in zip(out.tolist(), length.tolist(), log_prob.tolist(), score):
        tokens = tokens[: n - 1] if tokens[n - 1] == EOS_ID else tokens[:n]
        results.append(Hypothesis(tokens, s, lp))
    return results


def greedy_candidates(logits: Tensor, log_prob: Tensor, limit: Tensor, length: Tensor) -> GreedyStep:
    """The tensor work of one greedy step, with no sync (a compiled decoder runs it as one graph).

    logits (B, V) of the live sentences; log_prob (B,) their summed log-probabilities so far; limit (B,)
    their maximum lengths; length (1,) = t + 1, the length of the token chosen now. Returns token (B,)
    the most probable; log_prob (B,) with its log-probability added; done (B,) the sentences ending
    now (EOS or their limit); any_done (), whether there is one (GreedyStep).
    """
    logits = logits.float()
    output = logits[:, FIRST_OUTPUT:]  # (B, V')
    if torch.compiler.is_compiling():
        # the same token, the first of the best, in two passes that inductor vectorises: its loop for
        # max's indices is scalar, most of the graph's time (at 100 sentences of a 6,000-token vocabulary)
        best = output.amax(dim=-1)  # (B,)
        positions = torch.arange(output.size(-1), device=logits.device)  # (V',)
        token = torch.where(output == best[:, None], positions, output.size(-1)).amin(dim=-1)
        token = token.clamp_max(output.size(-1) - 1)  # (B,) (a row of NaNs has no best: any token)
    else:  # eager: one pass
        best, token = output.max(dim=-1)  # (B,), (B,)
    token = token + FIRST_OUTPUT
    log_prob = log_prob + (best - torch.logsumexp(logits, dim=-1))  # log_softmax at the best token
    done = (token == EOS_ID) | (limit <= length)  # (B,)
    return GreedyStep(token, log_prob, done, done.any())


# --- Beam search -----------------------------------------------------------------------------------


@dataclass
class BeamState:
    """The live part of a beam search; the rows of sentences that are done have been dropped."""

    rows: Tensor  # (B,) input position of each live sentence
    limit: Tensor  # (B,) its maximum output length, EOS included
    tokens: Tensor  # (B*N, T) the live hypotheses so far, the N of a sentence next to each other
    scores: Tensor  # (B, N) their summed log-probabilities, float32, best first
    n_finished: Tensor  # (B,) finished hypotheses so far
    best_finished: Tensor  # (B, n_best) the best finished scores, descending; -inf where there are fewer
    limit_penalty: Tensor  # (B,) lp(limit): the most a live hypothesis' log-probability can be divided by

    def live(self) -> BeamLive:
        """What a step's tensor work reads."""
        return BeamLive(self.scores, self.limit, self.limit_penalty, self.best_finished, self.n_finished)

    def select(self, keep: Tensor) -> None:
        """Keep only sentences `keep` (B',)."""
        N = self.scores.size(1)
        self.rows, self.limit = self.rows[keep], self.limit[keep]  # (B',)
        self.tokens = self.tokens.view(-1, N, self.tokens.size(1))[keep].flatten(0, 1)  # (B'*N, T)
        self.scores = self.scores[keep]  # (B', N)
        self.n_finished = self.n_finished[keep]  # (B',)
        self.best_finished = self.best_finished[keep]  # (B', n_best)
        self.limit_penalty = self.limit_penalty[keep]  # (B',)


@torch.inference_mode()
def beam_search(
    model: Seq2Seq | Decoder,
    src: Tensor,
    config: SearchConfig,
    *,
    max_len: Tensor | int | None = None,
) -> list[list[Hypothesis]]:
    """config.n_best hypotheses per sentence, best first, in input order (§6.1: beam 4, alpha 0.6).

    Each step, every live hypothesis is extended by every token and the 2N best candidates of a
    sentence are kept (beam 0 alone on the first step, as all beams are equal then). A candidate
    ending in EOS is finished if it ranks among the N best (as fairseq: then beam 1 follows greedy);
    the N best others stay live. At its maximum length every one of the N best is finished.

    When a sentence is done is config.stopping. "beam" (the default): once N of its hypotheses have
    finished, as fairseq and CTranslate2 stop. "exact": once it has n_best finished hypotheses and no
    live one can beat the n_best-th best of them: continuing only adds log-probabilities <= 0, and lp
    grows with length up to lp(max_len), so best live log-prob / lp(max_len) bounds every future score
    (tensor2tensor's bound): stopping later would return the same n_best. The bound is loose (max_len
    is the input length + 50), so "exact" runs many more steps for rarely another result
    (docs/deviations.md).

    max_len: override the SearchConfig lengths (an int or a (B,) tensor).

    Long for a reason: the search reads as one loop, top to bottom, as the algorithm is written;
    its tensor work is beam_candidates and its bookkeeping _collect and BeamState.select.
    """
    if max_len is None:
        max_len = max_lengths(src, config)
    limit = _limits(max_len, src)  # (B,)
    eos, bos = EOS_ID, BOS_ID
    N, n_best = config.beam_size, config.n_best
    alpha, kind, stopping = config.alpha, config.length_penalty, config.stopping
    B, device = src.size(0), src.device
    if B == 0:
        return []
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]  # by input position
    model = as_decoder(model)

    memory = model.encode(src)  # states (B, S, D)
    T = int(limit.max())
    cache = model.new_cache(memory, T)  # T decoder positions: BOS and the first T-1 outputs
    cache.expand(N)  # N rows per sentence; they share its cross-attention keys/values
    scores = torch.full((B, N), -math.inf, device=device)  # (B, N)
    scores[:, 0] = 0.0  # first step: expand beam 0 only
    state = BeamState(
        rows=torch.arange(B, device=device),
        limit=limit,
        tokens=src.new_empty(B * N, 0),
        scores=scores,
        n_finished=torch.zeros(B, dtype=torch.long, device=device),
        best_finished=torch.full((B, n_best), -math.inf, device=device),
        limit_penalty=length_penalty(limit, alpha, kind),
    )
    length = torch.ones(1, dtype=torch.long, device=device)  # (1,) t + 1: every candidate's length
    last = src.new_full((B * N, 1), bos)  # (B*N, 1)
    for _ in range(T):
        B = state.rows.numel()
        logits = model.decode(last, None, cache)[:, -1]  # (B*N, V); the cache holds what it needs of memory
        step = model.beam_candidates(
            logits.view(B, N, -1), state.live(), length, n_best, alpha, kind, stopping
        )
        state.best_finished, state.n_finished, state.scores = step.best_finished, step.n_finished, step.scores
        any_final, any_done = step.flags.tolist()  # the step's one sync
        length += 1
        if any_final:
            _collect(finished, state, step, eos)

        index = step.live_parent.flatten()  # (B*N,) which cache row each new live hypothesis extends
        state.tokens = torch.cat([state.tokens[index], step.live_token.view(-1, 1)], dim=1)  # (B*N, T+1)
        if any_done:  # drop the sentences that are done from the batch
            keep = (~step.done).nonzero().squeeze(1)  # (B',)
            if keep.numel() == 0:
                break
            state.select(keep)
            index = index.view(B, N)[keep].flatten()  # (B'*N,)
        # One reorder per step: beams follow their parents (within a sentence, so the encoder-decoder
        # keys/values stay put) and, on steps where some are done, finished sentences leave.
        cache.reorder(index, sentences=keep if any_done else None)
        last = state.tokens[:, -1:]  # (B*N, 1)

    return [sorted(hyps, key=lambda h: h.score, reverse=True)[:n_best] for hyps in finished]


def beam_candidates(
    logits: Tensor, live: BeamLive, length: Tensor, n_best: int, alpha: float, kind: str, stopping: str
) -> BeamStep:
    """The tensor work of one beam step, with no sync: what beam_search does between the decoder's logits
    and the Python that collects finished hypotheses (a compiled decoder runs it as one graph).

    logits (B, N, V) of the live hypotheses; live: their scores and the sentences' limits and finished
    hypotheses (BeamLive); length (1,) = t + 1, the length every candidate has; stopping: when a sentence
    is done (SearchConfig.stopping). -> BeamStep.
    """
    scores, limit, limit_penalty, best_finished, n_finished = live
    B, N, V = logits.shape
    K = 2 * N
    candidates = torch.log_softmax(logits.float(), dim=-1) + scores[:, :, None]  # (B, N, V)
    candidates[..., :FIRST_OUTPUT] = -math.inf  # never output
    top, flat = top_k(candidates, K)  # (B, K), best first
    parent = flat // V + N * torch.arange(B, device=logits.device)[:, None]  # (B, K) row in tokens/cache
    token = flat % V  # (B, K)
    is_eos = token == EOS_ID  # (B, K)
    at_limit = limit <= length  # (B,)

    # Finished: EOS among the N best candidates; all N best when the sentence is at its limit.
    first_n = torch.arange(K, device=logits.device) < N  # (K,)
    final = (is_eos | at_limit[:, None]) & first_n  # (B, K)
    penalised = top / length_penalty(length, alpha, kind)  # (B, K); all have length t+1
    new = penalised.where(final, -math.inf)  # (B, K)
    both = torch.cat([best_finished, new], dim=1)  # (B, n_best + K)
    best_finished = both.topk(n_best, dim=1).values  # (B, n_best)
    n_finished = n_finished + final.sum(dim=1)

    # Live: the N best candidates that do not end in EOS (there are at least N of the 2N).
    live = is_eos.int().sort(dim=1, stable=True).indices[:, :N]  # (B, N) in score order
    scores = top.gather(1, live)  # (B, N)
    live_parent = parent.gather(1, live)  # (B, N)
    live_token = token.gather(1, live)  # (B, N)

    if stopping == "beam":  # N finished (fairseq, CTranslate2): n_best <= N, so they are among them
        done = at_limit | (n_finished >= N)  # (B,)
    else:  # exact: the best live hypothesis cannot beat the n_best-th best finished one
        bound = scores[:, 0] / limit_penalty  # (B,)
        worst = best_finished[:, -1]  # (B,)
        done = at_limit | ((n_finished >= n_best) & (bound <= worst))  # (B,)
    flags = torch.stack([final.any(), done.any()])  # (2,)
    return BeamStep(
        top,
        parent,
        token,
        final,
        penalised,
        best_finished,
        n_finished,
        scores,
        live_parent,
        live_token,
        done,
        flags,
    )


def top_k(x: Tensor, k: int, block: int = 64) -> tuple[Tensor, Tensor]:
    """The k largest of each x (B, N, V) over (N, V), best first: values (B, k) and positions n * V + v
    (among equal values, any): x.view(B, N * V).topk(k, dim=1), computed another way.

    torch.topk runs a heap over every value of a row, a row a thread: at one sentence, the largest part
    of a beam step's own work (benchmarks/bench_translate.py). Cut each of the N rows into
    blocks of `block`: no value outside the k blocks with the largest maxima can beat the k-th best
    inside them (those k maxima are k values at least as large as it), so the k best are among k x block
    values, found after a pass for the blocks' maxima, which vectorises.
    """
    B, N, V = x.shape
    per_row = torch.sym_max((V + block - 1) // block, (k + N - 1) // N)  # blocks a row: k at least in all
    # (B, N, blocks, block), each block within one row: compiled, the pass below vectorises (indexed through
    # a (B, N x blocks, block) view, with V dynamic, inductor wrote a scalar loop, several times slower)
    x = F.pad(x, (0, per_row * block - V), value=-math.inf).view(B, N, per_row, block)  # V padded
    best = x.amax(dim=3).view(B, N * per_row).topk(k, dim=1).indices  # (B, k) blocks
    n, j = best // per_row, best % per_row  # (B, k) the row and the block in it
    inside = x[torch.arange(B, device=x.device)[:, None], n, j]  # (B, k, block)
    values, within = inside.view(B, k * block).topk(k, dim=1)  # (B, k)
    n, j = n.gather(1, within // block), j.gather(1, within // block)  # (B, k)
    # a padded value is taken only where fewer than k values are above -inf: name a real one
    return values, n * V + (j * block + within % block).clamp_max(V - 1)


def _collect(finished: list[list[Hypothesis]], state: BeamState, step: BeamStep, eos: int) -> None:
    """Append the candidates the step marked final (B, K) to the finished lists of their sentences."""
    sentence, rank = step.final.nonzero().unbind(1)  # (F,), (F,)
    prefix = state.tokens[step.parent[sentence, rank]].tolist()  # F x T
    rows = state.rows[sentence].tolist()
    last = step.token[sentence, rank].tolist()
    log_prob = step.top[sentence, rank].tolist()
    score = step.penalised[sentence, rank].tolist()
    for row, tokens, tok, lp, s in zip(rows, prefix, last, log_prob, score):
        finished[row].append(Hypothesis(tokens if tok == eos else [*tokens, tok], s, lp))


@torch.inference_mode()
def search(
    model: Seq2Seq | Decoder,
    src: Tensor,
    config: SearchConfig,
    *,
    max_len: Tensor | int | None = None,
) -> list[list[Hypothesis]]:
    """Beam search, or greedy search when beam_size is 1, scored with the same length penalty."""
    if config.beam_size > 1:
        return beam_search(model, src, config, max_len=max_len)
    if max_len is None:
        max_len = max_lengths(src, config)
    hyps = _greedy(model, src, _limits(max_len, src), config.alpha, config.length_penalty)
    return [[h] for h in hyps]


__all__ = [
    "Hypothesis",
    "BeamState",
    "BeamLive",
    "BeamStep",
    "GreedyStep",
    "Decoder",
    "EagerDecoder",
    "WrappedDecoder",
    "as_decoder",
    "Seq2Seq",
    "greedy_search",
    "beam_search",
    "beam_candidates",
    "greedy_candidates",
    "search",
    "top_k",
    "length_penalty",
    "max_lengths",
]
