"""Per-sample checks that Great Expectations cannot express (tar safety, image decoding, UTF-8, JSON and its
schema), and the per-sample facts the expectation suites then run on. :data:`REASONS` lists every reason a
sample can be quarantined for."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from components.data.validation.policy import ValidationPolicy
from components.data.validation.shard_reader import Member, SampleGroup
from schemas import load_schema

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXTENSION = "txt"
METADATA_EXTENSION = "json"
_PIL_FORMATS = ("JPEG", "PNG", "WEBP")
_CHECK_SIZE = 64  # the short side a within-bounds image is decoded to when checked
SAMPLE_FACTS = (  # facts of a sample's members, None until a check finds them
    *("image_member", "image_bytes", "width", "height", "image_transparent"),
    *("caption_member", "caption", "caption_chars", "caption_tokens", "metadata_member", "metadata_key"),
)

REASONS: dict[str, str] = {
    # Python checks (this module)
    "unsafe_member": "a member has an absolute name or a '..' component, or is not a regular file",
    "duplicate_member": "two members of one sample share an extension",
    "truncated": "the shard ends inside one of the sample's members",
    "member_too_large": "a member's header declares more bytes than the policy allows for its extension",
    "image_multiple": "the sample has more than one image member",
    "image_empty": "the image member is empty (0 bytes)",
    "image_undecodable": "the image member cannot be decoded as JPEG, PNG or WebP",
    "image_pixels": "the image header declares more pixels (width x height) than the policy's max_pixels",
    "caption_not_utf8": "the caption member is not valid UTF-8",
    "metadata_not_json": "the metadata member is not a JSON document",
    "metadata_schema": "the metadata breaks schemas/sample.schema.json",
    # Great Expectations (schemas/expectations/samples.json)
    "key_invalid": "the key has characters outside [A-Za-z0-9_.-]",
    "duplicate_key": "the key occurs more than once in the phase (within or across shards)",
    "image_missing": "the sample has no image member (.jpg/.jpeg/.png/.webp)",
    "caption_missing": "the sample has no caption member (.txt)",
    "metadata_missing": "the sample has no metadata member (.json)",
    "metadata_key_mismatch": "the metadata 'key' differs from the member key",
    "image_size": "the image width or height is outside the policy bounds",
    "caption_empty": "the caption is empty",
    "caption_blank": "the caption is whitespace only",
    "caption_length": "the caption length in characters is outside the policy bounds",
}


@dataclass(frozen=True)
class Reason:
    """Why a sample is quarantined: a code from :data:`REASONS` and a message naming the problem."""

    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass
class CheckTimings:
    """Seconds spent in image decoding and in the other per-sample checks (accumulated)."""

    decode_s: float = 0.0
    other_s: float = 0.0


def inspect_sample(
    group: SampleGroup,
    shard: str,
    shard_index: int,
    row: int,
    policy: ValidationPolicy,
    timings: CheckTimings,
) -> tuple[dict[str, Any], list[Reason]]:
    """Check one sample; return its facts (one DataFrame row for the suites) and the reasons found here."""
    start = time.perf_counter()
    members = group.members
    reasons = _member_reasons(members)
    # Safe regular files count as present; a cut-off one is present but its content is not checked.
    present = [m for m in members if not m.unread and not unsafe_member_problem(m)]
    images = [m for m in present if m.ext in IMAGE_EXTENSIONS]
    captions = [m for m in present if m.ext == CAPTION_EXTENSION]
    metadata = [m for m in present if m.ext == METADATA_EXTENSION]
    facts: dict[str, Any] = {
        "row": row,
        "shard": shard,
        "shard_index": shard_index,
        "sample_index": group.index,
        "key": group.key,
        "members": len(members),
        **dict.fromkeys(SAMPLE_FACTS),
    }
    if len(images) > 1:
        names = ", ".join(repr(m.name) for m in images)
        reasons.append(Reason("image_multiple", f"several image members: {names}"))
    if captions:
        facts["caption_member"] = captions[0].name
        if not captions[0].truncated:
            reasons += _read_caption(captions[0], facts)
    if metadata:
        facts["metadata_member"] = metadata[0].name
        if not metadata[0].truncated:
            facts["metadata_key"], problem = _check_metadata(metadata[0])
            reasons += [problem] if problem else []
    timings.other_s += time.perf_counter() - start
    if images:
        start = time.perf_counter()
        image = images[0]
        facts["image_member"], facts["image_bytes"] = image.name, len(image.data)
        if not image.truncated:
            facts["width"], facts["height"], problem, facts["image_transparent"] = _check_image(image, policy)
            reasons += [problem] if problem else []
        timings.decode_s += time.perf_counter() - start
    return facts, reasons


def _member_reasons(members: list[Member]) -> list[Reason]:
    """Unsafe, unread (too large) and cut-off members, and members of one sample sharing an extension."""
    reasons: list[Reason] = []
    for member in members:
        problem = unsafe_member_problem(member)
        if problem:
            reasons.append(Reason("unsafe_member", f"member {member.name!r} {problem}"))
        if member.unread:
            reasons.append(Reason("member_too_large", f"member {member.name!r} {member.unread}; not read"))
        elif member.truncated:
            cut = f"{len(member.data)} of {member.info.size} bytes in the shard"
            reasons.append(Reason("truncated", f"member {member.name!r} is cut off: {cut}"))
    seen: dict[str, str] = {}
    for member in members:
        if member.ext in seen:
            shared = f"members {seen[member.ext]!r} and {member.name!r} share the extension .{member.ext}"
            reasons.append(Reason("duplicate_member", shared))
        seen.setdefault(member.ext, member.name)
    return reasons


def _read_caption(member: Member, facts: dict[str, Any]) -> list[Reason]:
    """Decode the caption into ``facts`` (text, characters, tokens); a reason when it is not UTF-8."""
    try:
        caption = member.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"caption {member.name!r} is not valid UTF-8 (byte {exc.start}: {exc.reason})"
        return [Reason("caption_not_utf8", why)]
    facts.update(caption=caption, caption_chars=len(caption), caption_tokens=caption_tokens(caption))
    return []


@lru_cache(maxsize=1)
def _clip_tokenizer() -> Any:
    """CLIP's BPE tokenizer as :mod:`compat.models.text_tower` restates it (open_clip's own imports torch and
    every model family: seconds of a validation task's start for counting tokens)."""
    from compat.models.text_tower import ClipTokenizer

    return ClipTokenizer(context_length=77)


