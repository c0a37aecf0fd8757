"""Tokenizer: a thin wrapper over `tokenizers` (tokenizer.json) plus the chat template of tokenizer_config.json."""
from __future__ import annotations

import json
from pathlib import Path

from pwruntime.model.config import CheckpointError
from traces.clikit import UserError


def _token_text(value) -> str | None:
    if isinstance(value, dict):   # older configs store AddedToken dicts
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, eos_id, bos_id, chat_template (may be None)."""

    def __init__(self, tokenizer_json: str | Path, tokenizer_config: str | Path | None = None,
                 eos_token_id: int | None = None):
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            self._tok = _HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"cannot load {tokenizer_json}: {e}; restore it from the original checkpoint") \
                from None
        cfg: dict = {}
        if tokenizer_config is not None:
            try:
                cfg = json.loads(Path(tokenizer_config).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"cannot read {tokenizer_config}: {e}; fix or remove it") from None
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template = self._find_template(cfg, Path(tokenizer_json).parent)
        eos_from_cfg = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_id: int | None = eos_token_id if eos_token_id is not None else eos_from_cfg
        if self.eos_token is None and self.eos_id is not None:
            self.eos_token = self._tok.id_to_token(self.eos_id)
        self.bos_id: int | None = self._tok.token_to_id(self.bos_token) if self.bos_token else None

    @staticmethod
    def _find_template(cfg: dict, root: Path) -> str | None:
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (root / "chat_template.jinja").is_file():   # transformers 5 saves it apart
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        return template if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def longest_token_chars(self) -> int:
        """The most characters one token's vocabulary entry spells (byte-level entries a character a byte), so a text
        of more than this many characters a token, times a normalizer's shrinking, cannot fit a token budget."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens (e.g. BOS) as the tokenizer's post-processor adds them."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render `messages` ([{"role", "content"}]) with the checkpoint's Jinja chat template; `extra` are
        further template variables. The text usually holds the BOS token already: encode it with
        add_special_tokens=False."""
        if self.chat_template is None:
            raise CheckpointError("this checkpoint has no chat template (tokenizer_config.json chat_template); "
                                  "use a plain prompt instead")
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise CheckpointError("chat templates need jinja2: pip install jinja2") from None

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                **extra, messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise UserError(f"chat template failed: {e}; check the messages' roles and order") from None
