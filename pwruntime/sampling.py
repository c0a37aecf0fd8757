"""Sampling: SamplingParams and the per-request sampler (logits processing, greedy, temperature, min-p, top-k, top-p,
seeds), log-probabilities.

A batch samples in one set of tensor operations whatever its size: temperature, one sort, min-p, top-k and top-p per
row, then one inverse-CDF pick per row over its kept tokens, most likely first. Each request's random numbers are
counter-based (`RequestDraws`: a hash of its `seed`, or when unset of the engine seed and the request's index, and
of the draw's index), one a sampled token, so its draws do not depend on which other requests share the batch, nor
on the device's random number generator. Its logits may, in their last bits (a matrix multiply's sums run in an
order that depends on the batch's rows, as in vLLM without batch-invariant kernels): log-probabilities differ by
about 1e-6 between batches, and a token whose draw falls on the edge between two could differ.

Stops are applied by the engine: EOS (unless `ignore_eos`) and `stop_token_ids` through the
scheduler; stop strings on the decoded text (the returned text is cut before the stop string, or after it with
`include_stop_str_in_output`;
the token ids keep every sampled token, including the one that completed the stop); `max_tokens`.

Logits processing (`adjust_logits`, as vLLM's, before sampling and before greedy's argmax too), for the rows that
ask: `logit_bias` adds each listed token's bias (OpenAI's: -100 bans a token in practice, 100 all but forces it);
while a request has fewer than `min_tokens` output tokens, the tokens that would stop it (EOS unless
`ignore_eos`, `stop_token_ids`) are masked, so none can end it early; then the repetition penalty p scales the
logit of every token seen in the prompt or the output (divided by p where positive, multiplied by p otherwise),
and each token of the output loses `frequency_penalty` times its count there plus `presence_penalty` once.

Log-probabilities (`logprobs` = N, as vLLM): of the model's raw distribution (log_softmax of the fp32
logits, before the logits processing, temperature, min-p, top-k and top-p), for the sampled token and the N
most likely tokens, most likely first, ties broken by the lower token id. Only the rows that ask pay for them.
`token_logprobs` is the computation, shared with the prompt's records (`prompt_logprobs`: pwruntime.prompt_logprobs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Sequence as Seq

import torch

from pwruntime.host_copy import to_device


GREEDY_BELOW = 1e-5
LOGIT_CAP = 1e30  # adjusted logits stay below it: divided by a temperature >= GREEDY_BELOW, still finite


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0  # keep only tokens at least min_p times as likely as the most likely one (0: no cut; vLLM's)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # the returned text keeps the stop string that ended it (vLLM's)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    clip_to_context: bool = True  # False: a prompt + max_tokens beyond the model's positions is refused, not cut
    logprobs: int | None = None  # N: each sampled token's log-probability and the N most likely; None: not computed
    min_tokens: int = 0  # output tokens before a stop token may be sampled
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), by token id (a dict is taken)
    prompt_logprobs: int | None = None  # N: each prompt token's log-probability (from the tokens before it) and the
    # N most likely there (pwruntime.prompt_logprobs); None: not computed

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or (ids and ids[0] < 0):
            raise ValueError(f"logit_bias must name distinct token ids >= 0, got {ids[:8]}")
        bad = next((b for _, b in self.logit_bias if not -100.0 <= b <= 100.0), None)  # also refuses NaN
        if bad is not None:
            raise ValueError(f"logit_bias values must lie in [-100, 100], got {bad}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:  # also refuses NaN
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 (or None: not computed), got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0 (or None: not computed), got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must lie in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # also refuses NaN
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW sample the argmax: dividing logits by them overflows to inf and NaN."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def reads_history(self) -> bool:
        """Whether this request's logits processing reads its tokens so far (min_tokens, the penalties)."""
        return (self.min_tokens > 0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` changes this request's logits."""
        return self.reads_history or bool(self.logit_bias)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the `top` (token id, log-probability) pairs, most likely first; `rank`: 1 + how
    many tokens are more likely (prompt records only, pwruntime.prompt_logprobs; None elsewhere)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class History:
    """What the logits processing of a request reads: its prompt and output token ids so far, and the tokens that
    would stop it (held back until it has `min_tokens` output tokens)."""
    prompt_ids: Seq[int]
    output_ids: Seq[int]
    stop_ids: Collection[int] = ()


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters nearby inputs."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class RequestDraws:
    """A request's random numbers: draw i is splitmix64 of (its seed, mixed) + (i + 1) x gamma, its top 23 bits as a
    number in [0, 1). 23 bits keep u x c below c in float32 for any c > 0, so an inverse-CDF pick scaled to the
    row's total never passes its last token."""
    seed: int
    drawn: int = 0

    def __post_init__(self) -> None:
        self._key = _mix64(int(self.seed) & _MASK64)

    def next(self) -> float:
        self.drawn += 1
        return (_mix64((self._key + self.drawn * _GAMMA) & _MASK64) >> 41) / float(1 << 23)


def sorted_probs(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                 min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n, vocab] sorted by logit (most likely first, ties by lower id) and cut: `top_k` [n, 1] (long, k - 1 of
    each row's top-k, vocab - 1 for none) keeps the logits not below the row's k-th largest, `min_p` [n, 1] the
    tokens at least that share of the most likely one's probability (0: no cut), `top_p` [n, 1] the smallest prefix of
    what is left whose probability reaches that share of it (inf: no cut), in that order (vLLM's: min-p, then top-k
    and top-p); None: no row has that cut (its operations are left out). Returns the kept tokens' probabilities
    (unnormalized, 0 where cut) and the sort order (each sorted slot's token id)."""
    s, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    if top_k is not None:
        s = s.masked_fill(s < s.gather(1, top_k), float("-inf"))
    probs = torch.softmax(s, dim=-1)
    if min_p is not None:  # a share of the largest: the same tokens whether top-k cut before or not
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p is not None:
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        cut = before >= top_p
        cut[:, 0] = False   # the most likely token stays, whatever the reach (a top-p that is 0 in float32)
        probs = probs.masked_fill(cut, 0.0)
    return probs, order


def adjust_logits(logits: torch.Tensor, params: Seq[SamplingParams], histories: Seq[History]) -> torch.Tensor:
    """The logits of rows [n, vocab] after the processing in the module docstring, for the rows whose params
    `adjusts_logits` (an fp32 copy); `logits` itself when no row does."""
    rows = [j for j, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    for j in rows:
        p, h, row = params[j], histories[j], out[j]
        if p.logit_bias:
            bias = to_device(torch.tensor([b for _, b in p.logit_bias]), row.device)
            row[_ids([t for t, _ in p.logit_bias], row)] += bias
        if len(h.output_ids) < p.min_tokens and h.stop_ids:
            row[_ids(h.stop_ids, row)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = _ids(set(h.prompt_ids).union(h.output_ids), row)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if h.output_ids and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.unique(_ids(h.output_ids, row), return_counts=True)
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty
    # a penalty far from 1 can take a logit past float32 (inf), or near it, where a temperature would: sampling would
    # turn either into NaN probabilities
    return torch.nan_to_num_(out, nan=float("-inf"), neginf=float("-inf")).clamp_(max=LOGIT_CAP)


def _ids(ids: Collection[int], like: torch.Tensor) -> torch.Tensor:
    return to_device(torch.tensor(list(ids), dtype=torch.long), like.device)


ROW_VALUES = 5  # a row's sampling values: temperature, top-p reach, its number u, k - 1 of its top-k, its min-p
GREEDY_ROW = (1.0, math.inf, 0.0, 0.0, 0.0)  # what a greedy row samples with: its one most likely token, the lowest id


def row_values(params: SamplingParams, u: float | None, vocab: int) -> tuple[float, float, float, float, float]:
    """The numbers `sample_rows` samples a row with: its temperature, its top-p (inf: no cut), its number in [0, 1),
    k - 1 of its top-k (vocab - 1: no cut) and its min-p (0: no cut); a greedy row's are GREEDY_ROW (top-1 at u = 0:
    the argmax)."""
    if params.greedy:
        return GREEDY_ROW
    if u is None:
        raise ValueError("a row that samples needs its number u in [0, 1)")
    return (params.temperature, params.top_p if params.top_p < 1.0 else math.inf, u,
            min(params.top_k or vocab, vocab) - 1, params.min_p)


def needed_cuts(values: Seq[tuple[float, ...]], vocab: int) -> tuple[bool, bool, bool]:
    """Whether some row that samples has a top-k cut, a top-p cut, a min-p cut (`row_values`; greedy rows need none:
    u = 0 takes the first sorted token). `sample_rows` leaves out a cut no row needs."""
    rows = [v for v in values if v != GREEDY_ROW]
    return any(v[3] < vocab - 1 for v in rows), any(v[1] < math.inf for v in rows), any(v[4] > 0 for v in rows)


def sample_rows(logits: torch.Tensor, values: torch.Tensor, cut_k: bool = True, cut_p: bool = True,
                cut_min_p: bool = True) -> torch.Tensor:
    """One token per row of `logits` [n, vocab] for its `values` [n, ROW_VALUES] (float32 on the logits' device,
    `row_values`): the logits divided by the temperature, cut to the min-p, top-k and top-p (`sorted_probs`), then
    the first token, most likely first, whose cumulative probability exceeds u times the kept mass. Fixed shapes and
    no host decisions: a CUDA graph can hold it (pwruntime.cuda_graphs). `cut_k` / `cut_p` / `cut_min_p` False leave
    out a cut that no row has (their operations would change nothing)."""
    x = logits.float() / values[:, :1]
    probs, order = sorted_probs(x, values[:, 3:4].long() if cut_k else None, values[:, 1:2] if cut_p else None,
                                values[:, 4:5] if cut_min_p else None)
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, values[:, 2:3] * total, right=True).clamp_(max=cdf.shape[-1] - 1)
    # a row that keeps no mass (every logit -inf: min_tokens holding back every token) takes its first sorted token
    return order.gather(1, torch.where(total > 0, picked, 0))[:, 0]


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams], uniforms: Seq[float | None]) -> torch.Tensor:
    """One token per row of `logits` [n, vocab], each with its own params: int64 [n] on the logits' device, queued
    there without waiting (an asynchronous engine feeds them to the next step before reading them). Greedy rows take
    the argmax; the others are sampled by `sample_rows` with their number from `uniforms` (in [0, 1); greedy rows'
    entries are not read), the top-k / top-p operations left out when none of them has that cut. The rows' values
    travel in one copy."""
    if logits.shape[0] != len(params) or len(params) != len(uniforms):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} params / {len(uniforms)} numbers")
    rows = [j for j, p in enumerate(params) if not p.greedy]
    if not rows:
        return torch.argmax(logits, dim=-1)
    every = len(rows) == len(params)
    vocab = logits.shape[-1]
    values = [row_values(params[j], uniforms[j], vocab) for j in rows]
    per_row = to_device(torch.tensor(values, dtype=torch.float32), logits.device)  # float32: u, k-1 exact
    index = None if every else to_device(torch.tensor(rows), logits.device)
    picked = sample_rows(logits if every else logits[index], per_row, *needed_cuts(values, vocab))
    return picked if every else torch.argmax(logits, dim=-1).index_copy_(0, index, picked)


@dataclass(frozen=True)
class PendingLogprobs:
    """Log-probabilities computed on the device (`logprobs_on_device`) while the logits exist; `records()` reads
    them back (waiting for them) and builds the TokenLogprob records: one per row that asks, None for the others."""
    size: int                 # rows of the batch
    rows: list[int]           # the rows that ask
    chosen: torch.Tensor      # [len(rows)] float32: the sampled token's log-probability
    top_ids: torch.Tensor     # [len(rows), k] int64, most likely first
    top_logprobs: torch.Tensor
    tokens: torch.Tensor      # [len(rows)] the sampled tokens of those rows

    def records(self, params: list[SamplingParams]) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * self.size
        top = zip(self.top_ids.tolist(), self.top_logprobs.tolist())
        for j, t, lp, (ids, lps) in zip(self.rows, self.tokens.tolist(), self.chosen.tolist(), top):
            n = params[j].logprobs
            out[j] = TokenLogprob(int(t), lp, tuple(zip(ids[:n], lps[:n])))
        return out


def logprobs_on_device(logits: torch.Tensor, params: list[SamplingParams],
                       tokens: torch.Tensor) -> PendingLogprobs | None:
    """For each row of `logits` [n, vocab] whose params ask (`logprobs` not None), the log-probability of its
    sampled token (`tokens` [n], as `sample_tensor` gives them) and its `logprobs` most likely tokens, queued on the
    device; None when no row asks. One log_softmax (and one sort, when a row asks for top tokens) over the rows that
    ask; the ranking is that of the logits, by a stable sort: ties go to the lower id, as argmax's."""
    rows = [j for j, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    index = to_device(torch.tensor(rows), logits.device)
    chosen_ids = tokens.to(logits.device)[index]
    chosen, top_ids, top_logprobs = token_logprobs(logits[index], chosen_ids, max(params[j].logprobs for j in rows))
    return PendingLogprobs(len(params), rows, chosen, top_ids, top_logprobs, chosen_ids)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `logits` [n, vocab]: the log-probability of the token `ids` [n] names, and the ids [n, k] and
    log-probabilities of the k most likely tokens (a stable sort of the raw logits: ties to the lower id), on the
    device. What sampled tokens' and prompt tokens' records (pwruntime.prompt_logprobs) are made of."""
    raw = logits.float()
    logp = torch.log_softmax(raw, dim=-1)
    chosen = logp.gather(1, ids[:, None])[:, 0]
    k = min(k, raw.shape[-1])
    if k:
        top_ids = torch.sort(raw, dim=-1, descending=True, stable=True).indices[:, :k]
    else:
        top_ids = torch.empty((raw.shape[0], 0), dtype=torch.long, device=logits.device)
    return chosen, top_ids, logp.gather(1, top_ids)


def find_stop(text: str, stops: tuple[str, ...], search_from: int = 0) -> int:
    """Index of the earliest stop string occurring at or after `search_from`, or -1."""
    best = -1
    for s in stops:
        k = text.find(s, max(0, search_from))
        if k >= 0 and (best < 0 or k < best):
            best = k
    return best
