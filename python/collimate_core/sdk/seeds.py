"""Seeds for deterministic replay, and the derivations for common random numbers. Stdlib only.

A seed is 32 bytes written as 64 hex characters (lowercase when this module makes one). The
engine's sandbox CRNG is keyed from it (see `crng_stream` and docs/replay.md); the same seed on the
same template reproduces a replay-mode run bit for bit.

Derivations (version 1; a change of any of them is a new version with a new tag, never an edit):

- ``seed_from_key(key)``: ``HMAC-SHA256(key=b"collimate/seed-from-key/v1", msg=key)``, where a
  ``str`` key is encoded as UTF-8. A stable seed for a name (a task id, a prompt hash).
- ``group_seeds(base, n)[i]``: ``HMAC-SHA256(key=base_seed_bytes,
  msg=b"collimate/group-seeds/v1" || i as 4-byte big-endian)``, for i in 0..n. The seeds of one
  group share nothing visible, yet the whole group is reproducible from the base seed: common
  random numbers for a GRPO group.
- ``crng_stream(seed, n)``: the first ``n`` bytes the sandbox CRNG produces after a reseed with
  ``seed``: the ChaCha20 keystream (20 rounds, 64-bit block counter from 0, nonce 0) under
  ``key = SHA-256(b"collimate-crng-v1" || seed)``. An in-guest agent can compare it with what it
  reads from ``os.urandom`` to confirm that a reseed took effect.

The test vectors are in tests/data/seed_vectors.json.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import struct

__all__ = [
    "SEED_BYTES",
    "crng_key",
    "crng_stream",
    "fresh_seed",
    "group_seeds",
    "parse_seed",
    "seed_from_key",
]

SEED_BYTES = 32
"""A seed is this many bytes (64 hex characters)."""

_SEED_FROM_KEY_TAG = b"collimate/seed-from-key/v1"
_GROUP_SEEDS_TAG = b"collimate/group-seeds/v1"
_CRNG_TAG = b"collimate-crng-v1"
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_MAX_GROUP = 1 << 32

_WHAT = "a seed must be 32 bytes written as 64 hex characters (0-9, a-f)"


def parse_seed(seed: str | bytes | bytearray) -> bytes:
    """The 32 bytes of ``seed``: a string of 64 hex characters (either case), or 32 raw bytes.

    Raises ValueError, saying what a seed must be, for anything else (wrong length, a character
    that is not hex, whitespace, a ``0x`` prefix, another type).
    """
    if isinstance(seed, str):
        if len(seed) != 2 * SEED_BYTES:
            raise ValueError(f"{_WHAT}; got a string of {len(seed)} characters")
        if not _HEX64.fullmatch(seed):
            bad = next((c for c in seed if c not in "0123456789abcdefABCDEF"), "?")
            raise ValueError(f"{_WHAT}; got a string with the non-hex character {bad!r}")
        return bytes.fromhex(seed)
    if isinstance(seed, (bytes, bytearray)):
        if len(seed) != SEED_BYTES:
            raise ValueError(f"{_WHAT} (or exactly 32 raw bytes); got {len(seed)} bytes")
        return bytes(seed)
    raise ValueError(f"{_WHAT}; got a value of type {type(seed).__name__}")


def fresh_seed() -> str:
    """A new seed from the operating system's CSPRNG, as 64 lowercase hex characters."""
    return os.urandom(SEED_BYTES).hex()


def seed_from_key(key: str | bytes) -> str:
    """A stable seed for ``key`` (a ``str`` is taken as its UTF-8 bytes): same key, same seed."""
    if isinstance(key, str):
        data = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
    else:
        raise TypeError(f"seed_from_key takes a str or bytes key, not {type(key).__name__}")
    return hmac.new(_SEED_FROM_KEY_TAG, data, hashlib.sha256).hexdigest()


def group_seeds(base_seed: str, n: int) -> list[str]:
    """``n`` seeds derived from ``base_seed`` (see the module documentation), in order.

    ``group_seeds(b, n)`` is a prefix of ``group_seeds(b, m)`` for n <= m.
    """
    key = parse_seed(base_seed)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, not {type(n).__name__}")
    if not 0 <= n <= _MAX_GROUP:
        raise ValueError(f"n must be between 0 and 2**32; got {n}")
    return [hmac.new(key, _GROUP_SEEDS_TAG + i.to_bytes(4, "big"), hashlib.sha256).hexdigest() for i in range(n)]


def crng_key(seed: str | bytes) -> bytes:
    """The sandbox CRNG's ChaCha20 key after a reseed with ``seed``: SHA-256("collimate-crng-v1" || seed)."""
    return hashlib.sha256(_CRNG_TAG + parse_seed(seed)).digest()


def _rotl(v: int, c: int) -> int:
    return ((v << c) & 0xFFFFFFFF) | (v >> (32 - c))


def _chacha20_block(key_words: tuple[int, ...], counter: int) -> bytes:
    # djb's layout: constants, key, 64-bit block counter (words 12-13), 64-bit nonce = 0.
    state = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574, *key_words,
             counter & 0xFFFFFFFF, counter >> 32, 0, 0]
    x = list(state)

    def qr(a: int, b: int, c: int, d: int) -> None:
        x[a] = (x[a] + x[b]) & 0xFFFFFFFF
        x[d] = _rotl(x[d] ^ x[a], 16)
        x[c] = (x[c] + x[d]) & 0xFFFFFFFF
        x[b] = _rotl(x[b] ^ x[c], 12)
        x[a] = (x[a] + x[b]) & 0xFFFFFFFF
        x[d] = _rotl(x[d] ^ x[a], 8)
        x[c] = (x[c] + x[d]) & 0xFFFFFFFF
        x[b] = _rotl(x[b] ^ x[c], 7)

    for _ in range(10):
        qr(0, 4, 8, 12), qr(1, 5, 9, 13), qr(2, 6, 10, 14), qr(3, 7, 11, 15)
        qr(0, 5, 10, 15), qr(1, 6, 11, 12), qr(2, 7, 8, 13), qr(3, 4, 9, 14)
    return struct.pack("<16I", *((x[i] + state[i]) & 0xFFFFFFFF for i in range(16)))


def chacha20_keystream(key: bytes, n: int, offset: int = 0) -> bytes:
    """``n`` bytes of the ChaCha20 keystream under ``key`` (nonce 0) from byte ``offset``.

    A slow reference implementation (about 20 us per 64-byte block), for checks, not bulk output.
    """
    if len(key) != 32:
        raise ValueError("a ChaCha20 key is 32 bytes")
    if n < 0 or offset < 0:
        raise ValueError("n and offset must be non-negative")
    words = struct.unpack("<8I", key)
    first, skip = divmod(offset, 64)
    out = bytearray()
    block = first
    while len(out) < skip + n:
        out += _chacha20_block(words, block)
        block += 1
    return bytes(out[skip:skip + n])


def crng_stream(seed: str | bytes, n: int, offset: int = 0) -> bytes:
    """The bytes ``offset .. offset + n`` the sandbox CRNG gives the guest after a reseed with ``seed``."""
    return chacha20_keystream(crng_key(seed), n, offset)
