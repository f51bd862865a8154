"""The aesgcm codec: AES-256-GCM authenticated encryption, last in a chain (BYTES_TO_BYTES, lossless).

Output (little-endian): u8 version (1), u32 key id, 12-byte random nonce, ciphertext, 16-byte tag.

- Associated data: ``u32 len(key) ‖ key (UTF-8) ‖ the frame's static header (CodecContext.aad) ‖ version ‖ key
  id``. A payload moved under another object key, or into a frame with another spec or chain, fails its tag.
- Nonce: 96 random bits per frame (``os.urandom``). NIST SP 800-38D: at most ~2**32 frames per key, so rotate.
- Key id: the first 4 bytes of SHA-256(b"tiercache/aesgcm/key-id/v1" ‖ key); it selects the decryption key on
  read and is shown by ``tiercache inspect``. It identifies a key
  without revealing it (the key is 256 random bits).
- Keys (64 hex characters = 32 bytes) come from the environment or a file, never from the config file:
  ``key_env`` (name of the variable holding the key) or ``key_file`` (path of a file holding it, as 64 hex
  characters or 32 raw bytes) for encryption; for rotation, older keys accepted on read: ``decrypt_keys_env``
  (a variable holding several keys separated by commas or whitespace) and ``decrypt_key_files`` (a list of
  paths). A literal ``key`` option is a ConfigError. Secrets are read when the pipeline is built, not when a
  config is validated.
- Any failure (unknown key id, wrong key, flipped bit) raises ``cryptography``'s InvalidTag or ValueError
  inside   ``decode_into``; the pipeline turns it into FrameError, which the storage manager counts as a miss.

Needs the ``cryptography`` package (``pip install 'tiercache[codecs]'``).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tiercache.errors import ConfigError
from tiercache.serde._codec import Codec, CodecContext, Stage, str_option

if TYPE_CHECKING:
    from typing import Self

    from tiercache.spec import KVSpec

__all__ = ["NONCE_SIZE", "OVERHEAD", "TAG_SIZE", "VERSION", "AesGcmCodec", "key_id", "parse_key"]

VERSION = 1
NONCE_SIZE = 12
TAG_SIZE = 16
_PREFIX = struct.Struct("<BI")  # version, key id
OVERHEAD = _PREFIX.size + NONCE_SIZE + TAG_SIZE
_KEY_ID_DOMAIN = b"tiercache/aesgcm/key-id/v1"
_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")
_SECRET_OPTIONS = ("key", "keys", "decrypt_keys", "secret")
_HAS_INTO = hasattr(AESGCM, "encrypt_into") and hasattr(AESGCM, "decrypt_into")


def key_id(key: bytes) -> int:
    """The u32 id stored in frames encrypted with ``key``."""
    return int.from_bytes(hashlib.sha256(_KEY_ID_DOMAIN + key).digest()[:4], "little")


def parse_key(text: str | bytes, where: str) -> bytes:
    """32 key bytes from 64 hex characters (or, for bytes, 32 raw bytes); ConfigError naming ``where``."""
    if isinstance(text, bytes):
        if len(text) == 32:
            return text
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            raise ConfigError(f"aesgcm key from {where} is not 64 hex characters or 32 bytes") from None
    text = text.strip()
    if not _HEX_KEY.fullmatch(text):
        raise ConfigError(f"aesgcm key from {where} must be 64 hex characters (a 256-bit key)")
    return bytes.fromhex(text)


def _env(name: str, option: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"aesgcm {option}: environment variable {name} is not set")
    return value


def _read_key_file(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"aesgcm {option} {path!r} cannot be read: {exc.strerror}") from None
    return parse_key(data if len(data) == 32 else data.strip(), f"{option} {path!r}")


class AesGcmCodec(Codec):
    """AES-256-GCM with a random nonce, the object key and static header as AAD, and a key id; see module."""

    codec_id: ClassVar[str] = "aesgcm"
    stage: ClassVar[Stage] = Stage.BYTES_TO_BYTES
    lossless: ClassVar[bool] = True
    must_be_last: ClassVar[bool] = True
    encrypts: ClassVar[bool] = True
    config_options: ClassVar[tuple[str, ...]] = (
        "key_env",
        "key_file",
        "decrypt_keys_env",
        "decrypt_key_files",
    )

    def __init__(
        self,
        key: bytes,
        *,
        decrypt_keys: Sequence[bytes] = (),
        key_env: str | None = None,
        key_file: str | None = None,
        decrypt_keys_env: str | None = None,
        decrypt_key_files: Sequence[str] = (),
        nonce_source: Callable[[int], bytes] = os.urandom,
    ) -> None:
        """Encrypt with ``key`` (32 bytes); also decrypt with ``decrypt_keys``.

        ``key_env``/``key_file``/``decrypt_keys_env``/``decrypt_key_files`` only record where the keys
        came from (``get_config`` returns them, never the keys). ``nonce_source(n)`` returns ``n`` nonce
        bytes; it exists for tests (golden files) and is not reachable from a config: never fix the nonce in
        production.
        """
        keys = [bytes(key), *(bytes(k) for k in decrypt_keys)]
        for k in keys:
            if len(k) != 32:
                raise ConfigError(f"aesgcm keys are 32 bytes (AES-256), got {len(k)}")
        self._key_id = key_id(keys[0])
        self._ciphers: dict[int, AESGCM] = {}
        for k in keys:
            self._ciphers.setdefault(key_id(k), AESGCM(k))
        self._encrypt = self._ciphers[self._key_id]
        self._nonce_source = nonce_source
        self.key_env = key_env
        self.key_file = key_file
        self.decrypt_keys_env = decrypt_keys_env
        self.decrypt_key_files = tuple(decrypt_key_files)

    @property
    def key_id(self) -> int:
        """Id of the encryption key (stored in every frame this codec writes)."""
        return self._key_id

    @property
    def key_ids(self) -> tuple[int, ...]:
        """Ids of every key accepted on read (the encryption key first)."""
        return tuple(self._ciphers)

    # ----- config -----
    @classmethod
    def valid_options(cls, config: Mapping[str, object]) -> dict[str, object]:
        """The options, names and shapes checked; no environment variable or key file is read."""
        secret = sorted(k for k in config if k in _SECRET_OPTIONS)
        if secret:
            raise ConfigError(
                f"aesgcm option(s) {', '.join(secret)} would put a secret in the config: "
                "use key_env or key_file (and decrypt_keys_env / decrypt_key_files for rotation)"
            )
        options = cls.check_options(config)
        for name in ("key_env", "key_file", "decrypt_keys_env"):
            str_option("aesgcm", name, options.get(name))
        files = options.get("decrypt_key_files", [])
        if not isinstance(files, list | tuple) or not all(isinstance(f, str) and f for f in files):
            raise ConfigError(f"aesgcm decrypt_key_files must be a list of paths, not {files!r}")
        if (options.get("key_env") is None) == (options.get("key_file") is None):
            raise ConfigError(
                "aesgcm needs exactly one of key_env (64 hex chars in the environment) or key_file"
            )
        return options

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Self:
        """Build from options, reading the keys from the environment / key files (ConfigError if missing)."""
        options = cls.valid_options(config)
        key_env = options.get("key_env")
        key_file = options.get("key_file")
        if isinstance(key_env, str):
            key = parse_key(_env(key_env, "key_env"), f"${key_env}")
        else:
            assert isinstance(key_file, str)
            key = _read_key_file(key_file, "key_file")
        decrypt: list[bytes] = []
        env = options.get("decrypt_keys_env")
        if isinstance(env, str):
            parts = [p for p in re.split(r"[\s,]+", _env(env, "decrypt_keys_env")) if p]
            decrypt += [parse_key(p, f"${env}") for p in parts]
        files = [str(f) for f in options.get("decrypt_key_files", []) or []]  # type: ignore[attr-defined]
        decrypt += [_read_key_file(f, "decrypt_key_files") for f in files]
        return cls(
            key,
            decrypt_keys=decrypt,
            key_env=key_env if isinstance(key_env, str) else None,
            key_file=key_file if isinstance(key_file, str) else None,
            decrypt_keys_env=env if isinstance(env, str) else None,
            decrypt_key_files=files,
        )

    def get_config(self) -> dict[str, object]:
        """Where the keys come from (variable names, paths), never the keys."""
        config: dict[str, object] = {"id": self.codec_id}
        if self.key_env is not None:
            config["key_env"] = self.key_env
        if self.key_file is not None:
            config["key_file"] = self.key_file
        if self.decrypt_keys_env is not None:
            config["decrypt_keys_env"] = self.decrypt_keys_env
        if self.decrypt_key_files:
            config["decrypt_key_files"] = list(self.decrypt_key_files)
        return config

    # ----- encode / decode -----
    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        """Input plus version, key id, nonce and tag (33 bytes)."""
        return nbytes + OVERHEAD

    @staticmethod
    def _aad(ctx: CodecContext, prefix: bytes | memoryview) -> bytes:
        key = ctx.key.encode("utf-8")
        return b"".join((struct.pack("<I", len(key)), key, ctx.aad, prefix))

    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Encrypt ``src`` with the current key and a fresh nonce."""
        nonce = self._nonce_source(NONCE_SIZE)
        if len(nonce) != NONCE_SIZE:
            raise ValueError(f"nonce source returned {len(nonce)} bytes, expected {NONCE_SIZE}")
        _PREFIX.pack_into(dst, 0, VERSION, self._key_id)
        head = _PREFIX.size + NONCE_SIZE
        dst[_PREFIX.size : head] = nonce
        aad = self._aad(ctx, dst[: _PREFIX.size])
        n = head + len(src) + TAG_SIZE
        if _HAS_INTO:
            self._encrypt.encrypt_into(nonce, src, aad, dst[head:n])
        else:  # older cryptography without encrypt_into: one extra copy
            dst[head:n] = self._encrypt.encrypt(nonce, src, aad)
        return n

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Check the tag and decrypt into ``dst``; InvalidTag / ValueError on any fault."""
        if len(src) < OVERHEAD:
            raise ValueError(
                f"aesgcm payload of {len(src)} bytes is shorter than its {OVERHEAD}-byte overhead"
            )
        version, kid = _PREFIX.unpack_from(src, 0)
        if version != VERSION:
            raise ValueError(f"unknown aesgcm payload version {version}")
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise ValueError(f"frame encrypted with key id {kid:08x}, which is not configured")
        head = _PREFIX.size + NONCE_SIZE
        n = len(src) - head - TAG_SIZE
        if n > len(dst):
            raise ValueError(f"aesgcm payload of {n} bytes overruns a {len(dst)}-byte destination")
        nonce = bytes(src[_PREFIX.size : head])
        aad = self._aad(ctx, src[: _PREFIX.size])
        if _HAS_INTO:
            cipher.decrypt_into(nonce, src[head:], aad, dst[:n])
        else:
            dst[:n] = cipher.decrypt(nonce, src[head:], aad)
        return n
