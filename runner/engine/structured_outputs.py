"""Structured outputs: a request's grammar compiled when it is added, its matcher fed every token.

The backend is xgrammar. One `GrammarCompiler` per engine holds the tokenizer's vocabulary as xgrammar
sees it (built on the first constrained request, since that costs a pass over the vocabulary) and
compiles each request's `StructuredOutputsParams` into a grammar (xgrammar caches compiled grammars by
their source, bounded in bytes, so a schema shared by many requests is compiled once). An invalid schema,
regex or grammar is a `ValueError` naming the field, raised by `PromptProcessor` before the request is
built. Each request then owns a `RequestGrammar`: an xgrammar matcher that accepts the request's tokens
as the host reads them (`Request.append_output_token`) and says when the grammar has ended. The per-step
token masks are filled from those matchers by `runner.engine.token_masks`.

Special tokens (placeholders, chat markers, reserved ids) are never allowed inside a constrained output
(EOS aside, once the grammar is complete): they decode to nothing with `skip_special_tokens`, so the text
would no longer be what the grammar checked. Ids past the tokenizer's vocabulary (a padded LM head) are
never allowed either.

`check_structured_outputs` runs the same conversions without a tokenizer, for callers that must refuse a
bad grammar before the engine sees it (the server's API process answers 400 there).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerFast

from runner.sampling_params import StructuredOutputsParams

#: bound on the compiled grammars xgrammar keeps for reuse (each distinct schema of a server's clients)
GRAMMAR_CACHE_BYTES = 256 << 20
_XGRAMMAR_HINT = "structured outputs need xgrammar: pip install 'bridge[structured]'"
# xgrammar's C++ errors start with a time stamp and a source location, which say nothing to a caller.
_LOCATION = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_MAX_MESSAGE = 300
# xgrammar (0.2) writes a string with minLength/maxLength as a repetition of this class, which lets raw
# control characters U+0000-U+001F (CR and LF aside) into the string: invalid JSON (upstream issue 800).
# The grammar's text is rewritten with them excluded, as its unbounded strings already do.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'
# Its string characters are code points read from UTF-8 bytes, and it reads the bytes ED A0-BF xx (the
# UTF-16 surrogates U+D800-U+DFFF, which UTF-8 never holds) as characters too: with byte-level tokens a
# constrained string could hold bytes that no strict decoder reads, which decode to U+FFFD (and then
# break a maxLength). Every JSON string character class leaves them out as well.
_STRING_CLASS_START = r'[^\0-\x1f\"\\'
_SURROGATES = r'\uD800-\uDFFF'

#: compiled grammars the engine keeps at hand by source (xgrammar's own cache is behind them), and
#: constraints `check_structured_outputs` found valid (a server checks every request's)
_RECENT_GRAMMARS = 64
_RECENT_CHECKS = 256
_checked: OrderedDict[tuple, None] = OrderedDict()


def _xgrammar():
    """The xgrammar module, imported on first use: it loads a large native library, which only an
    engine that meets a constrained request (or a server checking one) should pay for."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ValueError(_XGRAMMAR_HINT) from exc
    return xgrammar


def _message(exc: BaseException) -> str:
    text = _LOCATION.sub("", str(exc)).strip() or type(exc).__name__
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


def _ebnf_literal(text: str) -> str:
    """`text` as a double-quoted EBNF string literal (xgrammar's escapes)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar whose sentences are exactly `choices` (vLLM builds `choice` the same way)."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _is_lark(grammar: str) -> bool:
    """EBNF rules are written `name ::= ...`; a grammar without one is read as Lark (`name: ...`)."""
    return "::=" not in grammar


def _field(params: StructuredOutputsParams) -> str:
    return f"structured_outputs.{params.kind}"


def json_schema_grammar(xgr: Any, schema: str, any_whitespace: bool) -> Any:
    """xgrammar's grammar of a JSON schema, with every string kept to valid JSON characters of valid
    UTF-8."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    text = str(grammar)
    fixed = text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR).replace(_STRING_CLASS_START,
                                                                        _STRING_CLASS_START + _SURROGATES)
    return xgr.Grammar.from_ebnf(fixed) if fixed != text else grammar


def _source_key(params: StructuredOutputsParams) -> tuple:
    """What a constraint's grammar depends on, as a dictionary key."""
    kind = params.kind
    return (kind, params.json_text if kind == "json" else repr(getattr(params, kind)),
            params.disable_any_whitespace)


def _grammar_source(xgr: Any, params: StructuredOutputsParams) -> Any:
    """What the compiler reads for `params`: a Grammar (JSON, choice, EBNF) or a regex / Lark text."""
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    if kind == "json":
        return json_schema_grammar(xgr, params.json_text, any_whitespace)
    if kind == "json_object":
        return json_schema_grammar(xgr, '{"type": "object"}', any_whitespace)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
    if kind == "grammar" and not _is_lark(params.grammar):
        return xgr.Grammar.from_ebnf(params.grammar)
    return params.regex if kind == "regex" else params.grammar


