"""The distributed Skellam mechanism (Agarwal, Kairouz & Liu, "The Skellam mechanism for differentially private
federated learning", NeurIPS 2021): its RDP bound, (epsilon, delta), calibration, the fixed-point encoding on the
secure aggregation's ring. Its accountant behind Flower's ``PrivacyAccountant`` protocol is
:class:`fedpdm_flower.fedapp.privacy.protocol.SkellamAccountant`.

**The noise.** ``Sk(lam) = Poisson(lam) - Poisson(lam)`` per coordinate: integer, symmetric, variance ``2 lam``, and
closed under sums (``Sk(a) + Sk(b) = Sk(a + b)``). Here a mechanism is named by the *variance* V of its total noise
(``V = 2 lam``), the parametrisation of the paper's theorem.

**The RDP bound** (the paper's Sec. 3, the multidimensional Skellam mechanism, Thm. 3.5 / Cor. 3.6; the same
expression as google-research ``distributed_dp/accounting_utils._skellam_rdp`` with scale 1): an integer-valued
query with L1 sensitivity D1 and L2 sensitivity D2, plus independent Skellam noise of variance V per coordinate, is
(alpha, eps(alpha))-RDP for every integer alpha > 1 with

    eps(alpha) <= alpha D2^2 / (2 V) + min( ((2 alpha - 1) D2^2 + 6 D1) / (4 V^2),  3 D1 / (2 V) ).

The first term is the Gaussian mechanism's RDP at sigma^2 = V; the min{...} is the price of being discrete, which
vanishes as V grows. ``tests/test_distributed_dp.py`` checks the bound against the exact Renyi divergence of two
shifted 1-D Skellam laws (summed from scipy's PMF).

**(epsilon, delta)**: RDP composes by adding over rounds; the conversion is Canonne, Kamath & Steinke 2020
(Prop. 12) / Balle et al. 2020 (Thm. 21), dp-accounting's: ``eps = min_alpha rdp(alpha) + log((alpha - 1)/alpha)
- (log delta + log alpha) / (alpha - 1)``.

**Encoding and sensitivity.** A device clips its update x to L2 norm C, scales it by gamma and rounds each
coordinate to an integer at random (up with probability equal to the fractional part), *conditionally*: the
rounding is redrawn until ``||round(gamma x)||_2 <= D2`` with (Kairouz, Liu & Steinke 2021, "The distributed
discrete Gaussian mechanism", Thm. 1 / Sec. 4.1)

    D2^2 = min( (gamma C + sqrt(d))^2,  (gamma C)^2 + d / 4 + sqrt(2 ln(1 / beta)) (gamma C + sqrt(d) / 2) ),

which a first draw meets with probability >= 1 - beta; the first bound holds for every draw (each coordinate
moves by less than 1). So the sensitivity is enforced, not hoped for: D2 in integer units, and D1 = D2 min(sqrt(d),
D2) (an integer vector has ``||v||_1 <= ||v||_2^2`` and ``||v||_1 <= sqrt(d) ||v||_2``). The rounding's cost is
the ratio D2 / (gamma C), which tends to 1 as gamma C grows past sqrt(d).

**The ring.** The secure sum is taken mod 2^32 and read back signed, in [-2^31, 2^31). A buffer of n devices sums
at most ``n (gamma C + 1)`` in absolute value per coordinate, plus noise whose tail is bounded by Bernstein's
inequality for sums of independent centred variables bounded by 1 (a Poisson is a limit of Bernoullis):
``P(|Sk| >= a) <= 2 exp(-a^2 / (2 (V + a / 3)))``; with a union bound over the d coordinates, :func:`headroom`
says whether a wrap has probability below ``wrap_probability`` (default 2^-40), and :func:`largest_scale` finds the
largest gamma that keeps it so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "ORDERS",
    "RING_BITS",
    "conditional_round",
    "decode_signed",
    "epsilon_of_rdp",
    "headroom",
    "l1_bound",
    "largest_scale",
    "noise_multiplier_for",
    "rounded_l2_bound",
    "sensitivities",
    "skellam_epsilon",
    "skellam_noise",
    "skellam_rdp",
]

#: integer Renyi orders (the theorem is stated for integer alpha > 1)
ORDERS: tuple[int, ...] = (*range(2, 129), 160, 192, 256, 320, 384, 512, 768, 1024)
#: the secure aggregation's modulus is 2^RING_BITS (fedpdm_flower.fedapp.secagg.MODULUS)
RING_BITS = 32
#: the default conditional-rounding parameter beta (Kairouz, Liu & Steinke's experiments use e^-0.5)
DEFAULT_BETA = math.exp(-0.5)
#: the largest Poisson mean drawn in one piece (numpy's sampler is accurate to 0.3 % in variance at 1e13)
MAX_LAM = 1e12
#: the largest gamma C :func:`largest_scale` picks: past 2^20 the rounding's inflation sqrt(d) / (gamma C) is
#: already below 1 % for d <= 10^8, and a larger scale only makes the noise's Poisson means huge
MAX_SCALED_NORM = 2.0**20
#: the default probability, per round and buffer, that a coordinate of the noisy sum leaves the ring
DEFAULT_WRAP = 2.0**-40


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _orders(orders: Sequence[int] | None) -> NDArray[np.float64]:
    a = np.asarray(ORDERS if orders is None else orders, dtype=np.float64)
    if a.ndim != 1 or a.size == 0 or np.any(a < 2) or np.any(a != np.floor(a)):
        raise ValueError("orders must be integers >= 2 (the Skellam bound is stated for integer alpha > 1)")
    return a


# ------------------------------------------------------------------------------------------------ the bound
def skellam_rdp(variance: float, l1: float, l2: float, orders: Sequence[int] | None = None) -> NDArray[np.float64]:
    """eps(alpha) of one release (module docstring's bound) at every order, for total noise of ``variance`` per
    coordinate and integer-unit sensitivities ``l1``, ``l2``."""
    v, d1, d2 = _positive("variance", variance), _positive("l1", l1), _positive("l2", l2)
    a = _orders(orders)
    return a * d2**2 / (2 * v) + np.minimum(((2 * a - 1) * d2**2 + 6 * d1) / (4 * v**2), 3 * d1 / (2 * v))


def epsilon_of_rdp(rdp: NDArray[np.float64], delta: float, orders: Sequence[int] | None = None) -> float:
    """The smallest epsilon at ``delta`` from an RDP curve (Canonne, Kamath & Steinke 2020, Prop. 12)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    a = _orders(orders)
    eps = rdp + np.log((a - 1) / a) - (math.log(delta) + np.log(a)) / (a - 1)
    return float(max(0.0, np.min(eps)))


def skellam_epsilon(variance: float, l1: float, l2: float, releases: int, delta: float) -> float:
    """epsilon at ``delta`` of ``releases`` identical Skellam releases (RDP adds over releases)."""
    if isinstance(releases, bool) or not isinstance(releases, int) or releases < 1:
        raise ValueError(f"releases must be an integer >= 1, got {releases!r}")
    return epsilon_of_rdp(releases * skellam_rdp(variance, l1, l2), delta)


def noise_multiplier_for(epsilon: float, delta: float, releases: int, l1: float, l2: float) -> float:
    """The smallest z (to 1e-6 relative) with which ``releases`` Skellam releases of variance ``(z l2)^2`` are
    (epsilon, delta)-DP under the bound above (bisection: eps falls as the variance grows)."""
    _positive("epsilon", epsilon)
    lo, hi = 1e-3, 1.0
    while skellam_epsilon((hi * l2) ** 2, l1, l2, releases, delta) > epsilon:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"epsilon = {epsilon:g} at delta = {delta:g} over {releases} releases needs z > 1e6")
    if skellam_epsilon((lo * l2) ** 2, l1, l2, releases, delta) <= epsilon:
        raise ValueError(f"epsilon = {epsilon:g} is met with z < {lo}: a target this loose is no privacy")
    while hi / lo > 1 + 1e-6:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if skellam_epsilon((mid * l2) ** 2, l1, l2, releases, delta) <= epsilon else (mid, hi)
    return hi


