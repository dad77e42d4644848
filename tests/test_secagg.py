"""Tests of the buffered secure aggregation (fedapp/secagg.py; FedREP spec 3.1, 4.3, 11.6, 11.19, 12 items 9-10).

Each test checks against an independent truth: plain integer sums of the unmasked quantized vectors, plain float
means, Flower's own primitives, or a statistical property with a stated false-alarm probability. Statistical tests
use fixed key pairs (derived from fixed integers) and fixed numpy seeds, so they are deterministic; the stated
tolerances say how unlikely a failure would be for a correct implementation with other seeds.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from numpy.typing import NDArray

from fedapp.secagg import (
    DEFAULT_CLIP,
    DEFAULT_LEVELS,
    MODULUS,
    buffer_partition,
    check_public_key,
    decode_buffer_mean,
    decode_buffers,
    dequantize,
    expand_mask,
    mask_label,
    masked_upload,
    new_keypair,
    pairwise_key,
    quantize,
)

C = DEFAULT_CLIP
Q = DEFAULT_LEVELS
STEP = 2 * C / (Q - 1)  # one quantization step in value units, about 3.8e-6


def _keypair(secret: int) -> tuple[bytes, bytes]:
    """A deterministic SECP384R1 key pair in Flower's PEM encoding (fixed keys make statistical tests repeatable)."""
    sk = ec.derive_private_key(secret, ec.SECP384R1())
    return (
        sk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        sk.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
    )


def _uploads(
    xs: Mapping[int, NDArray[np.float64]],
    buffers: Sequence[Sequence[int]],
    keys: Mapping[int, tuple[bytes, bytes]],
    run_seed: int = 0,
    server_round: int = 1,
) -> dict[int, NDArray[np.uint32]]:
    """Every buffer member's masked upload, as the clients would compute it after the phase-2 instruction."""
    out: dict[int, NDArray[np.uint32]] = {}
    for buffer_id, members in enumerate(buffers):
        label = mask_label(run_seed, server_round, buffer_id)
        for me in members:
            peers = {j: keys[j][1] for j in members if j != me}
            out[me] = masked_upload(xs[me], me, keys[me][0], peers, label, np.random.default_rng(1000 + me))
    return out


# --- key agreement -----------------------------------------------------------------------------------------------


def test_new_keypair_is_fresh_pem() -> None:
    sk1, pk1 = new_keypair()
    sk2, pk2 = new_keypair()
    assert sk1.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert pk1.startswith(b"-----BEGIN PUBLIC KEY-----")
    assert sk1 != sk2 and pk1 != pk2


def test_pairwise_key_is_symmetric_and_matches_flower() -> None:
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key

    (sk_a, pk_a), (sk_b, pk_b), (sk_c, pk_c) = new_keypair(), new_keypair(), new_keypair()
    k_ab = pairwise_key(sk_a, pk_b)
    assert len(k_ab) == 32
    assert k_ab == pairwise_key(sk_b, pk_a)  # ECDH symmetry: both peers derive the same key
    assert k_ab != pairwise_key(sk_a, pk_c) and k_ab != pairwise_key(sk_c, pk_b)
    # Independent truth: Flower's generate_shared_key on keys parsed by `cryptography` directly, base64-decoded.
    sk = serialization.load_pem_private_key(sk_a, password=None)
    pk = serialization.load_pem_public_key(pk_b)
    assert isinstance(sk, ec.EllipticCurvePrivateKey) and isinstance(pk, ec.EllipticCurvePublicKey)
    assert k_ab == base64.urlsafe_b64decode(generate_shared_key(sk, pk))


def test_check_public_key_accepts_ours_and_rejects_the_rest() -> None:
    _, pk = new_keypair()
    check_public_key(pk)
    other_curve = ec.generate_private_key(ec.SECP256R1()).public_key()
    pem256 = other_curve.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    sk, _ = _keypair(1)
    for bad in [b"", b"garbage", pk[:100], pem256, sk]:
        with pytest.raises(ValueError):
            check_public_key(bad)
    with pytest.raises(ValueError):
        pairwise_key(sk, pem256)  # a client given a bad peer key fails cleanly (its buffer is then discarded)


