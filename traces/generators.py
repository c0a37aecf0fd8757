"""Synthetic traces, reproducible by seed: arrivals, lengths, domain mix, and MoE routing.

Requests: Poisson arrivals (burstiness 1) or gamma inter-arrival gaps with coefficient of
variation `burstiness`; prompt and output lengths from a fixed, uniform, lognormal or bounded Zipf
distribution, clipped to [min, max]; a domain per request from a weighted mix. Optional prompt
token ids (`token_ids_vocab`), uniform below the vocab size; with `shared_prefix_tokens` each request
draws one of `prefix_groups` groups uniformly and its prompt starts with that group's fixed ids (all
but its last token when the prompt is shorter), so a prefix cache has something to share.

Routing: in every layer expert popularity follows a Zipf law over a random ranking of the
experts (popularity logit of rank r = -skew * log(1 + r)). Each domain reshuffles a fraction
`domain_shift` of every layer's ranking, and all logits drift over time as a Gaussian random walk
(`drift` std per sqrt(second), on a grid of at most 256 times, read at each arrival). For every (token, layer) the
top-k experts are sampled without replacement from softmax(logits) with the Gumbel-top-k trick;
the routing weights are the softmax of the sampled experts' perturbed logits (over the top-k when
`normalize_top_k`, else over all experts, as routers without top-k renormalisation do).
Everything is vectorised numpy; independent random streams keep requests identical whether or
not routing is generated.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from traces.clikit import UserError
from traces.schema import RequestTrace, RoutingTrace

LENGTH_KINDS = {"fixed": ("value",), "uniform": ("min", "max"), "lognormal": ("median", "sigma", "min", "max"),
                "zipf": ("alpha", "min", "max")}
CHUNK_ROWS = 1 << 16
MAX_LENGTH = 2**31 - 1  # lengths are int32 in a request trace
MAX_REQUESTS = 10_000_000  # a synthetic trace's requests at most: they (and their routing) are drawn in memory


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal | zipf
    a: float = 0.0  # fixed: value; lognormal: median; zipf: alpha (> 0)
    b: float = 0.0  # lognormal: sigma
    lo: int = 1  # clip bounds (uniform/zipf: the support)
    hi: int = 32768

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise UserError(f"unknown length distribution {self.kind!r}; use one of {', '.join(LENGTH_KINDS)}")
        if not 1 <= self.lo <= self.hi <= MAX_LENGTH:
            raise UserError(f"{self.kind} lengths need 1 <= min <= max <= {MAX_LENGTH}, got min {self.lo}, "
                            f"max {self.hi}")
        if self.kind in ("fixed", "lognormal") and self.a < 1:
            raise UserError(f"{self.kind} length needs a value/median >= 1, got {self.a}")
        if (self.kind == "lognormal" and self.b < 0) or (self.kind == "zipf" and self.a <= 0):
            raise UserError(f"{self.kind} needs sigma >= 0 / alpha > 0, got {self.a}, {self.b}")

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        """`fixed:512`, `uniform:64,1024`, `lognormal:512,0.8[,min,max]`, `zipf:1.2,16,4096`, or key=value."""
        kind, _, rest = spec.strip().partition(":")
        names = LENGTH_KINDS.get(kind)
        if names is None:
            raise UserError(f"length distribution {spec!r}: unknown kind {kind!r}; use one of {', '.join(LENGTH_KINDS)}")
        values: dict[str, float] = {}
        for j, item in enumerate(x for x in rest.split(",") if x.strip()):
            key, eq, val = item.partition("=")
            key = key.strip() if eq else (names[j] if j < len(names) else "?")
            if key not in names:
                raise UserError(f"length distribution {spec!r}: {kind} takes {', '.join(names)}")
            try:
                values[key] = float(val if eq else item)
            except ValueError:
                raise UserError(f"length distribution {spec!r}: {key} must be a number") from None
            if not math.isfinite(values[key]) or abs(values[key]) > MAX_LENGTH:
                raise UserError(f"length distribution {spec!r}: {key} must be a finite number of at most {MAX_LENGTH}")
        need = {"fixed": ("value",), "uniform": ("min", "max"), "lognormal": ("median", "sigma"), "zipf": ("alpha",)}
        if any(k not in values for k in need[kind]):
            raise UserError(f"length distribution {spec!r}: {kind} needs {', '.join(need[kind])}")
        a = values.get("value", values.get("median", values.get("alpha", 0.0)))
        lo, hi = int(values.get("min", 1)), int(values.get("max", 32768))
        if kind == "fixed":
            lo, hi = min(lo, int(a)), max(hi, int(a))
        return cls(kind, a, values.get("sigma", 0.0), lo, hi)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, round(self.a), dtype=np.int64)
        elif self.kind == "uniform":
            x = rng.integers(self.lo, self.hi + 1, size=n)
        elif self.kind == "lognormal":
            x = np.rint(np.clip(rng.lognormal(math.log(self.a), self.b, size=n), self.lo, self.hi)).astype(np.int64)
        else:  # bounded Zipf: P(x) proportional to x^-alpha on lo..hi
            support = np.arange(self.lo, self.hi + 1, dtype=np.float64)
            p = support ** -self.a
            x = rng.choice(support.astype(np.int64), size=n, p=p / p.sum())
        return np.clip(x, self.lo, self.hi).astype(np.int32)

    def __str__(self) -> str:
        names = LENGTH_KINDS[self.kind]
        vals = {"value": self.a, "median": self.a, "alpha": self.a, "sigma": self.b, "min": self.lo, "max": self.hi}
        return f"{self.kind}:" + ",".join(f"{k}={vals[k]:g}" for k in names)


def parse_domains(spec: str) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """`chat,code,math` (equal mix) or `chat:0.6,code:0.3,math:0.1` -> (names, weights summing to 1)."""
    names, weights = [], []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, colon, w = item.partition(":")
        try:
            weights.append(float(w) if colon else 1.0)
        except ValueError:
            raise UserError(f"domain mix {spec!r}: weight of {name!r} must be a number") from None
        names.append(name.strip())
    if not names or len(set(names)) != len(names) or any(not n for n in names):
        raise UserError(f"domain mix {spec!r}: give distinct names, e.g. chat,code,math or chat:0.6,code:0.4")
    w = np.array(weights)
    if (w < 0).any() or w.sum() <= 0:
        raise UserError(f"domain mix {spec!r}: weights must be >= 0 and not all zero")
    return tuple(names), tuple(float(x) for x in w / w.sum())


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times starting at 0; gaps have mean 1/rate and coefficient of variation `burstiness`."""
    if not (0 < rate < math.inf and 0 < burstiness < math.inf):
        raise UserError(f"rate and burstiness must be positive and finite, got rate {rate}, burstiness {burstiness}")
    if n == 0:
        return np.zeros(0)
    if burstiness == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    else:
        shape = 1.0 / burstiness**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def retimed_arrivals(arrival_s: np.ndarray, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """New arrival times for a trace's requests, in their order of arrival, as a renewal process at `rate` requests
    per second from 0 (gaps with coefficient of variation `burstiness`: 1 is Poisson; vLLM's --request-rate and
    --burstiness), seeded by `seed`: the same requests, prompts and outputs at another load, so `pwsim run`,
    `pwruntime replay` and `pwruntime bench serve` given the same numbers send them at the same times."""
    arrival_s = np.asarray(arrival_s, dtype=np.float64)
    order = np.argsort(arrival_s, kind="stable")
    out = np.empty(len(arrival_s))
    out[order] = arrival_times(len(arrival_s), rate, burstiness, np.random.default_rng([seed, 0x72617465]))
    return out


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 100
    rate: float = 2.0  # requests per second
    burstiness: float = 1.0  # CV of inter-arrival gaps; 1 = Poisson
    prompt: LengthDist = field(default_factory=lambda: LengthDist("lognormal", 512, 1.0, 16, 4096))
    output: LengthDist = field(default_factory=lambda: LengthDist("lognormal", 128, 0.8, 8, 1024))
    domains: tuple[str, ...] = ("chat", "code", "math")
    domain_weights: tuple[float, ...] | None = None  # None: equal mix
    token_ids_vocab: int = 0  # > 0: also draw synthetic prompt token ids below this vocab size
    shared_prefix_tokens: int = 0  # > 0 (needs token ids): prompts start with their group's fixed ids
    prefix_groups: int = 1  # groups of shared prefixes, each request in one drawn uniformly

    def describe(self) -> dict:
        d = asdict(self)
        d.update(prompt=str(self.prompt), output=str(self.output))
        return json.loads(json.dumps(d))  # JSON types (lists, not tuples), as it reads back from a file


def check_token_id_options(token_ids_vocab: int, shared_prefix_tokens: int, prefix_groups: int) -> None:
    """The prompt token-id options (`WorkloadSpec` fields, `--token-ids-vocab`, `--shared-prefix-tokens`,
    `--prefix-groups` on the CLI), one UserError naming each problem."""
    if token_ids_vocab < 0:
        raise UserError(f"token id vocabulary size (--token-ids-vocab) must be >= 0 (0 = no token ids), got "
                        f"{token_ids_vocab}")
    if shared_prefix_tokens < 0:
        raise UserError(f"shared prefix tokens (--shared-prefix-tokens) must be >= 0 (0 = no shared prefix), got "
                        f"{shared_prefix_tokens}")
    if prefix_groups < 1:
        raise UserError(f"prefix groups (--prefix-groups) must be >= 1, got {prefix_groups}")
    if shared_prefix_tokens > 0 and token_ids_vocab == 0:
        raise UserError("shared prefixes are token ids: give a token id vocabulary too (--token-ids-vocab V, e.g. "
                        "32000; WorkloadSpec.token_ids_vocab > 0)")


def _check_spec(spec: WorkloadSpec, seed: int) -> None:
    if not 0 <= spec.requests <= MAX_REQUESTS:
        raise UserError(f"number of requests (--requests) must be from 0 to {MAX_REQUESTS:,}, got {spec.requests}")
    check_token_id_options(spec.token_ids_vocab, spec.shared_prefix_tokens, spec.prefix_groups)
    if seed < 0:
        raise UserError(f"seed must be >= 0, got {seed}")


def _share_prefixes(ids: np.ndarray, offsets: np.ndarray, spec: WorkloadSpec, groups: np.random.SeedSequence,
                    prefixes: np.random.SeedSequence) -> None:
    """Overwrite (in place) the first min(shared_prefix_tokens, prompt - 1) ids of every prompt with its group's
    prefix: groups drawn uniformly from the `groups` stream, group g's ids from the g-th child of `prefixes`
    (drawn only for groups in use, each the same whatever the other groups or requests)."""
    lens = np.diff(offsets)
    group = np.random.default_rng(groups).integers(0, spec.prefix_groups, size=len(lens))
    k = np.minimum(spec.shared_prefix_tokens, lens - 1)  # every prompt keeps at least one id of its own
    if not len(k) or k.max() <= 0:
        return
    used = np.unique(group[k > 0])
    prefix = np.stack([_group_prefix(prefixes, g, int(k.max()), spec.token_ids_vocab) for g in used.tolist()])
    req = np.repeat(np.arange(len(lens)), k)
    pos = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
    ids[offsets[req] + pos] = prefix[np.searchsorted(used, group[req]), pos]


def _group_prefix(prefixes: np.random.SeedSequence, g: int, width: int, vocab: int) -> np.ndarray:
    """The first `width` prefix ids of group g, from the g-th child of `prefixes` (as `prefixes.spawn` makes it)."""
    child = np.random.SeedSequence(prefixes.entropy, spawn_key=(*prefixes.spawn_key, g))
    return np.random.default_rng(child).integers(0, vocab, size=width, dtype=np.int32)


def generate_requests(spec: WorkloadSpec, seed: int) -> RequestTrace:
    _check_spec(spec, seed)
    # streams 0..4 are those of spawn(5) (the requests before shared prefixes existed); 5, 6: shared prefixes
    seqs = np.random.SeedSequence(seed).spawn(7)
    streams = [np.random.default_rng(s) for s in seqs[:5]]
    n = spec.requests
    w = np.full(len(spec.domains), 1.0 / len(spec.domains)) if spec.domain_weights is None else np.asarray(spec.domain_weights)
    prompt = spec.prompt.sample(n, streams[1])
    offsets = ids = None
    if spec.token_ids_vocab > 0:
        offsets = np.concatenate([[0], np.cumsum(prompt, dtype=np.int64)])
        ids = streams[4].integers(0, spec.token_ids_vocab, size=int(offsets[-1]), dtype=np.int32)
        if spec.shared_prefix_tokens > 0:
            _share_prefixes(ids, offsets, spec, seqs[5], seqs[6])
    return RequestTrace(request_id=np.arange(n), arrival_s=arrival_times(n, spec.rate, spec.burstiness, streams[0]),
                        prompt_tokens=prompt, output_tokens=spec.output.sample(n, streams[2]),
                        domain_idx=streams[3].choice(len(spec.domains), size=n, p=w / w.sum()),
                        domains=spec.domains, token_offsets=offsets, token_ids=ids,
                        provenance={"generator": "traces.generators.generate_requests", "seed": seed,
                                    "workload": spec.describe()},
                        source="<generated request trace>")


@dataclass(frozen=True)
class RoutingSpec:
    skew: float = 1.0  # Zipf exponent of expert popularity within a layer; 0 = uniform
    domain_shift: float = 0.5  # fraction of each layer's ranking a domain reshuffles; 0 = same, 1 = independent
    drift: float = 0.05  # std of the popularity-logit random walk per sqrt(second)
    weight_temperature: float = 1.0
    normalize_top_k: bool = True
    features: bool = False  # also draw synthetic gate_up/down input norms
    tokens_per_request: int = 0  # > 0: route only the first this many positions of each request

    def __post_init__(self) -> None:
        if not (0 <= self.skew < math.inf and 0 <= self.domain_shift <= 1 and 0 <= self.drift < math.inf
                and 0 < self.weight_temperature < math.inf):
            raise UserError("routing needs skew >= 0, 0 <= domain_shift <= 1, drift >= 0, weight_temperature > 0 (all "
                            f"finite), got skew {self.skew}, domain_shift {self.domain_shift}, drift {self.drift}, "
                            f"weight_temperature {self.weight_temperature}")
        if self.tokens_per_request < 0:
            raise UserError(f"routing tokens per request must be >= 0 (0 = all), got {self.tokens_per_request}")


def popularity_logits(layers: int, experts: int, n_domains: int, spec: RoutingSpec,
                      rng: np.random.Generator) -> np.ndarray:
    """`[domains, layers, experts]` Zipf popularity logits, per-domain reshuffles of one ranking per layer."""
    ranks = np.empty((n_domains, layers, experts), dtype=np.int64)
    moved = int(round(spec.domain_shift * experts))
    for l in range(layers):
        base = rng.permutation(experts)  # base[e] = rank of expert e
        for d in range(n_domains):
            r = base.copy()
            if moved > 1:
                idx = rng.choice(experts, size=moved, replace=False)
                r[idx] = r[idx][rng.permutation(moved)]
            ranks[d, l] = r
    return (-spec.skew * np.log1p(ranks)).astype(np.float32)


def _top_k_softmax(keys: np.ndarray, k: int, temperature: float, over_top_k: bool) -> tuple[np.ndarray, np.ndarray]:
    """Indices of each row's k largest keys (largest first) and their softmax weights."""
    rows = np.arange(len(keys))
    top = np.empty((len(keys), k), dtype=np.int64)
    top_keys = np.empty((len(keys), k), dtype=np.float32)
    masked = keys.copy()
    for j in range(k):  # k argmax passes beat argpartition for the small k of MoE routers
        top[:, j] = masked.argmax(axis=1)
        top_keys[:, j] = masked[rows, top[:, j]]
        masked[rows, top[:, j]] = -np.inf
    m = top_keys[:, :1] / temperature  # the row maximum
    pool = top_keys if over_top_k else keys
    denom = np.exp(pool / temperature - m).sum(axis=1, keepdims=True)
    return top, np.exp(top_keys / temperature - m) / denom


def drift_walk(arrival_s: np.ndarray, layers: int, experts: int, drift: float, rng: np.random.Generator,
               max_steps: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """A Gaussian random walk of the logits on a time grid over the arrivals: (grid times, `[G, L, E]`)."""
    end = float(arrival_s[-1]) if len(arrival_s) else 0.0
    grid = np.linspace(0.0, end, max(2, min(len(arrival_s), max_steps)))
    dt = np.diff(grid, prepend=0.0).astype(np.float32)
    steps = rng.standard_normal((len(grid), layers, experts), dtype=np.float32) * (drift * np.sqrt(dt))[:, None, None]
    return grid, np.cumsum(steps, axis=0)


def generate_routing(requests: RequestTrace, model, spec: RoutingSpec, seed: int,
                     progress: Callable[[int], None] | None = None) -> RoutingTrace:
    """Routing rows for every (request, position, layer); `model` has name, moe_layers, experts, top_k."""
    L, E, k = int(model.moe_layers), int(model.experts), int(model.top_k)
    rng_pop, rng_walk, rng_tok, rng_feat = (np.random.default_rng(s) for s in np.random.SeedSequence([seed, 1]).spawn(4))
    logits = popularity_logits(L, E, max(len(requests.domains), 1), spec, rng_pop)
    grid, walk = drift_walk(requests.arrival_s, L, E, spec.drift, rng_walk)
    step_of_req = np.searchsorted(grid, requests.arrival_s, side="right") - 1
    tokens = (requests.prompt_tokens.astype(np.int64) + requests.output_tokens)
    if spec.tokens_per_request > 0:
        tokens = np.minimum(tokens, spec.tokens_per_request)
    req_of_tok = np.repeat(np.arange(len(requests)), tokens)
    position = np.arange(len(req_of_tok)) - np.repeat(np.cumsum(tokens) - tokens, tokens)
    n = len(req_of_tok) * L
    req = np.repeat(req_of_tok, L)
    layer = np.tile(np.arange(L, dtype=np.int16), len(req_of_tok))
    ids = np.empty((n, k), dtype=np.int16)
    weights = np.empty((n, k), dtype=np.float32)
    # context logits per (domain, drift step, layer), flattened so a row's logits are one np.take
    ctx_key = requests.domain_idx.astype(np.int64) * len(grid) + step_of_req
    uniq, ctx_of_req = np.unique(ctx_key, return_inverse=True)
    ctx = (logits[uniq // len(grid)] + walk[uniq % len(grid)]).reshape(-1, E)
    for start in range(0, n, CHUNK_ROWS):
        sl = slice(start, min(start + CHUNK_ROWS, n))
        keys = np.take(ctx, ctx_of_req[req[sl]] * L + layer[sl], axis=0)
        keys -= np.log(np.maximum(rng_tok.standard_exponential(keys.shape, dtype=np.float32), 1e-30))  # + Gumbel
        ids[sl], weights[sl] = _top_k_softmax(keys, k, spec.weight_temperature, spec.normalize_top_k)
        if progress is not None:
            progress(sl.stop - sl.start)
    gate_up = down = None
    if spec.features:
        mu = rng_feat.normal(math.log(20.0), 0.3, size=(max(len(requests.domains), 1), L)).astype(np.float32)
        dom = requests.domain_idx[req]
        gate_up = np.exp(mu[dom, layer] + 0.25 * rng_feat.standard_normal(n, dtype=np.float32))
        down = np.exp(mu[dom, layer][:, None] - math.log(4.0) + 0.4 * rng_feat.standard_normal((n, k), dtype=np.float32))
    return RoutingTrace(card=model.name, layers=L, experts=E, top_k=k, request_id=requests.request_id[req],
                        position=position.repeat(L), layer=layer, expert_ids=ids, weights=weights,
                        gate_up_in_norm=gate_up, down_in_norm=down,
                        provenance={"generator": "traces.generators.generate_routing", "seed": seed,
                                    "routing": asdict(spec)},
                        source="<generated routing trace>")
