"""One simulation run as a typed, JSON-dumpable config (`RunConfig`) and its execution (`execute`).

`pwsim run`, `pwsim compare` and `pwsim bench sim` all build `RunConfig`s; a config fully
determines its result (every random choice is seeded), so runs can go to worker processes and a
config dumped beside a result reproduces it.
"""
from __future__ import annotations

import sys
import zipfile
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from policies.memory_budget import DEFAULT_PREFILL_CHUNK_BYTES, allocator_slack_bytes
from pwsim.defaults import DEFAULT_ROUTING, DEFAULT_WORKLOAD, DEFAULTS, SYNTHETIC
from pwsim.engine import SimConfig, Simulation
from pwsim.hardware import format_size, load_profile, parse_size
from pwsim.recorder import SimResult
from traces.clikit import UserError, check_time_scale
from traces.generators import LengthDist, RoutingSpec, WorkloadSpec


ROUTING_FIELDS = ("skew", "domain_shift", "drift", "features")  # SyntheticWorkload's synthetic routing settings


@dataclass(frozen=True)
class SyntheticWorkload:
    """The generated workload used when `trace` is "synthetic" (requests, then routing)."""

    requests: int = DEFAULT_WORKLOAD.requests
    rate: float = DEFAULT_WORKLOAD.rate
    burstiness: float = DEFAULT_WORKLOAD.burstiness
    prompt: str = str(DEFAULT_WORKLOAD.prompt)
    output: str = str(DEFAULT_WORKLOAD.output)
    domains: tuple[str, ...] = DEFAULT_WORKLOAD.domains
    skew: float = DEFAULT_ROUTING.skew
    domain_shift: float = DEFAULT_ROUTING.domain_shift
    drift: float = DEFAULT_ROUTING.drift
    features: bool = DEFAULT_ROUTING.features
    token_ids_vocab: int = 0  # > 0: prompt token ids (what prefix caching matches)
    shared_prefix_tokens: int = 0  # prompts start with one of `prefix_groups` shared prefixes of this many ids
    prefix_groups: int = 1

    def specs(self) -> tuple[WorkloadSpec, RoutingSpec]:
        w = WorkloadSpec(requests=self.requests, rate=self.rate, burstiness=self.burstiness,
                         prompt=LengthDist.parse(self.prompt), output=LengthDist.parse(self.output),
                         domains=tuple(self.domains), token_ids_vocab=self.token_ids_vocab,
                         shared_prefix_tokens=self.shared_prefix_tokens, prefix_groups=self.prefix_groups)
        r = RoutingSpec(skew=self.skew, domain_shift=self.domain_shift, drift=self.drift, features=self.features)
        return w, r


