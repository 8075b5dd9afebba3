"""Request colours on the block grid never read as a colour the legend reserves (free, prefix-cached
amber, swapped out), for normal vision and for the three dichromacies.

Colour difference is CIEDE2000 (Sharma, Wu and Dalal 2005) over CIELAB from sRGB (IEC 61966-2-1,
D65), written out here from the published formulas and checked against Sharma's test data; colour
blindness is simulated with Machado, Oliveira and Fernandes (2009), severity 1, on linear RGB.
"""

from __future__ import annotations

import math
import re

import pytest

from hf_contbatch.frontends.dashboard import (
    CACHED_COLOUR,
    FREE_COLOUR,
    SWAPPED_COLOUR,
    render_block_grid,
    request_colour,
)

RESERVED = {"free": FREE_COLOUR, "prefix-cached": CACHED_COLOUR, "swapped out": SWAPPED_COLOUR}
MIN_DELTA_E = 15.0  # normal vision; 2.3 is a just-noticeable difference
MIN_DELTA_E_DICHROMAT = 10.0

MACHADO_2009 = {  # linear RGB -> linear RGB, severity 1.0
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216), (-0.003882, -0.048116, 1.051998)),
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413), (-0.011820, 0.042940, 0.968881)),
    "tritanopia": ((1.255528, -0.076749, -0.178779), (-0.078411, 0.930809, 0.147602), (0.004733, 0.691367, 0.303900)),
}


def linear_rgb(colour: str) -> tuple[float, float, float]:
    """``#rrggbb`` -> linear RGB in [0, 1] (the sRGB transfer function inverted)."""
    channels = [int(colour.lstrip("#")[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    return tuple(c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)


def lab(rgb: tuple[float, float, float]) -> tuple[float, float, float]:
    """Linear sRGB -> CIELAB (D65 white)."""
    r, g, b = rgb
    x = (0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047
    y = 0.2126729 * r + 0.7151522 * g + 0.0721750 * b
    z = (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def seen_as(colour: str, vision: str = "normal") -> tuple[float, float, float]:
    """CIELAB of ``colour`` as a reader with ``vision`` sees it."""
    rgb = linear_rgb(colour)
    if vision != "normal":
        m = MACHADO_2009[vision]
        rgb = tuple(min(1.0, max(0.0, sum(m[i][j] * rgb[j] for j in range(3)))) for i in range(3))
    return lab(rgb)


def ciede2000(lab1, lab2) -> float:
    """CIEDE2000 colour difference (kL = kC = kH = 1)."""
    (l1, a1, b1), (l2, a2, b2) = lab1, lab2
    c_mean = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_mean**7 / (c_mean**7 + 25**7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = math.hypot(a1p, b1), math.hypot(a2p, b2)
    h1p = math.degrees(math.atan2(b1, a1p)) % 360 if c1p else 0.0
    h2p = math.degrees(math.atan2(b2, a2p)) % 360 if c2p else 0.0
    if c1p * c2p == 0:
        dh = 0.0
    elif abs(h2p - h1p) <= 180:
        dh = h2p - h1p
    else:
        dh = h2p - h1p - 360 if h2p > h1p else h2p - h1p + 360
    d_big_h = 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dh / 2))
    l_mean, cp_mean = (l1 + l2) / 2, (c1p + c2p) / 2
    if c1p * c2p == 0:
        h_mean = h1p + h2p
    elif abs(h1p - h2p) <= 180:
        h_mean = (h1p + h2p) / 2
    else:
        h_mean = (h1p + h2p + 360) / 2 if h1p + h2p < 360 else (h1p + h2p - 360) / 2
    t = (
        1
        - 0.17 * math.cos(math.radians(h_mean - 30))
        + 0.24 * math.cos(math.radians(2 * h_mean))
        + 0.32 * math.cos(math.radians(3 * h_mean + 6))
        - 0.20 * math.cos(math.radians(4 * h_mean - 63))
    )
    rc = 2 * math.sqrt(cp_mean**7 / (cp_mean**7 + 25**7))
    rt = -math.sin(math.radians(60 * math.exp(-(((h_mean - 275) / 25) ** 2)))) * rc
    sl = 1 + 0.015 * (l_mean - 50) ** 2 / math.sqrt(20 + (l_mean - 50) ** 2)
    sc, sh = 1 + 0.045 * cp_mean, 1 + 0.015 * cp_mean * t
    dl, dc = (l2 - l1) / sl, (c2p - c1p) / sc
    dhh = d_big_h / sh
    return math.sqrt(dl**2 + dc**2 + dhh**2 + rt * dc * dhh)


@pytest.mark.parametrize(
    "lab1,lab2,expected",  # Sharma, Wu and Dalal (2005), Table 1, pairs 1, 7, 17, 18 and 25
    [
        ((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
        ((50.0, 0.0, 0.0), (50.0, -1.0, 2.0), 2.3669),
        ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
        ((50.0, 2.5, 0.0), (61.0, -5.0, 29.0), 22.8977),
        ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644),
    ],
)
def test_the_colour_difference_used_here_reproduces_sharmas_test_data(lab1, lab2, expected):
    assert ciede2000(lab1, lab2) == pytest.approx(expected, abs=1e-4)
    assert ciede2000(lab2, lab1) == pytest.approx(expected, abs=1e-4)


def test_the_srgb_to_lab_conversion_matches_published_values():
    assert seen_as("#ffffff") == pytest.approx((100.0, 0.0, 0.0), abs=1e-3)
    assert seen_as("#ff0000") == pytest.approx((53.2408, 80.0925, 67.2032), abs=1e-3)
    for vision in MACHADO_2009:  # the simulations keep greys grey
        assert seen_as("#808080", vision) == pytest.approx(seen_as("#808080"), abs=1e-3)


def _drawn_request_colours(num_requests: int) -> dict[int, str]:
    """The background of each request's block on a grid with one block per request."""
    html = render_block_grid(tuple(range(num_requests)), max_cells=num_requests)
    cells = re.findall(r'<i style="background:(#[0-9a-fA-F]{6})" title="block \d+ · request (\d+)"', html)
    assert len(cells) == num_requests
    return {int(rid): colour for colour, rid in cells}


@pytest.mark.parametrize("vision", ["normal", *MACHADO_2009])
def test_no_request_colour_is_near_a_reserved_colour(vision):
    drawn = _drawn_request_colours(1000)
    assert all(drawn[rid] == request_colour(rid) for rid in drawn)
    least = MIN_DELTA_E if vision == "normal" else MIN_DELTA_E_DICHROMAT
    for colour in set(drawn.values()) | {request_colour(rid) for rid in range(1000, 100_000, 7)}:
        for name, reserved in RESERVED.items():
            distance = ciede2000(seen_as(colour, vision), seen_as(reserved, vision))
            assert distance >= least, f"{colour} reads as {name} ({reserved}) for {vision} vision: dE00 {distance:.1f}"


def test_consecutive_requests_get_clearly_different_colours():
    for rid in range(1000):
        a, b = request_colour(rid), request_colour(rid + 1)
        assert ciede2000(seen_as(a), seen_as(b)) >= MIN_DELTA_E
        assert min(ciede2000(seen_as(a, v), seen_as(b, v)) for v in MACHADO_2009) >= MIN_DELTA_E_DICHROMAT
