"""Training loop of the demo model: AdamW, warmup + cosine LR, bf16 autocast on CUDA, exact resumption.

The run lives in one output folder: tokenizer/ (tokenizer.json + config), data/ (uint16 token cache),
train_config.json, train_log.jsonl, checkpoint.pt (model, optimizer, RNG, log accumulators, log offset)
and, once every step is done, model/ (HuggingFace format). The data cursor is the step number
(batches are a pure function of seed and step), so resuming from a checkpoint reproduces the
uninterrupted run: on CPU bit for bit; on CUDA up to float atomics unless `deterministic` is set.

Defaults were chosen on one H200 (transformers 5.17, torch 2.11, bf16 autocast): the corpus has only
4.6M training tokens, so the limit is overfitting, not compute. 1400 steps of 48x512 tokens (34M tokens,
rows per batch ~ sqrt of each domain's size) took 99 s and gave the best mean validation perplexity of
the runs tried; longer runs made fortunes and scripture validation loss rise steeply (memorisation).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from traces.clikit import UserError, write_atomic, write_json_atomic

from .model import ModelSpec

CKPT_FORMAT = "pwruntime-demo-checkpoint-1"


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (resuming requires the same values)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    domains: tuple[str, ...] | None = None            # None: every domain in the corpus (sorted)
    domain_mix: str = "sqrt"                          # rows per batch ~ equal | sqrt | proportional (to tokens)
    domain_weights: tuple[float, ...] | None = None   # explicit rows-per-batch shares (override domain_mix)
    seed: int = 0
    steps: int = 1400
    batch_size: int = 48
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    tokenizer_chars_per_domain: int = 2_500_000
    log_every: int = 50
    eval_every: int = 200
    eval_windows: int = 24                            # validation windows per domain for the logged loss
    ckpt_every: int = 500
    save_dtype: str = "float16"
    max_shard_bytes: int = 15 * 2**20

    def identity(self) -> dict:
        """The fields that shape the training trajectory and its log (export settings excluded)."""
        d = json.loads(json.dumps(asdict(self)))
        for k in ("ckpt_every", "save_dtype", "max_shard_bytes"):
            d.pop(k)
        return d


@dataclass(frozen=True)
class RunOptions:
    """How this invocation runs (may change between resumed calls)."""

    device: str = "auto"
    amp: str = "auto"                     # auto: bf16 on CUDA, none on CPU
    resume: bool = True
    max_minutes: float | None = None
    stop_at: int | None = None            # stop (with a checkpoint) after this many total steps
    progress: bool = True
    experts_impl: str | None = None       # transformers' experts implementation (None: eager on CPU, else its default)
    compile: bool = False
    deterministic: bool = False
    start_time: float | None = None       # time.monotonic() when the command started (for max_minutes)


@dataclass(frozen=True)
class TrainResult:
    finished: bool
    step: int
    steps: int
    out_dir: str
    model_dir: str | None
    params: dict
    valid_loss: dict | None
    elapsed_s: float
    message: str


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr over warmup_steps, then cosine to lr*min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    frac = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def mix_weights(mix: str, tokens: Sequence[int]) -> tuple[float, ...]:
    """Batch shares per domain: equal, proportional to sqrt(train tokens), or proportional to train tokens.

    Measured on the demo corpus (H200, ~34M training tokens): equal shares let fortunes and scripture
    overfit while pydocs is undertrained; sqrt gave the best mean validation perplexity.
    """
    if mix == "equal":
        return tuple(1.0 for _ in tokens)
    if mix == "sqrt":
        return tuple(math.sqrt(t) for t in tokens)
    if mix == "proportional":
        return tuple(float(t) for t in tokens)
    raise UserError(f"unknown domain mix {mix!r}; use equal, sqrt or proportional")


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return dev


def _amp_dtype(amp: str, device):
    import torch

    if amp == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]


def make_optimizer(model, cfg: TrainConfig, device):
    import torch

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, **kw)


class _Accumulator:
    """Device-side sums between two log records (no host sync per step); checkpointed for exact logs."""

    def __init__(self, num_domains: int, device):
        import torch

        # loss, lm loss, aux loss, grad norm, then one lm loss per domain
        self.t = torch.zeros(4 + num_domains, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, loss, lm, aux, gnorm, dom):
        import torch

        self.t += torch.cat([torch.stack([loss, lm, aux, gnorm]).double(), dom.double()])
        self.n += 1

    def state(self) -> dict:
        return {"t": self.t.cpu(), "n": self.n}

    def load(self, s: dict) -> None:
        self.t.copy_(s["t"])
        self.n = int(s["n"])

    def pop(self) -> list[float]:
        vals = (self.t / max(self.n, 1)).tolist()
        self.t.zero_()
        self.n = 0
        return vals


@dataclass(frozen=True)
class _Data:
    domains: tuple[str, ...]
    tokenizer_sha: str
    eos: int
    counts: tuple[int, ...]
    sampler: object                      # data.BatchSampler
    valid: dict                          # domain -> list of validation windows (logged subset)
    tokens: dict                         # split -> domain -> number of tokens


def _prepare_data(corpus, out: Path, cfg: TrainConfig) -> _Data:
    """Tokenizer (trained or reused), token cache, batch composition and the logged validation windows."""
    from .data import BatchSampler, corpus_domains, domain_counts, eval_windows, load_token_cache
    from .tokenizer_train import EOS, ensure_tokenizer

    domains = tuple(corpus_domains(corpus, cfg.domains))
    if cfg.domain_weights is not None and len(cfg.domain_weights) != len(domains):
        raise UserError(f"{len(cfg.domain_weights)} domain weights for {len(domains)} domains "
                        f"({', '.join(domains)})")
    tok, sha = ensure_tokenizer(corpus, domains, out / "tokenizer", cfg.model.vocab_size,
                                cfg.tokenizer_chars_per_domain, cfg.model.max_position_embeddings)
    if tok.get_vocab_size() > cfg.model.vocab_size:
        raise UserError(f"tokenizer has {tok.get_vocab_size()} tokens, more than the model's vocab_size")
    eos = tok.token_to_id(EOS)
    streams = load_token_cache(corpus, domains, tok, sha, out / "data", eos)
    weights = cfg.domain_weights or mix_weights(cfg.domain_mix, [len(streams["train"][d]) for d in domains])
    counts = tuple(domain_counts(cfg.batch_size, weights))
    sampler = BatchSampler(tuple(streams["train"][d] for d in domains), counts, cfg.seq_len, cfg.seed)
    valid = {d: eval_windows(streams["valid"][d], cfg.seq_len, cfg.eval_windows) for d in domains}
    tokens = {s: {d: int(len(streams[s][d])) for d in domains} for s in streams}
    return _Data(domains, sha, eos, counts, sampler, valid, tokens)


def _restore(ckpt_path: Path, identity: dict, model, opt, acc: _Accumulator, device, log_path: Path) -> int:
    """Load a checkpoint into model/optimizer/accumulator/RNG, cut the log back to it; returns its step."""
    import torch

    ck = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    if ck.get("format") != CKPT_FORMAT:
        raise UserError(f"{ckpt_path} is not a demo-training checkpoint; remove it or pass --no-resume")
    if ck["identity"] != identity:
        old, new = ck["identity"]["config"], identity["config"]
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)) or ["corpus or tokenizer"]
        raise UserError(f"{ckpt_path} was made with different settings ({', '.join(diff)}); "
                        "pass the same settings to resume, or --no-resume to start over")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    acc.load(ck["acc"])
    torch.set_rng_state(ck["rng"]["torch"])
    if device.type == "cuda" and ck["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(ck["rng"]["cuda"], device)
    if log_path.exists():
        with open(log_path, "r+b") as f:
            f.truncate(int(ck["log_bytes"]))
    return int(ck["step"])


class _TimeLimit:
    """Whether a run given `max_minutes` must stop now, keeping room for a checkpoint, an evaluation and a few steps
    (their costs measured as the run goes)."""

    def __init__(self, t0: float, max_minutes: float | None):
        self.t0, self.max_minutes = t0, max_minutes
        self.ckpt_s, self.eval_s, self.step_s = 2.0, 0.0, None

    def stepped(self, dt: float) -> None:
        self.step_s = dt if self.step_s is None else 0.9 * self.step_s + 0.1 * dt

    def spent(self) -> bool:
        if self.max_minutes is None:
            return False
        reserve = 2 * self.ckpt_s + self.eval_s + 3 * self.step_s + 10.0
        return time.monotonic() - self.t0 + reserve > self.max_minutes * 60


class _Run:
    """One training run's model, optimizer, data and log accumulators, and what it does with them: a step, an
    evaluation, a checkpoint."""

    def __init__(self, cfg: TrainConfig, opts: RunOptions, data: _Data, device, ckpt_path: Path):
        import numpy as np
        import torch

        from .model import build_model, count_parameters

        self.cfg, self.data, self.device, self.ckpt_path = cfg, data, device, ckpt_path
        # transformers' grouped_mm experts path is not bitwise reproducible on CPU (gather backward); eager is
        experts_impl = opts.experts_impl or ("eager" if device.type == "cpu" else None)
        self.model = build_model(cfg.model, data.eos, cfg.seed, experts_impl)
        self.params = count_parameters(self.model)
        self.model.to(device)
        self.fwd = torch.compile(self.model) if opts.compile else self.model
        self.opt = make_optimizer(self.model, cfg, device)
        self.acc = _Accumulator(len(data.domains), device)
        self.identity = {"config": cfg.identity(), "domains": list(data.domains),
                         "tokenizer_sha256": data.tokenizer_sha}
        self.amp_dtype = _amp_dtype(opts.amp, device)
        self.bounds = np.concatenate([[0], np.cumsum(data.counts)]).tolist()  # each domain's rows of a batch

    def autocast(self):
        import torch

        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def step(self, step: int) -> float:
        """One optimizer step on the step's batch, its losses added to the accumulators; returns its learning rate."""
        import torch
        import torch.nn.functional as F

        cfg, opt = self.cfg, self.opt
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.from_numpy(self.data.sampler.batch(step)).to(self.device, non_blocking=True)
        with self.autocast():
            o = self.fwd(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(o.logits.float().reshape(-1, o.logits.shape[-1]), x[:, 1:].reshape(-1),
                             reduction="none").view(x.shape[0], -1)
        lm = ce.mean()
        aux = o.aux_loss.float()
        loss = lm + cfg.model.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        opt.step()
        rows = ce.detach().mean(1)
        self.acc.add(loss.detach(), lm.detach(), aux.detach(), gnorm.detach(),
                     torch.stack([rows[a:b].mean() for a, b in zip(self.bounds[:-1], self.bounds[1:])]))
        return lr

    def train_record(self, done: int, lr: float, seconds: float, elapsed_s: float) -> dict:
        """The log record of the steps since the last one (`seconds` of them); empties the accumulators."""
        n_steps, vals, cfg = self.acc.n, self.acc.pop(), self.cfg
        return {"type": "train", "step": done, "loss": vals[0], "lm_loss": vals[1], "aux_loss": vals[2],
                "grad_norm": vals[3], "lr": lr, "train_loss_by_domain": dict(zip(self.data.domains, vals[4:])),
                "tokens_per_s": n_steps * cfg.batch_size * cfg.seq_len / max(seconds, 1e-9), "elapsed_s": elapsed_s}

    def evaluate(self, step: int, logf) -> dict:
        """Each domain's validation loss over the logged windows, written to the log."""
        import numpy as np

        from .stats import window_losses

        self.model.eval()
        with self.autocast():
            vl = {d: float(np.mean(window_losses(self.model, self.data.valid[d], self.device,
                                                 batch_size=self.cfg.batch_size)))
                  for d in self.data.domains}
        self.model.train()
        rec = {"type": "eval", "step": step, "valid_loss": vl, "valid_ppl": {d: math.exp(v) for d, v in vl.items()}}
        logf.write(json.dumps(rec) + "\n")
        return vl

    def save(self, step: int, logf) -> None:
        """A checkpoint of everything resuming needs, the log's length among it."""
        import torch

        logf.flush()
        device = self.device
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
        state = {"format": CKPT_FORMAT, "step": step, "identity": self.identity, "model": self.model.state_dict(),
                 "optimizer": self.opt.state_dict(), "acc": self.acc.state(), "rng": rng, "log_bytes": logf.tell()}
        write_atomic(self.ckpt_path, lambda f: torch.save(state, f))


def _start(run: _Run, opts: RunOptions, log_path: Path, model_dir: Path, echo) -> int:
    """The step to start from: a checkpoint's (resuming), else 0 with the folder's old run removed."""
    import shutil

    ckpt_path = run.ckpt_path
    if ckpt_path.exists() and opts.resume:
        start = _restore(ckpt_path, run.identity, run.model, run.opt, run.acc, run.device, log_path)
        echo(f"resuming from {ckpt_path} at step {start}/{run.cfg.steps}")
        return start
    for p in (ckpt_path, log_path):
        p.unlink(missing_ok=True)
    shutil.rmtree(model_dir, ignore_errors=True)
    return 0


def _steps(run: _Run, start: int, opts: RunOptions, log_path: Path, t0: float, echo) -> tuple[int, dict | None]:
    """Steps from `start` until the last, or until `stop_at` or the time limit (with a checkpoint); logs, evaluations
    and checkpoints at their intervals. Returns the step reached and the last evaluation's losses (None if none ran)."""
    from tqdm.auto import tqdm

    cfg = run.cfg
    limit = _TimeLimit(t0, opts.max_minutes)
    last_log_t, valid_loss, step = time.monotonic(), None, start
    run.model.train()
    with open(log_path, "a") as logf, tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True,
                                          disable=not opts.progress or start >= cfg.steps,
                                          desc="demo train") as bar:
        for step in range(start, cfg.steps):
            t_step = time.monotonic()
            lr = run.step(step)
            done = step + 1
            bar.update(1)
            if done % cfg.log_every == 0 or done == cfg.steps:
                now = time.monotonic()
                rec = run.train_record(done, lr, now - last_log_t, now - t0)
                logf.write(json.dumps(rec) + "\n")
                last_log_t = now
                bar.set_postfix(loss=f"{rec['lm_loss']:.3f}", aux=f"{rec['aux_loss']:.3f}", lr=f"{lr:.2e}")
            if done % cfg.eval_every == 0 or done == cfg.steps:
                te = time.monotonic()
                valid_loss = run.evaluate(done, logf)
                limit.eval_s = time.monotonic() - te
                msg = f"step {done}: valid loss " + ", ".join(f"{d} {v:.3f}" for d, v in valid_loss.items())
                if bar.disable:
                    echo(msg)
                else:
                    bar.write(msg, file=sys.stderr)
            limit.stepped(time.monotonic() - t_step)
            stop_now = done < cfg.steps and (limit.spent() or (opts.stop_at is not None and done >= opts.stop_at))
            if done == cfg.steps or stop_now or done % cfg.ckpt_every == 0:
                tc = time.monotonic()
                run.save(done, logf)
                limit.ckpt_s = time.monotonic() - tc
            step = done
            if stop_now:
                break
    return step, valid_loss