@dataclass(frozen=True)
class RunConfig:
    budget_bytes: int
    policy: str = "pagedweight"
    policy_params: tuple[tuple[str, object], ...] = ()
    model: str = DEFAULTS.model
    calibration: str = DEFAULTS.calibration  # a directory, or "synthetic" (seeded by `seed`)
    hardware: str = DEFAULTS.hardware  # a JSON path or a bundled profile name
    trace: str = DEFAULTS.trace  # a trace directory, or "synthetic" (`workload`, seeded by `seed`)
    workload: SyntheticWorkload = field(default_factory=SyntheticWorkload)
    quality_fit: str | None = DEFAULTS.quality_fit  # JSON of runtime (damage, perplexity) points
    seed: int = DEFAULTS.seed
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    allocator_slack_bytes: int | None = None  # None: policies.memory_budget.allocator_slack_bytes
    timeline_stride: int = 1
    prefix_caching: bool = False  # SimConfig.prefix_caching (the trace needs prompt token ids)
    hybrid_kv: bool = True  # SimConfig.hybrid_kv
    async_scheduling: bool = False  # SimConfig.async_scheduling
    instant_page_moves: bool = False  # SimConfig.instant_page_moves
    lut_room: str = "slack"  # SimConfig.lut_room
    prefill_chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES  # SimConfig.prefill_chunk_bytes
    activation_reserve_bytes: int = 0  # SimConfig.activation_bytes (a replay's measured `activation_reserve`)
    warmup_requests: int = 0  # SimConfig.warmup_requests
    time_scale: float = 1.0  # arrival times multiplied by it, as `pwruntime replay --time-scale` (0.5: twice the rate;
    # 0: all at once, as `pwruntime bench serve --time-scale 0`)
    max_concurrency: int | None = None  # SimConfig.max_concurrency (as `pwruntime bench serve --max-concurrency`)
    request_rate: float | None = None  # a trace's requests re-timed at this rate, gaps of CV request_burstiness
    # (traces.generators.retimed_arrivals, seeded by `seed`), as `--request-rate` of replay and bench serve
    request_burstiness: float = 1.0  # 1: Poisson, as vLLM's --burstiness default

    def __post_init__(self) -> None:
        check_time_scale(self.time_scale)
        if self.request_rate is not None:
            if not (0 < self.request_rate < float("inf") and 0 < self.request_burstiness < float("inf")):
                raise UserError(f"--request-rate must be a number of requests per second > 0 and --burstiness a "
                                f"number > 0, got {self.request_rate} and {self.request_burstiness}")
            if self.trace == SYNTHETIC:
                raise UserError("--request-rate re-times a trace's requests; a synthetic trace's rate is --rate")
            if self.time_scale != 1.0:
                raise UserError("give --request-rate or --time-scale, not both: each sets when the requests arrive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise UserError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def policy_label(self) -> str:
        """The policy and the parameters it was given: `pagedweight,min_plan_blocks=4`."""
        return self.policy + "".join(f",{k}={v}" for k, v in self.policy_params)

    @property
    def label(self) -> str:
        return f"{self.policy_label}@{format_size(self.budget_bytes)}"

    @property
    def uses_quality_fit(self) -> bool:
        """A fit is given, and, if it is the bundled one (measured on the demo model against the damages of its
        measured calibration), the run simulates that model with a measured calibration: on another model's or a
        synthetic calibration's damages it would predict perplexities of 1e90 and more."""
        if not self.quality_fit or str(self.quality_fit).lower() == "none":
            return False
        if str(self.quality_fit) == str(DEFAULTS.quality_fit):
            return self.model == DEFAULTS.model and self.calibration != SYNTHETIC
        return True

    @property
    def slack_bytes(self) -> int:
        if self.allocator_slack_bytes is not None:
            return int(self.allocator_slack_bytes)
        return allocator_slack_bytes(self.budget_bytes)

    def sim_config(self) -> SimConfig:
        return SimConfig(budget_bytes=self.budget_bytes, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                         max_num_batched_tokens=self.max_num_batched_tokens,
                         allocator_slack_bytes=self.slack_bytes, timeline_stride=self.timeline_stride,
                         prefix_caching=self.prefix_caching, hybrid_kv=self.hybrid_kv,
                         async_scheduling=self.async_scheduling,
                         instant_page_moves=self.instant_page_moves, lut_room=self.lut_room,
                         prefill_chunk_bytes=self.prefill_chunk_bytes,
                         activation_bytes=self.activation_reserve_bytes,
                         warmup_requests=self.warmup_requests, max_concurrency=self.max_concurrency)

    def to_json(self) -> dict:
        """As a result's config.json: everything that reproduces the run, and only what it used (a trace's run keeps
        the synthetic routing's settings, for a trace without routing, not the synthetic requests' it never drew)."""
        d = asdict(self)
        d["policy_params"] = dict(self.policy_params)
        d["workload"]["domains"] = list(self.workload.domains)
        if self.trace != SYNTHETIC:
            d["workload"] = {k: v for k, v in d["workload"].items() if k in ROUTING_FIELDS}
        d["budget"] = format_size(self.budget_bytes)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RunConfig":
        d = {k: v for k, v in d.items() if k in {f.name for f in fields(cls)}}
        d["policy_params"] = tuple(sorted(dict(d.get("policy_params") or {}).items()))
        wl = dict(d.get("workload") or {})
        wl["domains"] = tuple(wl.get("domains", DEFAULT_WORKLOAD.domains))
        d["workload"] = SyntheticWorkload(**wl)
        return cls(**d)


def make_config(budget: str | int, **kw) -> RunConfig:
    """A RunConfig with the budget parsed (`"20GiB"`) and policy parameters given as a dict."""
    params = kw.pop("policy_params", None) or {}
    if kw.get("hybrid_kv", True):  # recorded as what runs: a model without sliding-window layers keeps one table
        kw["hybrid_kv"] = _card(kw.get("model", DEFAULTS.model)).kv_layout(kw.get("block_size", 16)).hybrid
    return RunConfig(budget_bytes=parse_size(budget), policy_params=tuple(sorted(params.items())), **kw)


# ------------------------------------------------------------------------------------ building
@lru_cache(maxsize=4)
def _card(name: str):
    from traces.model_card import load_card
    return load_card(name)


@lru_cache(maxsize=4)
def _calibration(source: str, card_name: str, seed: int):
    card = _card(card_name)
    from policies.synthetic import synthetic_calibration, synthetic_seed
    try:
        synthetic = synthetic_seed(source, default=seed)
    except ValueError as e:
        raise UserError(str(e)) from None
    if synthetic is not None:
        return synthetic_calibration(card, seed=synthetic)
    from policies.calibration import Calibration, CalibrationError
    if not Path(source).is_dir():
        raise UserError(f"calibration {source!r} is not a directory; pass a calibration directory "
                        f"(made by `pwruntime calibrate`) or 'synthetic'")
    try:
        return Calibration.load(source, expect_fingerprint=card.fingerprint())
    except CalibrationError:
        raise
    except (OSError, ValueError, KeyError, AttributeError, TypeError, EOFError, zipfile.BadZipFile) as e:
        # a truncated arrays.npz, a calibration.json of the wrong shape: Calibration.load names only what it checks
        raise UserError(f"calibration {source!r} is corrupt or incomplete ({type(e).__name__}: {e}); pass a "
                        "calibration directory made by `pwruntime calibrate`, or make it again") from None


def build_workload(cfg: RunConfig):
    """The run's requests and routing; arrivals scaled by `time_scale`, or re-timed at `request_rate`, after the
    routing is drawn (the same requests and routing, closer together or further apart)."""
    from pwsim import workload
    card = _card(cfg.model)
    if cfg.trace == SYNTHETIC:
        w, r = cfg.workload.specs()
        wl = workload.synthetic(card, w, r, cfg.seed)
    else:
        wl = workload.from_trace_dir(cfg.trace, card, cfg.workload.specs()[1], cfg.seed)
    if cfg.time_scale != 1.0:
        wl = wl.retimed(wl.requests.arrival_s * cfg.time_scale, time_scale=cfg.time_scale)
    if cfg.request_rate is not None:
        from traces.generators import retimed_arrivals
        burst = cfg.request_burstiness
        wl = wl.retimed(retimed_arrivals(wl.requests.arrival_s, cfg.request_rate, burst, cfg.seed),
                        request_rate=cfg.request_rate, burstiness=burst)
    return wl


def build(cfg: RunConfig) -> Simulation:
    import policies
    from pwsim.quality import load_fit_points

    card = _card(cfg.model)
    profile = load_profile(cfg.hardware)
    cal = _calibration(cfg.calibration, cfg.model, cfg.seed)
    try:
        policy = policies.get(cfg.policy, **dict(cfg.policy_params))
    except policies.PolicyError as e:
        raise UserError(str(e)) from None
    fit = load_fit_points(cfg.quality_fit) if cfg.uses_quality_fit else None
    if cfg.budget_bytes > profile.gpu_memory_bytes:
        raise UserError(f"budget {format_size(cfg.budget_bytes)} exceeds the {profile.device}'s "
                        f"{format_size(profile.gpu_memory_bytes)} (hardware profile {profile.name})")
    try:
        return Simulation(card, profile, build_workload(cfg), policy, cal, cfg.sim_config(), fit)
    except policies.PolicyError as e:
        raise UserError(str(e)) from None


def run_simulation(sim: Simulation, progress: bool = True) -> SimResult:
    """`sim.run()`; with `progress`, a bar of finished requests on stderr (when it is a terminal)."""
    if not progress:
        return sim.run()
    from tqdm import tqdm
    with tqdm(total=len(sim.workload), desc="simulating", unit="req", file=sys.stderr, leave=False,
              disable=None) as bar:
        return sim.run(on_finish=bar.update)


def execute(cfg: RunConfig, progress: bool = False) -> SimResult:
    """Build and run one simulation; the result's summary carries the config. `progress`: a bar of finished requests
    on stderr (when it is a terminal)."""
    sim = build(cfg)
    result = run_simulation(sim, progress)
    result.summary["config"] = cfg.to_json()
    result.summary["label"] = cfg.label
    result.summary["model"] = sim.card.name
    result.summary["hardware"] = {"name": sim.profile.name, "measured": sim.profile.measured,
                                  "note": sim.profile.metadata.get("note", "")}
    result.summary["calibration"] = {"source": cfg.calibration, "synthetic": bool(sim.cal is not None and
                                                                               sim.cal.provenance.get("synthetic"))}
    result.summary["workload"] = sim.workload.description
    return result

