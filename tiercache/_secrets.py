"""Secrets in URLs: found in every shape they can take, and kept out of everything printed.

A URL carries a secret when its user info holds a password, when a query parameter named like a secret has a
value, or when a query value is (once decoded) a URL or a query that carries one. Every check runs on the
decoded forms as well as the raw text: percent-encoding once, repeatedly or nested (``%253A``), ``+`` for a
space in query values, encoded names (``pass%77ord=``), a ``:`` written ``%3A`` in the user info, a ``?`` in
the user info (``user:pw?x&password=...@host``), a fragment. ``redact_url`` rebuilds the URL with each such
part replaced by ``***``; ``redact_text`` removes every form of every secret (raw, each decoding, the usual
re-encodings) from a message. ``tiercache.config`` re-exports the three public functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, quote_plus, unquote, unquote_plus

from tiercache.errors import ConfigError

__all__ = ["REDACTED", "SECRET_NAMES", "check_url_secrets", "redact_text", "redact_url"]

REDACTED = "***"

SECRET_NAMES = frozenset(
    {
        "password",
        "secret",
        "token",
        "key",
        "api_key",
        "access_key",
        "secret_key",
        "aws_secret_access_key",
        "aws_access_key_id",
        "aws_session_token",
        "sasl_password",
        "secret_access_key",
        "access_key_id",
        "session_token",
    }
)
"""Option names that would carry a secret in a config file; their ``<name>_env`` form is required instead."""

# Query parameters that carry a secret: these names, and any name containing one of the _SECRET_PARTS.
_SECRET_PARAMS = SECRET_NAMES | {"pass", "passwd", "pwd", "auth", "sig", "signature", "sas", "credential"}
_SECRET_PARTS = ("password", "passwd", "secret", "token", "credential", "signature", "private")
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_HOST_PORT_RE = re.compile(r"^[^:%]*(:\d*)?$")  # a host never holds a "%" (an encoded ":" does)
_MAX_DEPTH = 8
"""Rounds of decoding, and levels of URLs nested in values, that are looked into."""
_USERINFO = "user info"
_MIN_REPLACED = 3
"""Forms at least this long are also replaced wherever else they occur in a redacted URL."""


def _secret_param(name: str) -> bool:
    low = name.strip().lower().replace("-", "_")
    if low.endswith("_env"):
        return False
    return low in _SECRET_PARAMS or low.endswith("_key") or any(part in low for part in _SECRET_PARTS)


def _decodings(text: str, plus: bool) -> list[str]:
    """``text`` and each successive percent-decoding of it (the first one reading ``+`` as a space when
    ``plus``, as query strings do), until nothing changes."""
    out = [text]
    for i in range(_MAX_DEPTH):
        following = unquote_plus(out[-1]) if plus and i == 0 else unquote(out[-1])
        if following == out[-1]:
            break
        out.append(following)
    return out


def _all_decodings(text: str) -> list[str]:
    """Every decoding of ``text`` (with ``+`` read as a space or not), ``text`` first, without repeats."""
    return list(dict.fromkeys([*_decodings(text, plus=True), *_decodings(text, plus=False)]))


def _encodings(secret: str) -> set[str]:
    """The forms a client library or a message may write ``secret`` in."""
    return {secret, quote(secret, safe=""), quote(secret), quote_plus(secret, safe=""), quote_plus(secret)}


def _userinfo_span(url: str) -> tuple[int, int] | None:
    """Where the user info of ``url`` sits (start, end before the ``@``), also when the password holds
    ``/``, ``?`` or ``#`` (which end the authority for a strict parser); None if there is none."""
    m = _SCHEME_RE.match(url)
    if m is None:
        return None
    rest = url[m.end() :]
    at = rest.rfind("@")
    if at <= 0 or rest.startswith("/"):
        return None
    candidate = rest[:at]
    end = re.search(r"[/?#]", candidate)
    if end is not None:
        head = candidate[: end.start()]
        if _HOST_PORT_RE.match(head):  # "host:port/path@..." or "bucket/a@b": the "@" is in the path
            return None
    return m.end(), m.end() + at


