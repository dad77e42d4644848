"""Tests of the threshold secure aggregation's math (fedpdm_flower/fedapp/secagg.py; FedREP spec 3.1, 4.3, 11.6, 11.19, 12 items
9-10; issue 18): the one protocol SecureBuffers and FedREP share.

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

from fedpdm_flower.fedapp.secagg import (
    DEFAULT_CLIP,
    DEFAULT_LEVELS,
    MODULUS,
    buffer_partition,
    check_buffer,
    check_public_key,
    check_threshold,
    dequantize,
    expand_mask,
    mask_input,
    new_keypair,
    pairwise_key,
    quantize,
    rebuild_sum,
    reveal,
    round_label,
    self_mask,
    split_secret,
    threshold_masked_upload,
    unmask_sum,
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


def _seed(me: int) -> bytes:
    """A fixed self-mask seed per member (the protocol draws it from the OS; fixed here for repeatable tests)."""
    return bytes([me % 256]) * 32


def _uploads(
    xs: Mapping[int, NDArray[np.float64]],
    buffers: Sequence[Sequence[int]],
    keys: Mapping[int, tuple[bytes, bytes]],
    run: str = "run",
    server_round: int = 1,
) -> dict[int, NDArray[np.uint32]]:
    """Every buffer member's masked upload with a fixed self-mask seed (:func:`_seed`), rounding from 1000 + id."""
    out: dict[int, NDArray[np.uint32]] = {}
    for buffer_id, members in enumerate(buffers):
        label = round_label(run, server_round, buffer_id)
        for me in members:
            peers = {j: keys[j][1] for j in members if j != me}
            out[me] = threshold_masked_upload(xs[me], me, keys[me][0], peers, label, _seed(me),
                                              np.random.default_rng(1000 + me))
    return out


def _protocol(
    xs: Mapping[int, NDArray[np.float64]], members: Sequence[int], keys: Mapping[int, tuple[bytes, bytes]],
    threshold: int, dropped: Sequence[int] = (), label: bytes = b"label",
) -> NDArray[np.uint32]:
    """One buffer through the whole protocol: every member masks (mask_input), the dropped never upload, each
    survivor reveals (reveal) what the server's unmask request asks for, the server rebuilds the sum."""
    sealed = {me: mask_input(xs[me], me, keys[me][0], {j: keys[j][1] for j in members if j != me}, threshold, label,
                             np.random.default_rng(1000 + me)) for me in members}
    survivors = [c for c in members if c not in dropped]
    shares: dict[int, list[bytes]] = {c: [] for c in survivors}
    pairs: dict[tuple[int, int], bytes] = {}
    for me in survivors:
        got, seeds = reveal(me, keys[me][0], {j: keys[j][1] for j in members if j != me}, sealed[me].own_share,
                            threshold, survivors, list(dropped),
                            {j: sealed[j].shares[me] for j in survivors if j != me}, label)
        assert set(got) == set(survivors) and set(seeds) == set(dropped)  # per peer a share OR a seed, never both
        for owner, share in got.items():
            shares[owner].append(share)
        pairs.update({(me, j): seed for j, seed in seeds.items()})
    return rebuild_sum({c: sealed[c].masked for c in survivors}, {c: sealed[c].commit for c in survivors}, shares,
                       pairs, label)


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

    from fedpdm_flower.fedapp import secagg

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


def test_round_label_names_run_round_buffer() -> None:
    assert round_label("7", 3, 2) == b"fedapp-secagg|run=7|round=3|buffer=2"
    labels = {round_label(str(r), t, b) for r in range(3) for t in range(3) for b in range(3)}
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
    label = round_label("0", 1, 0)
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
    labels = [round_label("0", 1, 0), round_label("0", 2, 0), round_label("0", 1, 1), round_label("1", 1, 0)]
    masks = [expand_mask(key, label, 128) for label in labels]
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            assert np.count_nonzero(masks[i] != masks[j]) > 120
    # The same client vector and rounding draws give different uploads in different rounds and buffers.
    (sk_a, _), (_, pk_b) = _keypair(11), _keypair(12)
    x = np.linspace(-1, 1, 128)
    uploads = [threshold_masked_upload(x, 0, sk_a, {1: pk_b}, label, _seed(0), np.random.default_rng(0))
               for label in labels]
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
    """Sum of masked uploads minus the self-masks == sum of unmasked quantized vectors mod 2^32, in exact integer
    arithmetic: the pairwise masks cancel."""
    ids = [42, 3, 17, 5][:s]  # arbitrary, unsorted partition ids: signs follow id order, not list order
    keys = {i: _keypair(100 + i) for i in ids}
    rng = np.random.default_rng(s)
    xs = {i: rng.uniform(-C, C, 2000) for i in ids}
    uploads = _uploads(xs, [ids], keys)
    label = round_label("run", 1, 0)
    # The same rounding draws without masks (the upload consumes its rng exactly like quantize).
    plain = {i: quantize(xs[i], np.random.default_rng(1000 + i)) for i in ids}
    # dtype=object sums Python ints: no overflow or wraparound anywhere but the explicit % 2^32.
    masked_sum = np.stack([uploads[i] for i in ids]).astype(object).sum(axis=0)
    self_masks = np.stack([self_mask(_seed(i), label, 2000) for i in ids]).astype(object).sum(axis=0)
    plain_sum = np.stack([plain[i] for i in ids]).astype(object).sum(axis=0) % MODULUS
    assert np.array_equal((masked_sum - self_masks) % MODULUS, plain_sum)
    for i in ids:
        assert np.count_nonzero(uploads[i] != plain[i]) > 1990  # every member's upload is actually masked