def caption_tokens(caption: str) -> int:
    """Tokens of ``caption`` under open_clip's CLIP BPE tokenizer, start and end tokens included: what the
    text tower's context must hold (the tokenizer cuts anything beyond it)."""
    return len(_clip_tokenizer().encode(caption)) + 2


def unsafe_member_problem(member: Member) -> str | None:
    """Why extracting this member would be unsafe (absolute, '..', not a regular file), or None."""
    info = member.info
    name = info.name
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "has an absolute path"
    if ".." in name.replace("\\", "/").split("/"):
        return "has a '..' path component"
    if not info.isreg():
        links = {"a symbolic link": info.issym(), "a hard link": info.islnk()}
        kinds = {**links, "a directory": info.isdir(), "a device": info.isdev()}
        kind = next((k for k, found in kinds.items() if found), f"of tar type {info.type!r}")
        target = f" to {info.linkname!r}" if any(links.values()) else ""
        return f"is {kind}{target}, not a regular file"
    return None


def _check_image(
    member: Member, policy: ValidationPolicy
) -> tuple[int | None, int | None, Reason | None, bool | None]:
    """Width, height (upright, as :func:`compat.data.images.decode_rgb` reads it), a problem, and whether the
    picture carries transparency. Only an image within bounds is decoded, at a small size (JPEGs at 1/8 scale:
    libjpeg still reads every byte, so a cut-off file fails); one over ``max_pixels`` is ``image_pixels``."""
    if not member.data:
        return None, None, Reason("image_empty", f"image {member.name!r} is empty (0 bytes)"), None
    from compat.data.images import ImageDecodeError, ImageTooLargeError, decode_rgb, read_header

    transparent = None
    try:
        header = read_header(member.data, _PIL_FORMATS, max_pixels=policy.max_pixels)
        width, height, transparent = header.width, header.height, header.transparent
        if width <= policy.max_width and height <= policy.max_height:
            decoded = decode_rgb(
                member.data, formats=_PIL_FORMATS, size=_CHECK_SIZE, max_pixels=policy.max_pixels
            )
            width, height = decoded.info["original_size"]
    except ImageTooLargeError as exc:
        width, height = exc.size or (None, None)
        return width, height, Reason("image_pixels", f"image {member.name!r}: {exc}"), transparent
    except ImageDecodeError as exc:
        reason = Reason("image_undecodable", f"image {member.name!r} cannot be decoded: {exc}")
        return None, None, reason, transparent
    except Exception as exc:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError, ...)
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        reason = Reason("image_undecodable", f"image {member.name!r} cannot be decoded: {detail}")
        return None, None, reason, transparent
    return width, height, None, transparent


@lru_cache(maxsize=1)
def _sample_validator():
    import jsonschema

    schema = load_schema("sample")
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _check_metadata(member: Member) -> tuple[str | None, Reason | None]:
    """Parse the metadata member and validate it; return its ``key`` (when a string) and a problem."""
    try:
        document = json.loads(member.data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return None, Reason("metadata_not_json", f"metadata {member.name!r} is not JSON: {exc}")
    key = document.get("key") if isinstance(document, dict) else None
    key = key if isinstance(key, str) else None
    errors = sorted(_sample_validator().iter_errors(document), key=lambda e: list(e.absolute_path))
    if not errors:
        return key, None
    detail = "; ".join(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:3])
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    why = f"metadata {member.name!r} breaks schemas/sample.schema.json: {detail}{more}"
    return key, Reason("metadata_schema", why)
