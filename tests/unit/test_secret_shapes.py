"""A secret in a URL is never printed, whatever its shape: percent-encoded (once, twice, any character),
``%26``/``%2B`` inside a value, an encoded secret name, an encoded ``:`` in the user info, a ``?`` in the user
info followed by ``&password=``, a URL carrying a secret nested (encoded or not) in a query value.

Every shape is refused (``check_url_secrets``, so config loading and ``open_adapter``) with a message naming
the ``*_env`` option; neither that message, ``redact_url``, ``redact_text`` nor ``tiercache check`` (text and
``--json``) holds the secret in any of its forms."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.cli.main import main
from tiercache.config import check_url_secrets, redact_text, redact_url
from tiercache.errors import ConfigError

ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
SPECIALS = "/?#@:&+%=; !$'()*,[]~<>|^`{}"
SECRET_PARAMS = [
    "password",
    "pass",
    "token",
    "secret",
    "aws_secret_access_key",
    "api-key",
    "sig",
    "private_key",
]
NESTING_PARAMS = ["endpoint_url", "metadata", "url", "backup"]


@dataclass(frozen=True)
class Shape:
    url: str
    secret: str
    forms: frozenset[str]
    """The secret, its words and every encoding of it written into the URL."""


def _encode(secret: str, draw: st.DrawFn, must: str) -> tuple[str, list[str]]:
    """``secret`` with each character percent-encoded when in ``must`` or at random; also the raw form of
    each ``zq`` word, so that a partial leak of an encoded word is seen too."""
    out: list[str] = []
    for ch in secret:
        encode = ch in must or (ch not in ALNUM and draw(st.booleans())) or draw(st.integers(0, 9)) == 0
        out.append(quote(ch, safe="") if encode or ch == "%" else ch)
    raw = "".join(out)
    words, pos = [], 0
    for word in _words(secret):
        start = secret.index(word, pos)
        words.append("".join(out[start : start + len(word)]))
        pos = start + len(word)
    return raw, words


def _words(secret: str) -> list[str]:
    return [w for w in "".join(c if c in ALNUM else " " for c in secret).split() if w.startswith("zq")]


def _encodings(text: str) -> set[str]:
    return {text, quote(text, safe=""), quote(text), quote_plus(text, safe=""), quote_plus(text)}


@st.composite
def secrets(draw: st.DrawFn) -> str:
    words = draw(st.lists(st.text(ALNUM, min_size=4, max_size=6), min_size=2, max_size=3))
    glue = draw(st.lists(st.sampled_from(SPECIALS), min_size=len(words) - 1, max_size=len(words) - 1))
    parts = [f"zq{words[0]}"]
    for sep, word in zip(glue, words[1:], strict=True):
        parts += [sep, f"zq{word}"]
    return "".join(parts)


def _nest(text: str, times: int) -> str:
    for _ in range(times):
        text = quote(text, safe="")
    return text


@st.composite
def shapes(draw: st.DrawFn, depth: int = 0) -> Shape:
    secret = draw(secrets())
    kind = draw(
        st.sampled_from(
            ["userinfo", "userinfo_colon", "query", "userinfo_query"] + (["nested"] if depth == 0 else [])
        )
    )
    scheme = draw(st.sampled_from(["redis", "rediss", "valkey", "s3", "http"]))
    host = draw(st.sampled_from(["127.0.0.1:1", "cache.example:6379", "bucket"]))
    path = draw(st.sampled_from(["", "/0", "/prefix/x"]))
    times = draw(st.integers(1, 2))
    if kind == "nested":
        inner = draw(shapes(depth=1))
        nesting = draw(st.integers(0, 2))
        param = draw(st.sampled_from(NESTING_PARAMS))
        url = f"{scheme}://{host}{path}?{param}={_nest(inner.url, nesting)}"
        forms = {_nest(f, n) for f in inner.forms for n in range(nesting + 1)}
        return Shape(url, inner.secret, frozenset(forms))
    must = "%" if kind.startswith("userinfo") and kind != "userinfo_query" else "%&"
    raw, raw_words = _encode(secret, draw, must)
    raw = _nest(raw, times - 1)
    name = draw(st.sampled_from(SECRET_PARAMS))
    if draw(st.booleans()):  # an encoded name: "pass%77ord", also twice
        name = "".join(quote(f"%{ord(c):02X}", safe="") if c == "s" else c for c in name)
    user = draw(st.sampled_from(["", "u", "default"]))
    if kind == "userinfo":
        url = f"{scheme}://{user}:{raw}@{host}{path}"
    elif kind == "userinfo_colon":
        url = f"{scheme}://{user}%3A{raw}@{host}{path}"
    elif kind == "userinfo_query":
        url = f"{scheme}://{user or 'u'}?x&{name}={raw}@{host}{path}"
    else:
        before = draw(st.sampled_from(["", "db=0&", "prefix=a&"]))
        after = draw(st.sampled_from(["", "&pool_size=4", "&prefix=b"]))
        url = f"{scheme}://{host}{path}?{before}{name}={raw}{after}"
    forms = {*_encodings(secret), raw, *_words(secret), *(w for w in raw_words if len(w) >= 4)}
    return Shape(url, secret, frozenset(forms))


def _leaks(text: str, shape: Shape) -> list[str]:
    return sorted(form for form in shape.forms if form and form in text)


def _check_output(tmp_path: Path, url: str, as_json: bool) -> tuple[int, str]:
    config = tmp_path / "shape.toml"
    config.write_text(f'[[tiers]]\nname = "t"\nurl = {json.dumps(url)}\n')
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["check", str(config), *(["--json"] if as_json else [])])
    return code, out.getvalue()


def _assert_never_printed(shape: Shape, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="_env") as info:
        check_url_secrets(shape.url, "tier 't'")
    message = str(info.value)
    assert _leaks(message, shape) == [], message
    redacted = redact_url(shape.url)
    assert _leaks(redacted, shape) == [], redacted
    assert "***" in redacted
    text = redact_text(f"failed: {shape.url} (secret {shape.secret!r} / {quote(shape.secret)})", shape.url)
    assert _leaks(text, shape) == [], text
    for as_json in (False, True):
        code, output = _check_output(tmp_path, shape.url, as_json)
        assert code == 2, output  # refused when the config loads
        assert "_env" in output
        assert _leaks(output, shape) == [], output


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(shape=shapes())
def test_no_shape_of_url_prints_its_secret(shape: Shape, tmp_path: Path) -> None:
    _assert_never_printed(shape, tmp_path)


S = "zqSe&cr+et/zqAb%cd"
SQ = quote(S, safe="")
SHAPES = [
    f"redis://u:{SQ}@127.0.0.1:1/0",
    f"redis://u%3A{SQ}@127.0.0.1:1/0",
    f"redis://127.0.0.1:1/0?password={SQ}",
    f"redis://127.0.0.1:1/0?password={quote_plus(S, safe='')}",
    f"redis://127.0.0.1:1/0?password={quote(SQ, safe='')}",
    "redis://127.0.0.1:1/0?password=zqSe%26cr%2Bet%2FzqAb%25cd",
    f"redis://127.0.0.1:1/0?pass%77ord={SQ}",
    f"redis://127.0.0.1:1/0?pass%2577ord={SQ}",
    f"redis://127.0.0.1:1/0?password%3D{SQ}=",
    f"s3://b/p?endpoint_url={quote('http://ak:' + SQ + '@h:1', safe='')}",
    f"s3://b/p?endpoint_url={_nest('http://ak:' + SQ + '@h:1', 2)}",
    f"s3://b/p?endpoint_url={quote('http://h:1/?token=' + SQ, safe='')}",
    f"s3://b/p?endpoint_url=http://ak:{SQ}@h:1",
    f"s3://b/p?x={quote('a&token=' + SQ, safe='')}",
    f"redis://u?x&password={SQ}@127.0.0.1:1/0",
    f"redis://u:p?x&password={SQ}@127.0.0.1:1/0",
]


@pytest.mark.parametrize("url", SHAPES)
def test_known_shapes_are_refused_and_never_printed(url: str, tmp_path: Path) -> None:
    forms = {*_encodings(S), SQ, quote(SQ, safe=""), "zqSe", "zqAb", "cr+et", "cr%2Bet", "Ab%cd", "Ab%25cd"}
    _assert_never_printed(Shape(url, S, frozenset(forms)), tmp_path)
