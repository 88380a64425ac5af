"""Tokenizer of a Hugging Face model directory: `tokenizer.json` through `tokenizers`,
the chat template from `tokenizer_config.json` through jinja2. Torch-free (the gateway
tokenizes to route).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.config import ModelDirError

# Ids from which decode lets go of the GIL (decode_batch costs a few µs more a call).
_LONG_DECODE = 4096


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` filter (jinja's escapes HTML characters; templates that
    render tools and tool calls with it must give the same text as transformers)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(tok: Any) -> str | None:
    if tok is None:
        return None
    return tok["content"] if isinstance(tok, dict) else str(tok)


class Tokenizer:
    """Encodes text and chat conversations to token ids and back."""

    def __init__(self, model_dir: str) -> None:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelDirError(f"{model_dir!r} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(path)
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values()), None))
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = {
            self._tok.token_to_id(t.content)
            for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self._template: Any = None
        # decode([id]) per skip_special_tokens value (`piece`): a pure function of the id.
        self._pieces: tuple[dict[int, str], dict[int, str]] = ({}, {})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Releases the GIL while it works (`encode_batch`; a lone `encode` holds it), so
        a long prompt tokenized on a thread does not stall the caller's event loop (the
        gateway's): a megabyte takes about a second."""
        enc = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return list(enc.ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """A long list is decoded with the GIL released (`decode_batch`; a lone `decode`
        holds it: 600k ids ~0.1 s); a short one, the common case, the direct way."""
        if len(token_ids) < _LONG_DECODE:  # (positional: a keyword costs the call ~10%)
            return str(self._tok.decode(token_ids, skip_special_tokens))
        return str(self._tok.decode_batch([list(token_ids)],
                                          skip_special_tokens=skip_special_tokens)[0])

    def piece(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """`decode([token_id])`, from memory after its first decode: the detokenizer's
        joining context, one per request in every decode step."""
        pieces = self._pieces[skip_special_tokens]
        t = pieces.get(token_id)
        if t is None:
            t = pieces[token_id] = self.decode([token_id], skip_special_tokens)
        return t

    def decode_stream(self, context: Sequence[int], skip_special_tokens: bool = True,
                      ) -> Callable[[int], str | None] | None:
        """An incremental decoder continuing `context` (the prompt's last ids): each call
        takes the next id and returns the text it completes, or None while its character
        is incomplete; it raises where a longer window's decode does not begin with the
        text already returned. `tokenizers`' DecodeStream, vLLM's fast detokenizer: a
        step's two decodes (the joining context and the new text) in one native call.
        None where `context` ends inside a character: the stream would return the
        context's own text with the first id."""
        if self.decode(context, skip_special_tokens).endswith("\ufffd"):
            return None
        stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._tok)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (e.g. byte-level "Ġthe"), as transformers'
        convert_ids_to_tokens."""
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Renders a conversation to the prompt text the model was trained on.
        `tools`: OpenAI function tools, for templates that describe them to the model
        (as transformers' `apply_chat_template(tools=...)`). `template_kwargs`: more
        template variables (vLLM's chat_template_kwargs), overriding the ones above.

        Raises ValueError when the model has no chat template or the template rejects
        the conversation.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a plain prompt")
        if self._template is None:
            # Same environment settings as transformers' apply_chat_template.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)
        try:
            variables = {"add_generation_prompt": add_generation_prompt, "tools": tools,
                         "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                         **(template_kwargs or {})}
            return str(self._template.render(messages=messages, **variables))
        except TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        # The template already places BOS; encoding it again would double it.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools,
                                                    template_kwargs),
                           add_special_tokens=False)


def bad_word_ids(tokenizer: Tokenizer, words: Sequence[str],
                 vocab_size: int) -> list[list[int]]:
    """Each word's token ids as it starts the text and, when that is a different word
    of as many tokens, after a space (vLLM's SamplingParams.update_from_tokenizer).
    Raises ValueError for a word that tokenizes to nothing or to an id outside the
    model's `vocab_size` (a tokenizer may know more tokens than the model draws)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, "
                             f"got {word!r}")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    outside = [t for ids in out for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(f"The model vocabulary size is {vocab_size}, but the following tokens "
                         f"were specified as bad: {outside}. All token id values should be "
                         f"integers satisfying: 0 <= token_id <= {vocab_size - 1}.")
    return out
