"""Seeds: parsing, the versioned derivations (pinned by tests/data/seed_vectors.json), the sandbox
CRNG's construction, and Vm.reseed end to end on CPython (that last one needs /dev/kvm and the python
rootfs)."""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collimate_core.sdk import seeds as _seeds
from collimate_core.sdk.seeds import (
    chacha20_keystream,
    crng_key,
    crng_stream,
    fresh_seed,
    group_seeds,
    parse_seed,
    seed_from_key,
)

VECTORS = json.loads((Path(__file__).parent / "data" / "seed_vectors.json").read_text(encoding="utf-8"))

seeds = st.binary(min_size=32, max_size=32).map(bytes.hex)
keys = st.one_of(st.text(max_size=64), st.binary(max_size=64))


def is_seed(s: str) -> bool:
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


# --- the committed vectors ----------------------------------------------------------------------


@pytest.mark.parametrize("v", VECTORS["seed_from_key"], ids=lambda v: repr(v.get("key", v.get("key_hex"))))
def test_seed_from_key_vectors(v):
    key = v["key"] if "key" in v else bytes.fromhex(v["key_hex"])
    assert seed_from_key(key) == v["seed"]


@pytest.mark.parametrize("v", VECTORS["group_seeds"], ids=lambda v: v["base"][:8])
def test_group_seeds_vectors(v):
    assert group_seeds(v["base"], len(v["seeds"])) == v["seeds"]


@pytest.mark.parametrize("v", VECTORS["crng"], ids=lambda v: f"{v['seed'][:8]}@{v['offset']}")
def test_crng_vectors(v):
    assert crng_stream(v["seed"], len(v["hex"]) // 2, v["offset"]).hex() == v["hex"]


@pytest.mark.parametrize("v", VECTORS["parse_seed"]["valid"], ids=lambda v: v["seed"][:8])
def test_parse_seed_valid_vectors(v):
    assert parse_seed(v["seed"]) == bytes.fromhex(v["hex"])


@pytest.mark.parametrize("bad", VECTORS["parse_seed"]["invalid"], ids=repr)
def test_parse_seed_invalid_vectors(bad):
    with pytest.raises(ValueError, match="32 bytes written as 64 hex characters"):
        parse_seed(bad)


def test_chacha20_reference_matches_rfc_7539():
    # RFC 7539 appendix A.1, test vectors 1 and 2: zero key, zero nonce, block counters 0 and 1.
    ks = chacha20_keystream(bytes(32), 128)
    assert ks[:32].hex() == "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    assert ks[64:96].hex() == "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"


def test_the_derivations_spelled_out():
    import hashlib
    import hmac

    base = "c0ffee00" * 8
    want = hmac.new(bytes.fromhex(base), b"collimate/group-seeds/v1" + (2).to_bytes(4, "big"), hashlib.sha256)
    assert group_seeds(base, 3)[2] == want.hexdigest()
    assert seed_from_key("k") == hmac.new(b"collimate/seed-from-key/v1", b"k", hashlib.sha256).hexdigest()
    assert crng_key(base) == hashlib.sha256(b"collimate-crng-v1" + bytes.fromhex(base)).digest()


# --- properties ---------------------------------------------------------------------------------


@given(keys)
def test_seed_from_key_is_deterministic_and_well_formed(key):
    s = seed_from_key(key)
    assert is_seed(s)
    assert seed_from_key(key) == s
    assert parse_seed(s).hex() == s


@given(st.text(max_size=32))
def test_str_keys_are_their_utf8_bytes(key):
    assert seed_from_key(key) == seed_from_key(key.encode("utf-8"))


@settings(max_examples=50)
@given(st.lists(keys, min_size=2, max_size=40, unique=True))
def test_seed_from_key_has_no_collisions_on_samples(ks):
    # str and bytes with the same UTF-8 encoding are the same key.
    normal = {k.encode("utf-8") if isinstance(k, str) else k for k in ks}
    assert len({seed_from_key(k) for k in normal}) == len(normal)


@settings(max_examples=50)
@given(seeds, st.integers(min_value=0, max_value=64))
def test_group_seeds_are_deterministic_distinct_and_prefix_stable(base, n):
    g = group_seeds(base, n)
    assert len(g) == n
    assert all(is_seed(s) for s in g)
    assert g == group_seeds(base, n)
    assert len(set(g)) == n
    assert base not in g
    assert group_seeds(base, n + 3)[:n] == g


@settings(max_examples=30)
@given(st.lists(seeds, min_size=2, max_size=8, unique=True))
def test_groups_of_different_bases_do_not_overlap(bases):
    all_seeds = [s for b in bases for s in group_seeds(b, 8)]
    assert len(set(all_seeds)) == len(all_seeds)


@given(st.binary(min_size=32, max_size=32))
def test_parse_seed_round_trips(raw):
    assert parse_seed(raw.hex()) == raw
    assert parse_seed(raw.hex().upper()) == raw
    assert parse_seed(raw) == raw
    assert parse_seed(bytearray(raw)) == raw


@given(st.text(alphabet=string.hexdigits, max_size=80).filter(lambda s: len(s) != 64))
def test_parse_seed_rejects_wrong_lengths(s):
    with pytest.raises(ValueError, match=f"got a string of {len(s)} characters"):
        parse_seed(s)


@given(st.text(min_size=64, max_size=64).filter(lambda s: any(c not in string.hexdigits for c in s)))
def test_parse_seed_rejects_non_hex(s):
    with pytest.raises(ValueError, match="non-hex character"):
        parse_seed(s)


@given(st.binary(max_size=80).filter(lambda b: len(b) != 32))
def test_parse_seed_rejects_raw_bytes_of_the_wrong_length(b):
    with pytest.raises(ValueError, match="32 bytes"):
        parse_seed(b)


@pytest.mark.parametrize("bad", [None, 0, 1.5, ["00"] * 32, memoryview(bytes(32)), object()], ids=repr)
def test_parse_seed_rejects_other_types(bad):
    with pytest.raises(ValueError, match="32 bytes written as 64 hex characters .*; got a value of type"):
        parse_seed(bad)


def test_group_seeds_rejects_bad_arguments():
    with pytest.raises(ValueError, match="64 hex"):
        group_seeds("c0ffee", 2)
    with pytest.raises(ValueError, match="between 0 and 2"):
        group_seeds(fresh_seed(), -1)
    with pytest.raises(TypeError):
        group_seeds(fresh_seed(), 2.0)
    with pytest.raises(TypeError):
        group_seeds(fresh_seed(), True)
    with pytest.raises(TypeError):
        seed_from_key(42)


def test_fresh_seeds_are_seeds_and_fresh():
    ss = {fresh_seed() for _ in range(100)}
    assert len(ss) == 100
    assert all(is_seed(s) for s in ss)


@settings(max_examples=25)
@given(seeds, st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=100))
def test_crng_stream_is_one_stream_whatever_the_offsets(seed, offset, n):
    whole = crng_stream(seed, offset + n)
    assert crng_stream(seed, n, offset) == whole[offset:]