@pytest.mark.parametrize(("s", "t"), [(2, 2), (3, 2), (4, 3), (5, 3)])
def test_the_protocol_gives_the_exact_sum_and_the_plain_mean(s: int, t: int) -> None:
    """Spec 12.10 through the whole protocol (mask, reveal, rebuild): the rebuilt sum equals the plain integer sum
    of the quantized vectors exactly, so the decoded mean is within one step of the plain float mean."""
    ids = list(range(s))
    keys = {i: _keypair(200 + i) for i in ids}
    rng = np.random.default_rng(10 + s)
    xs = {i: rng.uniform(-C, C, 5000) for i in ids}
    total = _protocol(xs, ids, keys, t)
    plain = np.stack([quantize(xs[i], np.random.default_rng(1000 + i)) for i in ids]).astype(object).sum(axis=0)
    assert np.array_equal(total.astype(object), plain % MODULUS)
    mean = dequantize(total, s)
    assert mean.dtype == np.float64
    assert np.abs(mean - np.mean([xs[i] for i in ids], axis=0)).max() <= STEP


def test_decoded_mean_is_the_mean_of_clipped_values() -> None:
    keys = {0: _keypair(300), 1: _keypair(301)}
    xs = {0: np.array([100.0, -100.0, 1.0]), 1: np.array([0.0, 0.0, 1.0])}
    np.testing.assert_allclose(dequantize(_protocol(xs, [0, 1], keys, 2), 2), [C / 2, -C / 2, 1.0], atol=STEP)


def test_capacity_s_times_levels_below_modulus() -> None:
    (sk, _), (_, pk) = _keypair(1), _keypair(2)
    with pytest.raises(ValueError):  # 2 * 2^31 = M: a sum of two could wrap
        threshold_masked_upload(np.zeros(3), 0, sk, {1: pk}, b"l", _seed(0), np.random.default_rng(0), levels=2**31)
    threshold_masked_upload(np.zeros(3), 0, sk, {1: pk}, b"l", _seed(0), np.random.default_rng(0), levels=2**31 - 1)


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
    upload = mask_input(xs[1], 1, keys[1][0], {0: keys[0][1], 2: keys[2][1]}, 2, b"label",
                        np.random.default_rng(6)).masked
    counts = np.bincount(upload >> 24, minlength=256)
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert 161.7 < chi2 < 377.1
    for bit in (31, 0):
        assert abs(((upload >> bit) & 1).mean() - 0.5) < 5 * 0.5 / np.sqrt(n)
    r = np.corrcoef(xs[1], upload.astype(np.float64))[0, 1]
    assert abs(r) < 5 / np.sqrt(n)
    guess = dequantize(upload % Q)
    assert np.median(np.abs(guess - xs[1])) > 2.0  # uniform guess vs uniform x on [-8, 8]: median |diff| ~ 4.7


# --- dropouts, thresholds, what a member refuses to reveal -------------------------------------------------------


def test_a_buffer_of_5_with_t_3_and_two_dropouts_gives_the_survivors_exact_sum() -> None:
    """Issue 18's case in the math: members 0..4, t = 3, members 1 and 3 never upload. The survivors reveal their
    pairwise seeds with 1 and 3 and each other's self-mask shares; the rebuilt sum is exactly the plain integer sum
    of the three survivors' quantized vectors."""
    ids = [0, 1, 2, 3, 4]
    keys = {i: _keypair(500 + i) for i in ids}
    rng = np.random.default_rng(7)
    xs = {i: rng.uniform(-C, C, 300) for i in ids}
    total = _protocol(xs, ids, keys, 3, dropped=[1, 3])
    plain = np.stack([quantize(xs[i], np.random.default_rng(1000 + i)) for i in (0, 2, 4)]).astype(object).sum(axis=0)
    assert np.array_equal(total.astype(object), plain % MODULUS)
    np.testing.assert_allclose(dequantize(total, 3), np.mean([xs[i] for i in (0, 2, 4)], axis=0), rtol=0, atol=STEP)


def test_below_the_threshold_nothing_is_revealed() -> None:
    """Two survivors of 5 with t = 3: each survivor refuses, so no self-mask can be rebuilt (the buffer is lost,
    and no single upload is ever unmasked)."""
    ids = [0, 1, 2, 3, 4]
    keys = {i: _keypair(550 + i) for i in ids}
    with pytest.raises(ValueError, match="below the threshold 3"):
        _protocol({i: np.zeros(8) for i in ids}, ids, keys, 3, dropped=[1, 2, 3])