def _fields(text: str, start: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(name span, value span) of each ``&``-separated ``name=value`` of ``text[start:]`` (a fragment
    included: a ``#`` inside a value stays in it, as a secret's ``#`` would)."""
    out = []
    pos = start
    for part in text[start:].split("&"):
        eq = part.find("=")
        cut = pos + (eq if eq >= 0 else len(part))
        out.append(((pos, cut), (min(cut + 1, pos + len(part)), pos + len(part))))
        pos += len(part) + 1
    return out


@dataclass(frozen=True, slots=True)
class _Secret:
    """One secret found in a URL: what to call it, where its raw text is, every form to keep out of text."""

    option: str
    """Names the ``<option>_env`` to use instead."""
    where: str
    """Where it was found, for the refusal message."""
    span: tuple[int, int]
    """The raw text to replace in the URL it was found in."""
    forms: frozenset[str]
    """The secret as written, each decoding, and their usual encodings."""
    shown: str = REDACTED
    """What stands for ``span`` in a redacted URL."""


def _password_forms(userinfo: str) -> set[str]:
    """The user info and its password, in each decoding; also the password's pieces around ``/?#@`` (a strict
    parser may print a piece as a host, a port or a path)."""
    forms: set[str] = set()
    for layer in _all_decodings(userinfo):
        forms.add(layer)
        _, colon, password = layer.partition(":")
        if colon and password:
            forms |= _encodings(password)
            forms.update(piece for piece in re.split(r"[/?#@]", password) if len(piece) >= 2)
    return forms


def _value_forms(value: str) -> set[str]:
    """A secret query value and its usual encodings; also what a parser may take as the value: the part
    before a ``#`` (a fragment) and before the last ``@`` (a ``?`` in the user info put the query there)."""
    out: set[str] = set()
    for part in {value, value.partition("#")[0], value.rpartition("@")[0]}:
        if part:
            out |= _encodings(part)
    return out


def _scan(url: str, depth: int = 0) -> list[_Secret]:
    """Every secret in ``url``: a password in its user info, then its query's (and fragment's) secrets."""
    found: list[_Secret] = []
    span = _userinfo_span(url)
    if span is not None:
        userinfo = url[span[0] : span[1]]
        if any(":" in layer for layer in _all_decodings(userinfo)):
            found.append(_Secret("password", _USERINFO, span, frozenset(_password_forms(userinfo))))
    question = url.find("?")
    if question >= 0:
        found += _scan_fields(url, question + 1, depth)
    return found


def _scan_fields(text: str, start: int, depth: int) -> list[_Secret]:
    """The secrets of the ``name=value`` fields of ``text[start:]``: a secret-named field with a value, or
    one whose value decodes to a URL or a query carrying a secret (the whole value is then the secret)."""
    found: list[_Secret] = []
    for (name_start, name_end), (value_start, value_end) in _fields(text, start):
        raw_name, raw_value = text[name_start:name_end], text[value_start:value_end]
        names = _all_decodings(raw_name)
        values = _all_decodings(raw_value)
        value_forms = {f for v in values for f in _value_forms(v)}
        for layer in names[1:]:  # an encoded name holding "password=..." itself
            head, eq, tail = layer.partition("=")
            if eq and tail and _secret_param(head):
                name, forms = head.strip(), {raw_name, *names[1:], *_value_forms(tail), *value_forms}
                found.append(
                    _Secret(name, f"query parameter {name!r}", (name_start, value_end), frozenset(forms))
                )
                break
        secret_name = next((n.strip() for n in names if _secret_param(n)), None)
        if secret_name is not None:
            if value_forms:
                where = f"query parameter {secret_name!r}"
                found.append(_Secret(secret_name, where, (value_start, value_end), frozenset(value_forms)))
            continue
        if depth >= _MAX_DEPTH:
            continue
        inner: list[_Secret] = []
        for layer in values:
            if _SCHEME_RE.match(layer):
                inner += _scan(layer, depth + 1)
            elif layer != raw_value and "=" in layer:  # an encoded query: "a%26token%3Dx"
                inner += _scan_fields(layer, 0, depth + 1)
        raw, rest = raw_value, text[value_start:]
        if rest != raw_value and _SCHEME_RE.match(rest):
            # a URL nested as it is whose user info holds a "&" (cut there as a field): the rest is that URL
            cut = [s for s in _scan(rest, depth + 1) if s.where == _USERINFO and s.span[1] > len(raw_value)]
            if cut:
                inner, raw, value_end = inner + cut, rest, len(text)
        if inner:
            name = names[-1].strip()
            forms = {f for v in [*values, raw] if v for f in _encodings(v)} | {
                f for s in inner for f in s.forms
            }
            where = f"query parameter {name!r} holds a URL or query that carries one"
            shown = redact_url(raw) if _SCHEME_RE.match(raw) else REDACTED  # a URL as written is shown
            found.append(_Secret(name, where, (value_start, value_end), frozenset(forms), shown))
    return found


def _rebuild(url: str, parts: Iterable[tuple[tuple[int, int], str]]) -> str:
    """``url`` with each span of ``parts`` replaced by its text (``***`` where spans overlap)."""
    merged: list[tuple[int, int, str]] = []
    for (start, end), shown in sorted(parts):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end), REDACTED)
        else:
            merged.append((start, end, shown))
    out, pos = [], 0
    for start, end, shown in merged:
        out += [url[pos:start], shown]
        pos = end
    out.append(url[pos:])
    return "".join(out)