# ------------------------------------------------------------------------------------------------ encoding
def rounded_l2_bound(scaled_norm: float, dim: int, beta: float = DEFAULT_BETA) -> float:
    """D2 after conditional randomized rounding of a vector of L2 norm <= ``scaled_norm`` (gamma C) in ``dim``
    coordinates (module docstring; beta = 0: the unconditional bound gamma C + sqrt(d))."""
    c = _positive("scaled_norm", scaled_norm)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must lie in [0, 1), got {beta!r}")
    first = c + math.sqrt(dim)
    if beta == 0.0:
        return first
    second = math.sqrt(c**2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(dim) / 2))
    return min(first, second)


def l1_bound(l2: float, dim: int) -> float:
    """D1 of an integer vector with L2 norm <= ``l2``: ``l2 min(sqrt(d), l2)``."""
    return l2 * min(math.sqrt(dim), l2)


def sensitivities(clip: float, scale: float, dim: int, beta: float = DEFAULT_BETA, *,
                  replace_one: bool = False) -> tuple[float, float]:
    """(D1, D2) in integer units of one client's encoded update (zero-out / add-or-remove: the update itself);
    ``replace_one`` doubles both (x - x')."""
    d2 = rounded_l2_bound(_positive("clip", clip) * _positive("scale", scale), dim, beta)
    d1 = l1_bound(d2, dim)
    return (2 * d1, 2 * d2) if replace_one else (d1, d2)


