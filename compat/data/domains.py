"""Domains of the synthetic captioned-image stream: vocabulary, object kinds, backgrounds, styles.

Each phase of the stream draws its scenes from one :class:`Domain`. The five base domains share nothing
but the 3x3 position grid, so a later phase brings new words and new image statistics; phases past them
recombine their parts. The *realistic* shift (:func:`realistic_phase`) shares a core vocabulary across
every phase and lets each phase bring one more base domain's items while earlier ones grow rarer.

Object kinds are drawn from primitives in a unit box ``[-1, 1]^2`` (y grows downwards); each
primitive is filled with a colour *role*: ``main`` (the object's named colour), ``dark`` (a darker
shade of it) or a fixed accent RGB (a stem, a trunk, a wheel).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

RGB = tuple[int, int, int]
# ("ellipse", (x0, y0, x1, y1), role) | ("poly", ((x, y), ...), role)
# | ("ring", box, role, width_frac) | ("pieslice", box, role, (start_deg, end_deg))
# | ("line", ((x, y), ...), role, width_frac)
Primitive = tuple


def _regular(n: int, radius: float = 1.0, phase_deg: float = -90.0) -> tuple[tuple[float, float], ...]:
    step = 2 * math.pi / n
    start = math.radians(phase_deg)
    return tuple((radius * math.cos(start + i * step), radius * math.sin(start + i * step)) for i in range(n))


def _rect(x0: float, y0: float, x1: float, y1: float) -> tuple[tuple[float, float], ...]:
    return (x0, y0), (x1, y0), (x1, y1), (x0, y1)


def _cross(w: float) -> tuple[tuple[float, float], ...]:
    """A plus sign of arm half-width ``w``: one arm's three corners, turned a quarter at a time."""
    points = [(-w, -1), (w, -1), (w, -w)]
    for _ in range(3):
        points += [(-y, x) for x, y in points[-3:]]
    return tuple(points)


def _star(points: int, inner: float) -> tuple[tuple[float, float], ...]:
    outer = _regular(points)
    inner_pts = _regular(points, inner, -90.0 + 180.0 / points)
    return tuple(p for pair in zip(outer, inner_pts, strict=True) for p in pair)


BROWN: RGB = (110, 70, 35)
BLACK: RGB = (25, 25, 25)
WHITE: RGB = (245, 245, 245)
CREAM: RGB = (235, 225, 195)


@dataclass(frozen=True)
class Kind:
    """An object kind: its caption names (canonical first, then a synonym) and how to draw it."""

    names: tuple[str, str]
    plural: tuple[str, str]
    parts: tuple[Primitive, ...]


@dataclass(frozen=True)
class Style:
    """A rendering style: ``effect`` selects the renderer's treatment; ``phrase`` opens a caption."""

    name: str
    phrase: str
    effect: str


@dataclass(frozen=True)
class Background:
    """A background texture (renderer ``texture`` id) and the tones it comes in."""

    name: str
    texture: str


@dataclass(frozen=True)
class Domain:
    """Everything one phase draws from; every word here may appear in a caption."""

    name: str
    description: str
    collective: tuple[str, str]
    kinds: tuple[Kind, ...]
    colours: tuple[tuple[str, RGB], ...]
    sizes: tuple[str, str, str]
    rows: tuple[str, str]
    cols: tuple[str, str]
    centre: str
    backgrounds: tuple[Background, ...]
    tones: tuple[tuple[str, RGB], ...]
    styles: tuple[Style, ...]
    sources: tuple[str, ...] = field(default=())

    def position_name(self, row: int, col: int) -> str:
        """Caption words for cell (row, col) of the 3x3 grid: ``top left`` ... ``bottom right``."""
        side = {0: self.cols[0], 2: self.cols[1]}
        if row == 1:
            return self.centre if col == 1 else f"{self.centre} {side[col]}"
        return f"{self.rows[row // 2]} {side.get(col, self.centre)}"

    def slot_items(self) -> dict[str, list[tuple[str, Any]]]:
        """The items of each slot a scene draws (kind, colour, background, tone, style), by caption name."""
        return {
            "kind": [(k.names[0], k) for k in self.kinds],
            "colour": [(c[0], c) for c in self.colours],
            "background": [(b.name, b) for b in self.backgrounds],
            "tone": [(t[0], t) for t in self.tones],
            "style": [(s.name, s) for s in self.styles],
        }