def check_url_secrets(url: str, where: str) -> None:
    """ConfigError if ``url`` carries a credential: a password in its user info (of any shape, encoded or
    not) or a query parameter named like a secret (also encoded, or inside a URL or a query nested in a
    value). The message names the ``*_env`` option to use and never echoes the secret in any form."""
    found = _scan(url)
    if not found:
        return
    first = found[0]
    what = (
        "a password (found one in its user info" if first.where == _USERINFO else f"a secret ({first.where}"
    )
    raise ConfigError(
        f"{where}: the URL must not carry {what}, {redact_url(url)}); "
        f"put it in the environment and name the variable with the option {first.option}_env"
    )


def redact_url(url: str) -> str:
    """``url`` fit to print or log: its user info, the values of secret-named query parameters and of
    parameters holding a URL or query that carries a secret replaced by ``***``, in every encoding."""
    found = _scan(url)
    parts = [(s.span, s.shown) for s in found]
    userinfo = _userinfo_span(url)
    if userinfo is not None and not any(s.span == userinfo for s in found):  # a user name alone too
        parts.append((userinfo, REDACTED))
    out = _rebuild(url, parts)
    for form in sorted({f for s in found for f in s.forms}, key=len, reverse=True):
        if len(form) >= _MIN_REPLACED:
            out = out.replace(form, REDACTED)
    return out


def redact_text(text: str, url: str) -> str:
    """``text`` (an error message, a log line) with ``url`` (as written or decoded) shown redacted and
    every form of every secret of ``url`` replaced by ``***``."""
    redacted = redact_url(url)
    for layer in sorted(set(_decodings(url, plus=False)), key=len, reverse=True):
        text = text.replace(layer, redacted)
    forms = {f for s in _scan(url) for f in s.forms}
    userinfo = _userinfo_span(url)
    if userinfo is not None:
        forms.add(url[userinfo[0] : userinfo[1]])
    for form in sorted(forms, key=len, reverse=True):
        if form:
            text = text.replace(form, REDACTED)
    return text