def check_structured_outputs(params: StructuredOutputsParams, where: str | None = None) -> None:
    """Convert `params`' constraint to an xgrammar grammar without a tokenizer; a `ValueError` naming
    `where` (default: the field) when it cannot be (an invalid schema, regex or grammar)."""
    key = _source_key(params)
    if key in _checked:
        _checked.move_to_end(key)
        return
    xgr = _xgrammar()
    where = where or _field(params)
    try:
        source = _grammar_source(xgr, params)
        if params.kind == "regex":
            xgr.Grammar.from_regex(source)
        elif isinstance(source, str):
            xgr.Grammar.from_lark(source)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {_message(exc)}") from None
    _checked[key] = None
    if len(_checked) > _RECENT_CHECKS:
        _checked.popitem(last=False)


class RequestGrammar:
    """One request's matcher: the grammar's state after the tokens the host has read.

    `accept_token` is called for every output token in order (the sampler only draws allowed ones);
    a token the grammar refuses anyway is kept in `rejected_token`, and the request fails with it.
    """

    __slots__ = ("matcher", "rejected_token")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.rejected_token: int | None = None

    def accept_token(self, token_id: int) -> bool:
        if self.rejected_token is not None:
            return False
        ok = self.matcher.accept_token(token_id)
        if not ok:
            self.rejected_token = token_id
        return ok

    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted EOS, or it is complete and cannot go on)."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles requests' structured-outputs params for one engine's tokenizer and vocabulary.

    `vocab_size` is the width of the model's logits (a padded LM head's extra ids are never allowed);
    `eos_token_ids` are the ids that end a request: the only ones a complete grammar allows.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._recent: OrderedDict[tuple, Any] = OrderedDict()  # source -> compiled, least recent first
        self.num_compiles = 0  # grammars compiled (or found in xgrammar's cache), not counting _recent hits

    def set_eos_token_ids(self, eos_token_ids: Sequence[int]) -> None:
        """The engine's EOS ids changed: the vocabulary is built again (with them as its stop tokens)
        at the next compile."""
        if sorted(set(eos_token_ids)) != sorted(set(self.eos_token_ids)):
            self.eos_token_ids = list(eos_token_ids)
            self._compiler = None
            self._recent.clear()

    def _build(self):
        xgr = _xgrammar()
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer in the model directory")
        stop = sorted({int(t) for t in self.eos_token_ids}) or None
        try:
            base = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=stop)
        except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError("structured outputs cannot read this model's tokenizer: "
                             f"{_message(exc)}") from None
        info = base
        # A fast tokenizer's vocabulary is what xgrammar itself reads (tiktoken and SentencePiece ones take
        # other paths there, kept as they are).
        vocab = self.tokenizer.get_vocab() if isinstance(self.tokenizer, PreTrainedTokenizerFast) else None
        if vocab:
            # An empty string is how xgrammar marks a token that never appears in a constrained output.
            encoded = [""] * self.vocab_size
            for token, idx in vocab.items():
                if 0 <= idx < self.vocab_size:
                    encoded[idx] = token
            for idx in _special_ids(self.tokenizer) - set(stop or ()):
                if 0 <= idx < self.vocab_size:
                    encoded[idx] = ""
            info = xgr.TokenizerInfo(encoded, vocab_type=base.vocab_type, vocab_size=self.vocab_size,
                                     stop_token_ids=stop, add_prefix_space=base.add_prefix_space)
        threads = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else os.cpu_count() or 1))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        return self._compiler

    def compile(self, params: StructuredOutputsParams, where: str = "") -> Any:
        """The compiled grammar of `params` (shared by every request with the same constraint); a
        `ValueError` prefixed with `where` naming the field when it does not compile."""
        compiler = self._compiler or self._build()
        kind = params.kind
        key = _source_key(params)
        compiled = self._recent.get(key)
        if compiled is not None:
            self._recent.move_to_end(key)
            return compiled
        xgr = _xgrammar()
        try:
            source = _grammar_source(xgr, params)
            if kind == "regex":
                compiled = compiler.compile_regex(source)
            elif isinstance(source, str):
                compiled = compiler.compile_lark(source)
            else:
                compiled = compiler.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"{where}{_field(params)}: {_message(exc)}") from None
        self.num_compiles += 1
        self._recent[key] = compiled
        if len(self._recent) > _RECENT_GRAMMARS:
            self._recent.popitem(last=False)
        return compiled

    def request_grammar(self, compiled: Any, eos_token_ids: Sequence[int]) -> RequestGrammar:
        """A fresh matcher over `compiled` for one request that `eos_token_ids` end. Without EOS ids
        the grammar ends the request as soon as it is complete and cannot go on."""
        xgr = _xgrammar()
        if eos_token_ids:
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(eos_token_ids))
        else:
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return RequestGrammar(matcher)


def _special_ids(tokenizer: Any) -> set[int]:
    """Every special token id of `tokenizer` (named ones and added tokens marked special)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}
    for idx, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(idx))
    return ids


__all__ = ["GRAMMAR_CACHE_BYTES", "GrammarCompiler", "RequestGrammar", "check_structured_outputs",
           "choice_grammar", "json_schema_grammar"]