def test_module_exports():
    for name in _seeds.__all__:
        assert hasattr(_seeds, name)


# --- end to end: Vm.reseed on CPython ------------------------------------------------------------

PAUSED = r"""
import ctypes, os
ctypes.CDLL(None).syscall(0x40000000, 7)
first = os.urandom(32).hex()
import random, time
print(first, random.random(), time.time())
"""


@pytest.mark.kvm
def test_vm_reseed_reproduces_a_python_run(rootfs, tmp_path):
    from collimate_core import Vm

    (tmp_path / "tmp").mkdir()
    vm = Vm.spawn(rootfs, ["/usr/bin/python3", "-c", PAUSED], env={"PATH": "/usr/bin:/bin"},
                  mounts={"/tmp": tmp_path / "tmp"})
    try:
        r = vm.run(60)
        assert (r.kind, r.value) == ("yield", 7), r
        with pytest.raises(ValueError, match="exactly 32 bytes"):
            vm.reseed(b"\x00" * 31)
        snap = tmp_path / "snap"
        vm.snapshot(snap)
        seed = seed_from_key("test_vm_reseed_reproduces_a_python_run")
        a, b, c, d = vm.fork(4)
        a.reseed(parse_seed(seed))
        b.reseed(parse_seed(seed), replay=True)
        c.reseed(parse_seed(group_seeds(seed, 1)[0]))
        outs = []
        for k in (a, b, c, d):
            r = k.run(60)
            assert (r.kind, r.code) == ("exited", 0), r.stderr
            outs.append(r.stdout.decode().split())
            k.destroy()
        assert outs[0] == outs[1]
        # The first bytes the guest reads after the reseed are the CRNG's first bytes.
        assert outs[0][0] == crng_stream(seed, 32).hex()
        assert outs[2][0] == crng_stream(group_seeds(seed, 1)[0], 32).hex()
        assert outs[0][1] != outs[2][1]
        assert outs[0][2] == outs[2][2], "virtual clocks do not depend on the seed"
        assert outs[3][0] not in (outs[0][0], outs[2][0])
    finally:
        vm.destroy()


# --- the SDK's seed-ack check through the engine's CRNG ---------------------------------------


@pytest.mark.parametrize("v", [v for v in VECTORS["crng"] if v["offset"] == 0], ids=lambda v: v["seed"][:8])
def test_the_engines_crng_stream_matches_the_vectors(v):
    from collimate_core import _core

    n = len(v["hex"]) // 2
    assert _core._crng_stream(parse_seed(v["seed"]), n).hex() == v["hex"]


@settings(max_examples=50, deadline=None)
@given(seeds, st.integers(min_value=0, max_value=300))
def test_the_engines_crng_stream_is_the_reference_stream(seed, n):
    from collimate_core import _core

    assert _core._crng_stream(parse_seed(seed), n) == crng_stream(seed, n)


def test_the_engines_crng_stream_refuses_a_short_seed():
    from collimate_core import _core

    with pytest.raises(ValueError, match="32 bytes"):
        _core._crng_stream(b"\x00" * 31, 32)


def test_the_seed_ack_is_checked_without_the_python_keystream(monkeypatch):
    """An exec's seed-ack check (`embedded.expected_ack`, once per exec: a fork group's map of 64
    paid it 64 times on one core, holding the GIL) computes the keystream in the engine, not with
    the Python reference (0.2-0.25 ms a call). Fails where it calls `seeds.chacha20_keystream`."""
    from collimate_core.sdk import embedded

    seed = parse_seed(seed_from_key("test_the_seed_ack_is_checked_without_the_python_keystream"))

    def slow(*a, **k):
        raise AssertionError("the Python keystream was used")

    ref = hashlib.sha256(embedded.ACK_CONTEXT + seed + crng_stream(seed, 32)).hexdigest()
    monkeypatch.setattr(_seeds, "chacha20_keystream", slow)
    monkeypatch.setattr(_seeds, "_chacha20_block", slow)
    assert embedded.expected_ack.__wrapped__(seed) == ref
