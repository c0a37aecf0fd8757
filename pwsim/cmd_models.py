"""`pwsim models`: the bundled model cards with their sizes, expert share and KV bytes per token."""
from __future__ import annotations

import argparse
import json

from traces.clikit import text_table
from traces.model_card import ModelSpec, available_cards, load_card

GIB = 1 << 30


def card_row(spec: ModelSpec) -> dict:
    total = spec.total_params()
    return {
        "name": spec.name, "arch": spec.arch, "hf_id": spec.hf_id, "layers": spec.layers, "moe_layers": spec.moe_layers,
        "experts": spec.experts, "top_k": spec.top_k, "shared_experts": spec.shared_experts,
        "total_params": total, "active_params": spec.active_params(), "fp16_bytes": spec.fp16_bytes(),
        "fp16_gib": spec.fp16_bytes() / GIB, "expert_share": spec.expert_share(),
        "kv_bytes_per_token": spec.kv_bytes_per_token(),
        "expert_gib_at_bits": {b: spec.expert_bytes(b) / GIB for b in (3, 4, 8)},
        "published_params": spec.published_params,
        "published_deviation": (total / spec.published_params - 1) if spec.published_params else None,
        "published_source": spec.published_source, "source": spec.source, "fingerprint": spec.fingerprint(),
    }


def _table(rows: list[dict]) -> str:
    head = ("model", "arch", "layers", "experts", "params", "active", "fp16 GiB", "experts %", "KV B/token",
            "vs published")
    body = [(r["name"], r["arch"], str(r["layers"]), f"{r['experts']} top-{r['top_k']}",
             f"{r['total_params'] / 1e9:.2f}B", f"{r['active_params'] / 1e9:.2f}B", f"{r['fp16_gib']:.1f}",
             f"{100 * r['expert_share']:.1f}", f"{r['kv_bytes_per_token']:,}",
             "-" if r["published_deviation"] is None else
             f"{r['published_params'] / 1e9:.1f}B ({100 * r['published_deviation']:+.2f}%)") for r in rows]
    return text_table(head, body, left=2)


def run(args: argparse.Namespace) -> int:
    rows = [card_row(load_card(name)) for name in available_cards()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows))
        print("\nKV B/token: fp16 K+V over all layers (sliding-window layers counted in full). "
              "Sources: `pwsim models --json` (source, published_source).")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="list the bundled model cards",
                              description="List the bundled model cards: total and active parameters, fp16 size, "
                                          "share of the weights in routed experts, KV bytes per token.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