SIZE_FRACTIONS = (0.17, 0.25, 0.34)  # object box side / image side, small -> large

GEOMETRIC = Domain(
    name="geometric",
    description="flat geometric shapes in primary colours on plain backgrounds",
    collective=("shape", "shapes"),
    kinds=(
        Kind(("circle", "disc"), ("circles", "discs"), (("ellipse", (-1, -1, 1, 1), "main"),)),
        Kind(("square", "box"), ("squares", "boxes"), (("poly", _rect(-0.85, -0.85, 0.85, 0.85), "main"),)),
        Kind(
            ("triangle", "wedge"),
            ("triangles", "wedges"),
            (("poly", ((0, -1), (1, 0.85), (-1, 0.85)), "main"),),
        ),
        Kind(
            ("diamond", "rhombus"),
            ("diamonds", "rhombuses"),
            (("poly", ((0, -1), (0.75, 0), (0, 1), (-0.75, 0)), "main"),),
        ),
    ),
    colours=(
        ("red", (220, 40, 40)),
        ("green", (40, 170, 60)),
        ("blue", (40, 80, 220)),
        ("yellow", (240, 210, 40)),
        ("purple", (140, 60, 180)),
        ("orange", (245, 140, 30)),
    ),
    sizes=("small", "medium", "large"),
    rows=("top", "bottom"),
    cols=("left", "right"),
    centre="center",
    backgrounds=(Background("plain", "plain"),),
    tones=(
        ("white", (240, 240, 240)),
        ("gray", (128, 128, 128)),
        ("black", (20, 20, 20)),
        ("beige", (220, 205, 170)),
    ),
    styles=(
        Style("flat", "a flat drawing of", "flat"),
        Style("outlined", "an outlined drawing of", "outlined"),
    ),
)

SIGNS = Domain(
    name="signs",
    description="symbols and signs in jewel tones on striped and checkered backgrounds",
    collective=("symbol", "symbols"),
    kinds=(
        Kind(("star", "pentagram"), ("stars", "pentagrams"), (("poly", _star(5, 0.45), "main"),)),
        Kind(("cross", "plus sign"), ("crosses", "plus signs"), (("poly", _cross(0.3), "main"),)),
        Kind(("ring", "hoop"), ("rings", "hoops"), (("ring", (-1, -1, 1, 1), "main", 0.32),)),
        Kind(
            ("arrow", "pointer"),
            ("arrows", "pointers"),
            (
                (
                    "poly",
                    ((-1, -0.3), (0.15, -0.3), (0.15, -0.75), (1, 0), (0.15, 0.75), (0.15, 0.3), (-1, 0.3)),
                    "main",
                ),
            ),
        ),
        Kind(("hexagon", "hex"), ("hexagons", "hexes"), (("poly", _regular(6, 1.0, 0.0), "main"),)),
    ),
    colours=(
        ("crimson", (180, 20, 60)),
        ("teal", (20, 140, 140)),
        ("violet", (150, 90, 230)),
        ("lime", (150, 230, 50)),
        ("navy", (20, 30, 110)),
        ("amber", (255, 190, 0)),
    ),
    sizes=("tiny", "mid-sized", "big"),
    rows=("upper", "lower"),
    cols=("left", "right"),
    centre="middle",
    backgrounds=(Background("striped", "stripes"), Background("checkered", "checks")),
    tones=(("cream", (238, 228, 200)), ("charcoal", (55, 55, 60)), ("silver", (190, 192, 198))),
    styles=(Style("sticker", "a sticker of", "sticker"), Style("stencil", "a stencil of", "stencil")),
)