def test_cryptography_fallback_matches_flower() -> None:
    """The fallbacks used when flwr lacks the primitives produce the same formats and the same shared key."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key

    from fedapp import secagg

    helpers = secagg._cryptography_keypair_helpers()
    sk_a, pk_a = helpers["generate_key_pairs"]()
    sk_b, pk_b = helpers["generate_key_pairs"]()
    sk_a = helpers["bytes_to_private_key"](helpers["private_key_to_bytes"](sk_a))
    pk_b = helpers["bytes_to_public_key"](helpers["public_key_to_bytes"](pk_b))
    assert secagg._cryptography_shared_key(sk_a, pk_b) == generate_shared_key(sk_a, pk_b)
    assert pairwise_key(helpers["private_key_to_bytes"](sk_b), helpers["public_key_to_bytes"](pk_a)) == (
        base64.urlsafe_b64decode(generate_shared_key(sk_a, pk_b))
    )


# --- masks -------------------------------------------------------------------------------------------------------


def test_mask_label_names_run_round_buffer() -> None:
    assert mask_label(7, 3, 2) == b"fedrep-mask|run=7|round=3|buffer=2"
    labels = {mask_label(r, t, b) for r in range(3) for t in range(3) for b in range(3)}
    assert len(labels) == 27


def test_expand_mask_shape_determinism_and_prefix() -> None:
    key = bytes(range(32))
    mask = expand_mask(key, b"label", 1000)
    assert mask.dtype == np.uint32 and mask.shape == (1000,)
    np.testing.assert_array_equal(mask, expand_mask(key, b"label", 1000))
    np.testing.assert_array_equal(mask[:10], expand_mask(key, b"label", 10))  # one key stream, read further
    assert expand_mask(key, b"label", 0).shape == (0,)
    with pytest.raises(ValueError):
        expand_mask(key[:16], b"label", 10)


def test_mask_depends_on_every_key_bit() -> None:
    """Flip each of the 256 key bits: the mask changes every time, and about half of its 2048 bits flip.

    For a PRF each mask bit differs with probability 1/2: the fraction over 2048 bits has sd 0.011, so [0.4, 0.6]
    is a 9-sd band, and the average over the 256 flips (sd 0.0007) must be within 0.01 of 0.5.
    """
    rng = np.random.default_rng(1)
    key = rng.bytes(32)
    label = mask_label(0, 1, 0)
    base = expand_mask(key, label, 64)
    fractions = []
    for bit in range(256):
        flipped = bytearray(key)
        flipped[bit // 8] ^= 1 << (bit % 8)
        other = expand_mask(bytes(flipped), label, 64)
        differing = int(np.unpackbits((base ^ other).view(np.uint8)).sum())
        assert differing > 0, f"key bit {bit} does not affect the mask"
        fractions.append(differing / (64 * 32))
    assert min(fractions) > 0.4 and max(fractions) < 0.6
    assert abs(np.mean(fractions) - 0.5) < 0.01


def test_flower_pseudo_rand_gen_folds_keys_but_ours_does_not() -> None:
    """Two keys with the same XOR-fold get the same Flower mask (2^32 candidate seeds); ours tell them apart."""
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    rng = np.random.default_rng(2)
    key1 = rng.bytes(32)
    r = int(rng.integers(1, 2**32))
    words = [int.from_bytes(key1[i : i + 4], "little") for i in range(0, 32, 4)]
    words[0] ^= r
    words[5] ^= r  # the XOR of all eight words, Flower's 32-bit seed, is unchanged
    key2 = b"".join(w.to_bytes(4, "little") for w in words)
    assert key1 != key2
    flower1 = pseudo_rand_gen(key1, 2**32, [(256,)])[0]
    flower2 = pseudo_rand_gen(key2, 2**32, [(256,)])[0]
    np.testing.assert_array_equal(flower1, flower2)  # the weakness
    ours1, ours2 = expand_mask(key1, b"x", 256), expand_mask(key2, b"x", 256)
    assert np.count_nonzero(ours1 != ours2) > 250  # 256 independent words, each equal with probability 2^-32


def test_masks_differ_across_runs_rounds_and_buffers() -> None:
    key = bytes(range(32))
    labels = [mask_label(0, 1, 0), mask_label(0, 2, 0), mask_label(0, 1, 1), mask_label(1, 1, 0)]
    masks = [expand_mask(key, label, 128) for label in labels]
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            assert np.count_nonzero(masks[i] != masks[j]) > 120
    # The same client vector and rounding draws give different uploads in different rounds and buffers.
    (sk_a, _), (_, pk_b) = _keypair(11), _keypair(12)
    x = np.linspace(-1, 1, 128)
    uploads = [masked_upload(x, 0, sk_a, {1: pk_b}, label, np.random.default_rng(0)) for label in labels]
    for i in range(len(uploads)):
        for j in range(i + 1, len(uploads)):
            assert np.count_nonzero(uploads[i] != uploads[j]) > 120


# --- encoding ----------------------------------------------------------------------------------------------------


def test_quantize_range_and_endpoints() -> None:
    q = quantize(np.array([-C, C, -100.0, 100.0, np.inf, -np.inf, 0.0]), np.random.default_rng(0))
    assert q.dtype == np.uint32
    assert q.tolist()[:6] == [0, Q - 1, 0, Q - 1, Q - 1, 0]
    assert q[6] in ((Q - 1) // 2, (Q - 1) // 2 + 1)  # 0 sits half-way between two levels (Q - 1 is odd)
    with pytest.raises(ValueError):
        quantize(np.array([0.0, np.nan]), np.random.default_rng(0))


def test_quantization_is_unbiased() -> None:
    """Points at fraction f of a step above a level: the mean rounded level is level + f.

    One rounding is Bernoulli(f), sd sqrt(f(1 - f)) <= 0.5 levels, so the mean of n = 2^18 has sd <= 0.001 levels;
    the 0.006 tolerance is 6 sd (two-sided false alarm < 2e-9). Rounding to nearest would be off by min(f, 1 - f)
    >= 0.1 levels, 100 sd: the test has power.
    """
    n = 2**18
    for level, frac in [(0, 0.1), (12345, 0.3), (Q // 2, 0.5), (3_000_000, 0.7), (Q - 2, 0.9)]:
        x = np.full(n, -C + (level + frac) * STEP)
        q = quantize(x, np.random.default_rng(level)).astype(np.float64)
        assert set(np.unique(q)) <= {level, level + 1}
        assert abs(q.mean() - (level + frac)) < 0.006
        assert abs(np.mean(dequantize(q)) - x[0]) < 0.006 * STEP


def test_dequantize_inverts_quantize_within_one_step() -> None:
    x = np.random.default_rng(3).uniform(-C, C, 10_000)
    err = np.abs(dequantize(quantize(x, np.random.default_rng(4))) - x)
    assert err.max() < STEP


# --- masking: exact cancellation, decoding accuracy --------------------------------------------------------------


@pytest.mark.parametrize("s", [2, 3, 4])
def test_pairwise_masks_cancel_exactly(s: int) -> None:
    """Sum of masked uploads == sum of unmasked quantized vectors mod 2^32, in exact integer arithmetic."""
    ids = [42, 3, 17, 5][:s]  # arbitrary, unsorted partition ids: signs follow id order, not list order
    keys = {i: _keypair(100 + i) for i in ids}
    rng = np.random.default_rng(s)
    xs = {i: rng.uniform(-C, C, 2000) for i in ids}
    uploads = _uploads(xs, [ids], keys)
    # The same rounding draws without masks (masked_upload consumes its rng exactly like quantize).
    plain = {i: quantize(xs[i], np.random.default_rng(1000 + i)) for i in ids}
    # dtype=object sums Python ints: no overflow or wraparound anywhere but the explicit % 2^32.
    masked_sum = np.stack([uploads[i] for i in ids]).astype(object).sum(axis=0) % MODULUS
    plain_sum = np.stack([plain[i] for i in ids]).astype(object).sum(axis=0) % MODULUS
    assert np.array_equal(masked_sum, plain_sum)
    for i in ids:
        assert np.count_nonzero(uploads[i] != plain[i]) > 1990  # every member's upload is actually masked


@pytest.mark.parametrize("s", [2, 3, 4])
def test_decoded_buffer_mean_matches_plain_mean(s: int) -> None:
    """Spec 12.10: decoded sum within s * 2c/(Q - 1) of the plain sum per coordinate, i.e. the mean within one step."""
    ids = list(range(s))
    keys = {i: _keypair(200 + i) for i in ids}
    rng = np.random.default_rng(10 + s)
    xs = {i: rng.uniform(-C, C, 5000) for i in ids}
    uploads = _uploads(xs, [ids], keys)
    mean = decode_buffer_mean([uploads[i] for i in ids])
    plain_mean = np.mean([xs[i] for i in ids], axis=0)
    assert mean.dtype == np.float64
    assert np.abs(mean * s - plain_mean * s).max() <= s * STEP
    assert np.abs(mean - plain_mean).max() <= STEP


def test_decoded_mean_is_the_mean_of_clipped_values() -> None:
    keys = {0: _keypair(300), 1: _keypair(301)}
    xs = {0: np.array([100.0, -100.0, 1.0]), 1: np.array([0.0, 0.0, 1.0])}
    uploads = _uploads(xs, [[0, 1]], keys)
    np.testing.assert_allclose(decode_buffer_mean([uploads[0], uploads[1]]), [C / 2, -C / 2, 1.0], atol=STEP)


def test_capacity_s_times_levels_below_modulus() -> None:
    (sk, _), (_, pk) = _keypair(1), _keypair(2)
    with pytest.raises(ValueError):
        masked_upload(np.zeros(3), 0, sk, {1: pk}, b"l", np.random.default_rng(0), levels=2**31)  # 2 * 2^31 = M
    masked_upload(np.zeros(3), 0, sk, {1: pk}, b"l", np.random.default_rng(0), levels=2**31 - 1)
    up = np.zeros(3, dtype=np.uint32)
    with pytest.raises(ValueError):
        decode_buffer_mean([up, up], levels=2**31)
    with pytest.raises(ValueError):
        decode_buffers({0: up, 1: up}, [[0, 1]], length=3, levels=2**31)


# --- what a single upload reveals --------------------------------------------------------------------------------


def test_single_upload_looks_uniform_and_reveals_nothing() -> None:
    """One masked upload (n = 2^16) against uniform mod 2^32, and against x.

    * top byte: chi-square with 255 df below 377.1 (its 1 - 1e-6 quantile) and above 161.7 (1e-6 quantile);
    * high bit and low bit: fraction of ones within 0.5 +- 5 sd (sd = 0.5/256 ~ 0.002);
    * Pearson correlation with x: |r| < 5/sqrt(n) ~ 0.02 (5 sd under independence);
    * reading the upload as a quantized vector (even reduced mod Q, the kindest reading) misses x by several units,
      against a quantization error below 3.8e-6.
    """
    n = 2**16
    keys = {0: _keypair(400), 1: _keypair(401), 2: _keypair(402)}
    rng = np.random.default_rng(5)
    xs = {i: rng.uniform(-C, C, n) for i in keys}
    upload = _uploads(xs, [[0, 1, 2]], keys)[1]
    counts = np.bincount(upload >> 24, minlength=256)
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert 161.7 < chi2 < 377.1
    for bit in (31, 0):
        assert abs(((upload >> bit) & 1).mean() - 0.5) < 5 * 0.5 / np.sqrt(n)
    r = np.corrcoef(xs[1], upload.astype(np.float64))[0, 1]
    assert abs(r) < 5 / np.sqrt(n)
    guess = dequantize(upload % Q)
    assert np.median(np.abs(guess - xs[1])) > 2.0  # uniform guess vs uniform x on [-8, 8]: median |diff| ~ 4.7


# --- dropouts and malformed uploads ------------------------------------------------------------------------------


def test_dropout_discards_only_that_buffer() -> None:
    m, s, n = 8, 2, 300
    buffers = buffer_partition(m, s, np.random.default_rng(6))
    keys = {i: _keypair(500 + i) for i in range(m)}
    rng = np.random.default_rng(7)
    xs = {i: rng.uniform(-C, C, n) for i in range(m)}
    uploads = _uploads(xs, buffers, keys)
    dropped = buffers[2][1]
    del uploads[dropped]
    means, discarded = decode_buffers(uploads, buffers, length=n)
    assert discarded == [2]
    assert sorted(means) == [0, 1, 3]
    for b, mean in means.items():
        np.testing.assert_allclose(mean, np.mean([xs[i] for i in buffers[b]], axis=0), rtol=0, atol=STEP)


def test_malformed_uploads_discard_their_buffer_without_crashing() -> None:
    m, s, n = 14, 2, 50
    buffers = [[2 * b, 2 * b + 1] for b in range(m // s)]
    keys = {i: _keypair(600 + i) for i in range(m)}
    rng = np.random.default_rng(8)
    xs = {i: rng.uniform(-C, C, n) for i in range(m)}
    uploads: dict[int, object] = dict(_uploads(xs, buffers, keys))
    good = uploads[1]
    assert isinstance(good, np.ndarray)
    uploads[1] = good[:-1]  # wrong length
    uploads[3] = good.astype(np.int64)  # wrong dtype
    uploads[5] = good.astype(np.float32)
    uploads[7] = good.reshape(5, 10)  # wrong shape
    uploads[9] = good.tolist()  # not an array
    uploads[11] = None
    uploads[99] = good  # a client in no buffer (e.g. a leftover that uploaded anyway): ignored
    for length in (n, None):  # without `length`, buffer-mates must agree on it
        means, discarded = decode_buffers(uploads, buffers, length=length)
        assert discarded == [0, 1, 2, 3, 4, 5]
        assert list(means) == [6]
        np.testing.assert_allclose(means[6], (xs[12] + xs[13]) / 2, rtol=0, atol=STEP)
    # Both members agreeing on a length other than the expected one: discarded only when `length` is given.
    short = {12: np.zeros(n - 1, dtype=np.uint32), 13: np.zeros(n - 1, dtype=np.uint32)}
    assert decode_buffers(short, [[12, 13]], length=n) == ({}, [0])
    assert list(decode_buffers(short, [[12, 13]])[0]) == [0]


def test_buffer_of_one_is_never_masked_or_decoded() -> None:
    sk, _ = _keypair(700)
    with pytest.raises(ValueError, match="plain"):
        masked_upload(np.zeros(4), 0, sk, {}, b"l", np.random.default_rng(0))
    with pytest.raises(ValueError):
        masked_upload(np.zeros(4), 0, sk, {0: _keypair(701)[1]}, b"l", np.random.default_rng(0))  # self as peer
    up = np.zeros(4, dtype=np.uint32)
    with pytest.raises(ValueError):
        decode_buffer_mean([up])
    with pytest.raises(ValueError):
        decode_buffers({0: up, 1: up}, [[0], [1]], length=4)
    with pytest.raises(ValueError):
        decode_buffers({}, [[0], [1]], length=4)  # a configuration error, whatever arrived
    with pytest.raises(ValueError):
        decode_buffers({0: up, 1: up, 2: up}, [[0, 1], [1, 2]], length=4)  # a client in two buffers


# --- buffers -----------------------------------------------------------------------------------------------------


def test_buffer_partition_is_a_partition_into_groups_of_s() -> None:
    for m, s in [(32, 2), (32, 4), (12, 3), (5, 1), (0, 2)]:
        buffers = buffer_partition(m, s, np.random.default_rng(m + s))
        assert len(buffers) == m // s
        assert all(len(b) == s for b in buffers)
        assert sorted(c for b in buffers for c in b) == list(range(m))


def test_buffer_partition_is_fresh_per_seed_and_call() -> None:
    a = buffer_partition(32, 2, np.random.default_rng(0))
    assert a == buffer_partition(32, 2, np.random.default_rng(0))
    assert a != buffer_partition(32, 2, np.random.default_rng(1))
    rng = np.random.default_rng(0)
    assert buffer_partition(32, 2, rng) != buffer_partition(32, 2, rng)  # a new permutation every round


def test_buffer_partition_is_uniform() -> None:
    """Client 0's buffer over 4000 draws (m = 16, s = 4): chi-square with 3 df below 27.9 (1 - 1e-5 quantile)."""
    rng = np.random.default_rng(9)
    counts = np.zeros(4)
    for _ in range(4000):
        counts[next(b for b, members in enumerate(buffer_partition(16, 4, rng)) if 0 in members)] += 1
    assert float(((counts - 1000) ** 2 / 1000).sum()) < 27.9