def conditional_round(x: NDArray[np.float64], bound: float, rng: np.random.Generator,
                      max_tries: int = 1000) -> NDArray[np.int64]:
    """Randomized rounding of ``x`` (already scaled) redrawn until its L2 norm is <= ``bound``: the encoded
    vector's sensitivity is then ``bound`` whatever the draw. Raises ValueError if ``max_tries`` draws fail (the
    bound is below what rounding can meet)."""
    floor = np.floor(x)
    frac = x - floor
    for _ in range(max_tries):
        r = (floor + (rng.random(x.shape) < frac)).astype(np.int64)
        if float(np.linalg.norm(r.astype(np.float64))) <= bound:
            return r
    raise ValueError(f"conditional rounding failed {max_tries} times to meet the L2 bound {bound:g}")


def skellam_noise(lam: float, size: int, rng: np.random.Generator) -> NDArray[np.int64]:
    """``size`` draws of Sk(lam) = Poisson(lam) - Poisson(lam) (variance 2 lam).

    numpy's Poisson sampler loses accuracy past lam ~ 1e14 (its variance measured 4 % off at 1e15, 13 % at 3e15),
    so a larger lam is drawn as the sum of k draws of Sk(lam / k), each at most :data:`MAX_LAM`: exact by the
    closure under sums. lam above ``1000 MAX_LAM`` is refused (a scale that large is never needed)."""
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be a finite number >= 0, got {lam!r}")
    pieces = max(1, math.ceil(lam / MAX_LAM))
    if pieces > 1000:
        raise ValueError(f"lam = {lam:.3g} exceeds 1000 x {MAX_LAM:g}: lower the scale")
    out = np.zeros(size, dtype=np.int64)
    for _ in range(pieces):
        out += rng.poisson(lam / pieces, size).astype(np.int64) - rng.poisson(lam / pieces, size).astype(np.int64)
    return out


def decode_signed(total: NDArray[np.uint32]) -> NDArray[np.int64]:
    """A sum mod 2^32 read back as a signed integer in [-2^31, 2^31)."""
    v = np.asarray(total, dtype=np.uint32).astype(np.int64)
    v[v >= 2**31] -= 2**32
    return v


def _tail(variance: float, dim: int, wrap_probability: float) -> float:
    """The a with ``2 d exp(-a^2 / (2 (V + a / 3))) <= wrap_probability`` (Bernstein, union bound over d)."""
    log_term = math.log(2 * dim / wrap_probability)
    # a^2 = 2 L (V + a / 3): the positive root of a^2 - (2 L / 3) a - 2 L V = 0
    return (2 * log_term / 3 + math.sqrt((2 * log_term / 3) ** 2 + 8 * log_term * variance)) / 2


def headroom(scale: float, clip: float, members: int, noise_variance: float, dim: int,
             wrap_probability: float = DEFAULT_WRAP) -> float:
    """The ring's room left per coordinate (>= 0: a wrap has probability below ``wrap_probability``): ``2^31 - 1``
    minus the largest signal ``members (gamma C + 1)`` minus the noise tail of the buffer's total variance."""
    signal = members * (scale * clip + 1)
    return float(2 ** (RING_BITS - 1) - 1 - signal - _tail(noise_variance, dim, wrap_probability))


def largest_scale(clip: float, members: int, dim: int, z: float, share_count: int, *, beta: float = DEFAULT_BETA,
                  wrap_probability: float = DEFAULT_WRAP) -> float:
    """The largest gamma (to 0.1 %, at most ``MAX_SCALED_NORM / C``) whose buffer of ``members`` devices, each adding
    a share of variance ``(z D2)^2 / share_count``, keeps :func:`headroom` >= 0."""
    def room(gamma: float) -> float:
        d2 = rounded_l2_bound(clip * gamma, dim, beta)
        return headroom(gamma, clip, members, members * (z * d2) ** 2 / share_count, dim, wrap_probability)

    lo, hi = 1e-6 / clip, MAX_SCALED_NORM / clip
    if room(hi) >= 0:
        return hi
    if room(lo) < 0:
        raise ValueError(f"no scale fits the ring: z = {z:g} with {members} members and {share_count} shares")
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if room(mid) >= 0 else (lo, mid)
    return lo