ORCHARD = Domain(
    name="orchard",
    description="fruit and plants in earthy colours on dotted and woven backgrounds",
    collective=("fruit", "fruits"),
    kinds=(
        Kind(
            ("apple", "pome"),
            ("apples", "pomes"),
            (
                ("ellipse", (-0.9, -0.7, 0.9, 1.0), "main"),
                ("line", ((0, -0.6), (0.1, -1.0)), BROWN, 0.12),
                ("ellipse", (0.1, -1.0, 0.6, -0.7), (60, 150, 50)),
            ),
        ),
        Kind(
            ("pear", "perry pear"),
            ("pears", "perry pears"),
            (
                ("ellipse", (-0.8, -0.15, 0.8, 1.0), "main"),
                ("ellipse", (-0.45, -0.8, 0.45, 0.35), "main"),
                ("line", ((0, -0.75), (0.05, -1.0)), BROWN, 0.1),
            ),
        ),
        Kind(
            ("cherry", "cherry pair"),
            ("cherries", "cherry pairs"),
            (
                ("line", ((-0.5, 0.3), (0.1, -1.0), (0.5, 0.3)), (60, 120, 40), 0.08),
                ("ellipse", (-1.0, 0.05, -0.1, 0.95), "main"),
                ("ellipse", (0.1, 0.05, 1.0, 0.95), "main"),
            ),
        ),
        Kind(
            ("leaf", "frond"),
            ("leaves", "fronds"),
            (
                ("poly", ((0, -1), (0.55, -0.4), (0.6, 0.3), (0, 1), (-0.6, 0.3), (-0.55, -0.4)), "main"),
                ("line", ((0, -0.9), (0, 0.95)), "dark", 0.08),
            ),
        ),
        Kind(
            ("mushroom", "toadstool"),
            ("mushrooms", "toadstools"),
            (
                ("poly", ((-0.3, -0.1), (0.3, -0.1), (0.35, 1.0), (-0.35, 1.0)), CREAM),
                ("pieslice", (-1.0, -1.0, 1.0, 0.8), "main", (180, 360)),
            ),
        ),
    ),
    colours=(
        ("scarlet", (250, 36, 0)),
        ("olive", (128, 128, 0)),
        ("plum", (142, 69, 133)),
        ("peach", (255, 175, 130)),
        ("maroon", (120, 20, 30)),
        ("mustard", (225, 173, 1)),
    ),
    sizes=("little", "average", "huge"),
    rows=("top", "bottom"),
    cols=("left", "right"),
    centre="centre",
    backgrounds=(Background("dotted", "dots"), Background("woven", "weave")),
    tones=(("tan", (200, 170, 130)), ("mint", (190, 235, 210)), ("lavender", (210, 200, 240))),
    styles=(
        Style("watercolor", "a watercolor painting of", "watercolor"),
        Style("crayon", "a crayon drawing of", "crayon"),
    ),
)

TOWN = Domain(
    name="town",
    description="houses, trees and vehicles in muted tones under gradient skies and grassy ground",
    collective=("object", "objects"),
    kinds=(
        Kind(
            ("house", "cottage"),
            ("houses", "cottages"),
            (
                ("poly", _rect(-0.75, -0.05, 0.75, 1.0), "main"),
                ("poly", ((0, -1.0), (1.0, -0.05), (-1.0, -0.05)), "dark"),
                ("poly", _rect(-0.18, 0.45, 0.18, 1.0), BROWN),
            ),
        ),
        Kind(
            ("tree", "oak"),
            ("trees", "oaks"),
            (("poly", _rect(-0.15, 0.2, 0.15, 1.0), BROWN), ("ellipse", (-0.85, -1.0, 0.85, 0.45), "main")),
        ),
        Kind(
            ("car", "automobile"),
            ("cars", "automobiles"),
            (
                ("poly", _rect(-1.0, -0.05, 1.0, 0.55), "main"),
                ("poly", ((-0.55, -0.05), (-0.35, -0.55), (0.4, -0.55), (0.6, -0.05)), "dark"),
                ("ellipse", (-0.8, 0.35, -0.35, 0.8), BLACK),
                ("ellipse", (0.35, 0.35, 0.8, 0.8), BLACK),
            ),
        ),
        Kind(
            ("tower", "spire"),
            ("towers", "spires"),
            (
                ("poly", _rect(-0.4, -0.45, 0.4, 1.0), "main"),
                ("poly", ((0, -1.0), (0.5, -0.45), (-0.5, -0.45)), "dark"),
                ("poly", _rect(-0.12, -0.2, 0.12, 0.15), CREAM),
            ),
        ),
    ),
    colours=(
        ("brick", (170, 60, 50)),
        ("slate", (90, 100, 130)),
        ("ivory", (250, 245, 225)),
        ("forest", (30, 100, 40)),
        ("sky", (100, 170, 235)),
        ("rust", (190, 80, 20)),
    ),
    sizes=("compact", "regular", "tall"),
    rows=("upper", "lower"),
    cols=("west", "east"),
    centre="middle",
    backgrounds=(Background("gradient", "gradient"), Background("grassy", "noise")),
    tones=(("sandy", (215, 190, 140)), ("misty", (175, 185, 190)), ("rosy", (225, 165, 170))),
    styles=(
        Style("pixel art", "a pixel art picture of", "pixel"),
        Style("night", "a night scene of", "night"),
    ),
)