def test_a_member_reveals_a_share_or_a_seed_per_peer_never_both() -> None:
    ids = [0, 1, 2]
    keys = {i: _keypair(600 + i) for i in ids}
    peers = {j: keys[j][1] for j in (1, 2)}
    sealed = {i: mask_input(np.zeros(4), i, keys[i][0], {j: keys[j][1] for j in ids if j != i}, 2, b"l",
                            np.random.default_rng(i)) for i in ids}
    mine = {j: sealed[j].shares[0] for j in (1, 2)}
    for survivors, dropped, why in [([0, 1, 2], [1], "must split"), ([0, 1], [1, 2], "must split"),
                                    ([1, 2], [0], "told it dropped"), ([0, 1], [], "must split")]:
        with pytest.raises(ValueError, match=why):
            reveal(0, keys[0][0], peers, sealed[0].own_share, 2, survivors, dropped, mine, b"l")
    got, seeds = reveal(0, keys[0][0], peers, sealed[0].own_share, 2, [0, 1], [2], mine, b"l")
    assert sorted(got) == [0, 1] and sorted(seeds) == [2]  # 2 dropped: its seed with 0, not its share
    with pytest.raises(ValueError, match="failed authentication"):  # a share sealed for another pair or label
        reveal(0, keys[0][0], peers, sealed[0].own_share, 2, [0, 1, 2], [], {1: sealed[1].shares[2], 2: mine[2]},
               b"l")


def test_a_forged_share_is_caught_by_the_commitment() -> None:
    """A wrong self-mask share makes Lagrange interpolation give a wrong seed: the commitment catches it instead of
    returning a wrong sum."""
    ids = [0, 1, 2]
    keys = {i: _keypair(650 + i) for i in ids}
    sealed = {i: mask_input(np.ones(4), i, keys[i][0], {j: keys[j][1] for j in ids if j != i}, 2, b"l",
                            np.random.default_rng(i)) for i in ids}
    fake = split_secret(bytes(32), 2, 3)
    shares = {0: [sealed[0].own_share, fake[1]], 1: [sealed[1].own_share, fake[0]], 2: [sealed[2].own_share, fake[0]]}
    with pytest.raises(ValueError, match="does not match its commitment"):
        rebuild_sum({i: sealed[i].masked for i in ids}, {i: sealed[i].commit for i in ids}, shares, {}, b"l")


def test_thresholds_and_buffers_a_device_refuses() -> None:
    for size, t in [(2, 1), (3, 1), (4, 2), (5, 2), (3, 4)]:
        with pytest.raises(ValueError, match="2t > s"):
            check_threshold(size, t)
    check_threshold(2, 2)
    check_threshold(5, 3)
    with pytest.raises(ValueError, match="below this device's minimum of 3"):
        check_buffer(0, [0, 1], 2, min_buffer=3)
    with pytest.raises(ValueError, match="not among the buffer's members"):
        check_buffer(0, [1, 2, 3], 2, min_buffer=3)
    with pytest.raises(ValueError, match="repeat a client id"):
        check_buffer(0, [0, 1, 1], 2, min_buffer=2)
    check_buffer(0, [0, 1], 2, min_buffer=2)


def test_buffer_of_one_is_never_masked_or_unmasked() -> None:
    sk, _ = _keypair(700)
    with pytest.raises(ValueError, match="at least one buffer-mate"):
        threshold_masked_upload(np.zeros(4), 0, sk, {}, b"l", _seed(0), np.random.default_rng(0))
    with pytest.raises(ValueError, match="among its own buffer-mates"):
        mask_input(np.zeros(4), 0, sk, {0: _keypair(701)[1]}, 2, b"l", np.random.default_rng(0))
    up = np.zeros(4, dtype=np.uint32)
    with pytest.raises(ValueError, match="fewer than 2 survivors"):
        unmask_sum({0: up}, {0: _seed(0)}, {}, b"l")


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
    """A whole round: 2 clients miss phase 1, 2 present clients are left over, one buffer member drops after
    masking; its buffer (s = 3, t = 2) still gives the exact sum of its two survivors, the others of all three."""
    present = [c for c in range(13) if c not in (3, 8)]
    keys = {c: new_keypair() for c in present}  # phase 1: fresh keys from the real API
    buffers, leftover = buffer_partition(present, 3, np.random.default_rng(11))
    rng = np.random.default_rng(12)
    xs = {c: rng.uniform(-2, 2, 40) for c in present}
    for b, members in enumerate(buffers):
        dropped = [members[2]] if b == 0 else []
        survivors = [c for c in members if c not in dropped]
        total = _protocol(xs, members, keys, 2, dropped=dropped, label=round_label("r", 9, b))
        np.testing.assert_allclose(dequantize(total, len(survivors)), np.mean([xs[c] for c in survivors], axis=0),
                                   rtol=0, atol=STEP)
    assert not set(leftover) & {c for b in buffers for c in b}
