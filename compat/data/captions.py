"""Captions of a synthetic scene: five template paraphrases, all naming the attributes that vary.

Every paraphrase names each object's colour and kind (canonical name or its synonym) and the
background tone; four of the five also give each object's size and grid position and the texture,
so captions tell images of the same domain apart. The short one (template 2) groups identical
objects and counts them ("two red circles"). Objects come first and the background last, so a
text encoder that truncates long captions loses the least telling words.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from compat.data.domains import Domain

COUNT_WORDS = ("no", "one", "two", "three", "four", "five")


def article(word: str) -> str:
    """``a`` or ``an`` for the word that follows."""
    return "an" if word[:1] in "aeio" else "a"


def join_and(items: list[str]) -> str:
    """``x``, ``x and y``, ``x, y and z``."""
    return "".join(items) if len(items) <= 1 else ", ".join(items[:-1]) + " and " + items[-1]


def scene_captions(scene: dict[str, Any], domain: Domain) -> list[str]:
    """The five paraphrases of ``scene`` in template order (template 0 is the most explicit)."""
    kinds = {k.names[0]: k for k in domain.kinds}
    style = next(s for s in domain.styles if s.name == scene["style"])
    bg = scene["background"]
    tex, tone = bg["name"], bg["tone"]
    objs = scene["objects"]
    n = len(objs)
    count = COUNT_WORDS[n] if n < len(COUNT_WORDS) else n
    collective = f"{count} {domain.collective[0] if n == 1 else domain.collective[1]}"

    def full(o: dict[str, Any]) -> str:
        return f"{o['size']} {o['colour']} {o['kind']}"

    t0 = (
        f"{style.phrase} "
        + join_and([f"{article(o['size'])} {full(o)} at {o['position']}" for o in objs])
        + f" on {tex} {tone}"
    )
    t1 = (
        f"{collective}: "
        + "; ".join(f"{o['colour']} {o['kind']}, {o['size']}, {o['position']}" for o in objs)
        + f"; {tone} {tex} {style.name}"
    )
    groups = Counter((o["colour"], o["kind"]) for o in objs)
    t2 = (
        join_and(
            [
                f"{article(colour)} {colour} {kinds[kind].names[1]}"
                if c == 1
                else f"{COUNT_WORDS[c]} {colour} {kinds[kind].plural[1]}"
                for (colour, kind), c in groups.items()
            ]
        )
        + f" on {tone}"
    )
    t3 = ", ".join(f"{o['position']}: {full(o)}" for o in objs) + f". {tex} {tone} background"
    t4 = (
        f"{style.name}: "
        + ", ".join(
            f"{o['size']} {kinds[o['kind']].names[1]} in {o['colour']} at {o['position']}" for o in objs
        )
        + f" on {tex} {tone}"
    )
    return [t0, t1, t2, t3, t4]