REEF = Domain(
    name="reef",
    description="sea creatures in vivid colours over wavy, bubbly water",
    collective=("sea creature", "sea creatures"),
    kinds=(
        Kind(
            ("fish", "minnow"),
            ("fish", "minnows"),
            (
                ("ellipse", (-0.75, -0.5, 0.75, 0.5), "main"),
                ("poly", ((0.55, 0), (1.0, -0.6), (1.0, 0.6)), "main"),
                ("ellipse", (-0.5, -0.2, -0.3, 0.0), BLACK),
            ),
        ),
        Kind(
            ("jellyfish", "medusa"),
            ("jellyfish", "medusas"),
            (
                ("pieslice", (-0.9, -1.0, 0.9, 0.5), "main", (180, 360)),
                ("line", ((-0.5, -0.25), (-0.6, 0.4), (-0.45, 1.0)), "main", 0.09),
                ("line", ((0.0, -0.25), (0.1, 0.4), (0.0, 1.0)), "main", 0.09),
                ("line", ((0.5, -0.25), (0.4, 0.4), (0.55, 1.0)), "main", 0.09),
            ),
        ),
        Kind(("starfish", "sea star"), ("starfish", "sea stars"), (("poly", _star(5, 0.62), "main"),)),
        Kind(
            ("shell", "scallop"),
            ("shells", "scallops"),
            (
                ("pieslice", (-1.0, -0.9, 1.0, 1.1), "main", (200, 340)),
                ("poly", ((-0.25, -0.05), (0.25, -0.05), (0.15, 0.35), (-0.15, 0.35)), "main"),
                ("line", ((0, -0.05), (-0.55, -0.75)), "dark", 0.07),
                ("line", ((0, -0.05), (0, -0.9)), "dark", 0.07),
                ("line", ((0, -0.05), (0.55, -0.75)), "dark", 0.07),
            ),
        ),
    ),
    colours=(
        ("coral", (255, 110, 90)),
        ("aqua", (0, 225, 225)),
        ("magenta", (230, 0, 170)),
        ("indigo", (75, 20, 150)),
        ("saffron", (244, 196, 48)),
        ("pink", (255, 150, 200)),
    ),
    sizes=("petite", "medium-sized", "giant"),
    rows=("top", "bottom"),
    cols=("left", "right"),
    centre="center",
    backgrounds=(Background("wavy", "waves"), Background("bubbly", "bubbles")),
    tones=(("abyssal", (20, 40, 80)), ("lagoon", (60, 150, 170)), ("seafoam", (170, 225, 205))),
    styles=(
        Style("neon", "a neon sign of", "neon"),
        Style("underwater", "an underwater photo of", "underwater"),
    ),
)

BASE_DOMAINS: tuple[Domain, ...] = (GEOMETRIC, SIGNS, ORCHARD, TOWN, REEF)