def test_buffer_partition_rejects_bad_sizes() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        buffer_partition(10, 4, rng)
    with pytest.raises(ValueError):
        buffer_partition(10, 0, rng)
    with pytest.raises(ValueError):
        buffer_partition([1, 2, 2, 3], 2, rng)


def test_buffer_partition_of_present_clients_reports_leftover() -> None:
    present = [0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 12]  # 3 and 8 missed phase 1
    buffers, leftover = buffer_partition(present, 3, np.random.default_rng(0))
    assert len(buffers) == 3 and all(len(b) == 3 for b in buffers)
    assert len(leftover) == 2
    assert sorted([c for b in buffers for c in b] + leftover) == present
    # Depends on the set of members, not on their order.
    assert (buffers, leftover) == buffer_partition(present[::-1], 3, np.random.default_rng(0))
    full, none_left = buffer_partition(present[:9], 3, np.random.default_rng(0))
    assert none_left == [] and len(full) == 3


def test_round_with_missing_and_dropped_clients() -> None:
    """A whole round: 2 clients miss phase 1, 2 present clients are left over, one buffer member drops."""
    present = [c for c in range(13) if c not in (3, 8)]
    keys = {c: new_keypair() for c in present}  # phase 1: fresh keys from the real API
    buffers, leftover = buffer_partition(present, 3, np.random.default_rng(11))
    rng = np.random.default_rng(12)
    xs = {c: rng.uniform(-2, 2, 40) for c in present}
    uploads = _uploads(xs, buffers, keys, run_seed=5, server_round=9)
    assert not set(uploads) & set(leftover)
    del uploads[buffers[0][2]]
    means, discarded = decode_buffers(uploads, buffers, length=40)
    assert discarded == [0]
    for b in (1, 2):
        np.testing.assert_allclose(means[b], np.mean([xs[c] for c in buffers[b]], axis=0), rtol=0, atol=STEP)