def train(corpus: str | Path, out: str | Path, cfg: TrainConfig = TrainConfig(),
          opts: RunOptions = RunOptions(), echo=print) -> TrainResult:
    """Train (or resume) the demo model in `out`; see the module docstring for the folder's contents."""
    import torch

    from .export import save_hf_model

    t0 = opts.start_time if opts.start_time is not None else time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path, model_dir = out / "checkpoint.pt", out / "train_log.jsonl", out / "model"
    if opts.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = resolve_device(opts.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data = _prepare_data(corpus, out, cfg)
    run = _Run(cfg, opts, data, device, ckpt_path)
    params = run.params
    start = _start(run, opts, log_path, model_dir, echo)
    write_json_atomic(out / "train_config.json", {
        **run.identity, "export": {"save_dtype": cfg.save_dtype, "max_shard_bytes": cfg.max_shard_bytes},
        "params": params, "counts_per_batch": list(data.counts),
        "train_tokens": data.tokens["train"], "valid_tokens": data.tokens["valid"]})
    if start == 0:
        echo(f"model: {params['total'] / 1e6:.2f}M parameters "
             f"({params['active_per_token'] / 1e6:.2f}M active per token); device {device}; "
             f"{cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} tokens "
             f"(rows per domain {dict(zip(data.domains, data.counts))})")

    step, valid_loss = _steps(run, start, opts, log_path, t0, echo)
    elapsed = time.monotonic() - t0
    if step < cfg.steps:
        msg = (f"stopped at step {step}/{cfg.steps} with a checkpoint in {ckpt_path}; "
               "run the same command again to continue")
        echo(msg)
        return TrainResult(False, step, cfg.steps, str(out), None, params, valid_loss, elapsed, msg)
    if not model_dir.exists() or start < cfg.steps:
        save_hf_model(run.model, model_dir, out / "tokenizer", cfg.save_dtype, cfg.max_shard_bytes)
    if valid_loss is None:                     # nothing was left to train: report the last logged evaluation
        evals = read_log(log_path, "eval")
        valid_loss = evals[-1]["valid_loss"] if evals else None
    msg = f"finished {cfg.steps} steps; model written to {model_dir}"
    echo(msg)
    return TrainResult(True, cfg.steps, cfg.steps, str(out), str(model_dir), params, valid_loss, elapsed, msg)


def read_log(path: str | Path, type_: str | None = None) -> list[dict]:
    """Records of a train_log.jsonl, optionally of one type ("train" or "eval")."""
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in recs if type_ is None or r.get("type") == type_]