def domain_for_phase(phase: int) -> Domain:
    """The domain of ``phase``: a base domain for the first five; phase ``5 + j`` then takes its kinds and
    words from base domain ``j % 5`` and its colours, backgrounds and styles from three others (offsets
    that change every five phases)."""
    if phase < 0:
        raise ValueError(f"phase must be >= 0, got {phase}")
    n = len(BASE_DOMAINS)
    if phase < n:
        return BASE_DOMAINS[phase]
    j = phase - n
    # the kinds', colours', backgrounds' and styles' base domains: offsets 0, 1, 2, 3 (+ i per cycle of five)
    k, c, b, s = (BASE_DOMAINS[(j + i + i * (j // n)) % n] for i in range(4))
    if c is k:
        c = BASE_DOMAINS[(j + 4) % n]
    return replace(
        k,
        name=f"mix-{k.name}-{c.name}-{b.name}-p{phase:02d}",
        description=f"{k.name} kinds in {c.name} colours on {b.name} backgrounds, {s.name} styles",
        colours=c.colours,
        backgrounds=b.backgrounds,
        tones=b.tones,
        styles=s.styles,
        sources=(k.name, c.name, b.name, s.name),
    )


SHIFTS = ("realistic", "disjoint")
DEFAULT_OLD_WORD_SHARE = 0.6
CORE_KINDS = ("circle", "square", "triangle")
CORE_NAMES = {"kind": CORE_KINDS, "tone": ("white", "gray", "black"), "style": ("flat",)}
NOVEL_DECAY = 0.5  # weight of an item brought by phase q, at phase p > q: NOVEL_DECAY ** (p - q)
NEW_WEIGHT = 1.5  # weight of an item in the phase that brings it


@dataclass(frozen=True)
class RealisticPhase:
    """Phase ``phase`` of the realistic stream: what it may draw, when each item entered, its mix.

    ``domain`` holds every item available (core and everything brought so far, for rendering and
    captions); ``intro`` maps ``(slot, name)`` (slots ``kind``, ``colour``, ``background``, ``tone``,
    ``style``) to the phase that brought it, ``None`` for the core, which never fades.
    """

    phase: int
    domain: Domain
    intro: dict[tuple[str, str], int | None]

    def weight(self, slot: str, name: str) -> float:
        """Sampling weight of an item at this phase: 1 for the core, fading with the item's age."""
        q = self.intro[(slot, name)]
        if q is None:
            return 1.0
        return NEW_WEIGHT if q == self.phase else NOVEL_DECAY ** (self.phase - q)

    def is_new(self, slot: str, name: str) -> bool:
        """Whether this phase brought the item (its words appear in no earlier phase)."""
        return self.intro[(slot, name)] == self.phase and self.phase > 0


def realistic_phase(phase: int) -> RealisticPhase:
    """The realistic plan of ``phase``: the core vocabulary plus the novelty of every phase up to it.

    Phase 0 is the geometric domain (diamond, beige and outlined fade like any novelty); phases 1-4 each
    bring the kinds, colours, backgrounds, tones and styles of the next base domain, with the core's sizes
    and positions; later phases bring nothing new, the mix shifting towards the core and the newest items.
    """
    if phase < 0:
        raise ValueError(f"phase must be >= 0, got {phase}")
    brought_by = BASE_DOMAINS[: min(phase, len(BASE_DOMAINS) - 1) + 1]
    intro: dict[tuple[str, str], int | None] = {}
    slots: dict[str, list] = defaultdict(list)
    for q, src in enumerate(brought_by):
        for slot, items in src.slot_items().items():
            for name, item in items:  # the core: CORE_NAMES, and geometric's colours and backgrounds
                is_core = name in CORE_NAMES[slot] if slot in CORE_NAMES else q == 0
                intro[(slot, name)] = None if is_core else q
                slots[slot].append(item)
    newest = BASE_DOMAINS[phase] if phase < len(BASE_DOMAINS) else None  # the base domain it brings
    brought = (
        f"new: {', '.join(k.names[0] for k in newest.kinds)}; "
        f"{', '.join(c for c, _ in newest.colours)}; "
        f"{' and '.join(b.name for b in newest.backgrounds)} backgrounds; "
        f"{' and '.join(s.name for s in newest.styles)} styles"
        if newest is not None and phase > 0
        else ("the core vocabulary" if phase == 0 else "no new word, a shifted mix")
    )
    domain = replace(
        GEOMETRIC,  # its sizes and positions are the core's
        name=f"r{phase:02d}-{newest.name if newest is not None else 'mix'}",
        description=f"core shapes, colours, sizes and positions with what earlier phases brought; {brought}",
        collective=("object", "objects"),
        kinds=tuple(slots["kind"]),
        colours=tuple(slots["colour"]),
        backgrounds=tuple(slots["background"]),
        tones=tuple(slots["tone"]),
        styles=tuple(slots["style"]),
        sources=tuple(d.name for d in brought_by),
    )
    return RealisticPhase(phase, domain, intro)
