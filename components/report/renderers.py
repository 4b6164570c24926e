"""Render report sections as one self-contained HTML page (inline CSS, base64 PNGs) or as Markdown."""

from __future__ import annotations

import base64
from html import escape
from typing import Any

from compat.io import utc_now
from components.report.header import SEAL_MARK, SEAL_SLOT, Header
from components.report.sections import Figure, Hits, Link, Note, Section, Table

CSS = """
body{font:14px/1.45 -apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:#1f2328;margin:0;
 background:#f6f8fa}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:0;display:flex;gap:10px;align-items:center}
section{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:16px 20px;margin:16px 0}
.facts{display:flex;flex-wrap:wrap;gap:6px 22px;color:#57606a;margin:8px 0 0}
.facts b{color:#1f2328;font-weight:600}
.badge{font-size:12px;font-weight:600;padding:2px 10px;border-radius:12px;background:#eaeef2;color:#57606a}
.good .badge,.badge.good{background:#dafbe1;color:#1a7f37}
.bad .badge,.badge.bad{background:#ffebe9;color:#cf222e}
.warn .badge,.badge.warn{background:#fff8c5;color:#9a6700}
.banner{font-size:20px;font-weight:700;padding:10px 16px;border-radius:6px;margin-top:12px}
.banner.good{background:#dafbe1;color:#1a7f37}.banner.bad{background:#ffebe9;color:#cf222e}
.banner.muted{background:#eaeef2;color:#57606a}.banner.warn{background:#fff8c5;color:#9a6700}
.next{margin:10px 0 0}.next code{display:block;margin-top:4px;padding:6px 10px;background:#1f2328;color:#fff;
 border-radius:6px;font-size:13px}.links{margin:8px 0 0;display:flex;flex-wrap:wrap;gap:4px 18px}
table{border-collapse:collapse;margin:10px 0;font-size:13px}
th,td{border:1px solid #d0d7de;padding:4px 10px;text-align:left;vertical-align:top}
th{background:#f6f8fa}
caption{text-align:left;color:#57606a;font-size:12px;padding-bottom:2px}
p.good{color:#1a7f37}p.bad{color:#cf222e}p.warn{color:#9a6700}p.muted{color:#57606a;font-size:12px}
figure{margin:12px 0}figure img{max-width:100%;border:1px solid #eaeef2}
figcaption{color:#57606a;font-size:12px}
.hits{display:flex;gap:10px;flex-wrap:wrap;margin:4px 0 12px}.hits figure{margin:0;width:120px}
.hits img{width:96px;height:96px;object-fit:contain;background:#f6f8fa}
details summary{cursor:pointer;color:#0969da;margin-top:8px}
"""


TONES = {"succeeded": "good", "blocked": "bad", "rejected": "warn", "failed": "bad"}
SEAL_HELP = f"check: grep -v {SEAL_MARK} FILE | sha256sum (every line but this one)"


def html(title: str, head: Header, sections: list[Section]) -> str:
    """The whole report as one HTML document with nothing fetched from elsewhere; call
    :func:`components.report.header.seal` on it to write its hash."""
    gate = next((s for s in sections if s.key == "gate"), None)
    gate_word = gate.status.upper() if gate is not None and gate.status != "not run" else "not run"
    banner = f"Outcome: {head.outcome} · Gate: {gate_word}"
    command = f"<code>{escape(head.command)}</code>" if head.command else ""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body><main>",
        f"<h1>{escape(title)}</h1>",
        f'<div class="banner {TONES.get(head.outcome, "muted")}">{escape(banner)}</div>',
        '<div class="facts">'
        + "".join(f"<span>{escape(k)}: <b>{escape(v)}</b></span>" for k, v in head.facts)
        + "</div>",
        '<div class="links">' + "".join(_html_link(link) for link in head.links) + "</div>",
        f'<p class="next" id="next"><b>{escape(head.next)}</b>{command}</p>',
        f'<p class="muted" id="{SEAL_MARK}">report sha256: <b>{SEAL_SLOT}</b> ({escape(SEAL_HELP)})</p>',
    ]
    for section in sections:
        parts.append(f'<section id="{escape(section.key)}" class="{escape(section.tone)}">')
        parts.append(f'<h2>{escape(section.title)} <span class="badge">{escape(section.status)}</span></h2>')
        parts += [_html_item(item) for item in section.items]
        parts.append("</section>")
    parts.append(f'<p class="muted">generated {escape(utc_now())} by compatflow</p></main></body></html>')
    return "\n".join(parts) + "\n"


def _html_link(item: Link) -> str:
    missing = "" if item.exists else ' <span class="badge warn">file not found</span>'
    return f'<span><a href="{escape(item.href, quote=True)}">{escape(item.text)}</a>{missing}</span>'


def _html_item(item: Note | Table | Figure | Link | Hits) -> str:
    if isinstance(item, Hits):
        return "".join(_html_hits(text, hits) for text, hits in item.queries)
    if isinstance(item, Note):
        return f'<p class="{escape(item.tone)}">{escape(item.text)}</p>'
    if isinstance(item, Link):
        return f"<p>{_html_link(item)} ({escape(item.href)})</p>"
    if isinstance(item, Figure):
        data = base64.b64encode(item.png).decode("ascii")
        return (
            f'<figure><img alt="{escape(item.title, quote=True)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{escape(item.title)}</figcaption></figure>"
        )
    head = "".join(f"<th>{escape(str(h))}</th>" for h in item.headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(_cell(c))}</td>" for c in row) + "</tr>" for row in item.rows
    )
    caption = f"<caption>{escape(item.caption)}</caption>" if item.caption and not item.collapsed else ""
    table = f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    if item.collapsed:
        return f"<details><summary>{escape(item.caption or 'details')}</summary>{table}</details>"
    return table


def _html_hits(text: str, hits: list[Any]) -> str:
    figures = []
    for rank, hit in enumerate(hits, start=1):
        thumbnail = str(hit.get("thumbnail") or "")
        picture = (
            f'<img alt="hit {rank}" src="{escape(thumbnail, quote=True)}">'
            if thumbnail.startswith("data:image/")
            else '<span class="badge warn">no picture</span>'
        )
        where = f"{_score(hit.get('score'))}, v{_cell(hit.get('model_version'))}"
        label = f"{rank}. {_cell(hit.get('caption'))} ({where})"
        figures.append(f"<figure>{picture}<figcaption>{escape(label)}</figcaption></figure>")
    return f'<p><b>{escape(text)}</b></p><div class="hits">{"".join(figures) or "no hits"}</div>'


def _score(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


def markdown(title: str, head: Header, sections: list[Section]) -> str:
    """The same report as Markdown text (plots are named; they live in the HTML report)."""
    lines = [f"# {title}", "", *(f"- **{k}**: {v}" for k, v in head.facts)]
    lines += [f"- {_md_item(link)[0]}" for link in head.links]
    lines += ["", f"**{_md(head.next)}**" + (f" `{head.command}`" if head.command else ""), ""]
    lines += [f"_{SEAL_MARK}: {SEAL_SLOT} ({SEAL_HELP})_", ""]
    for section in sections:
        lines += [f"## {section.title} — {section.status}", ""]
        for item in section.items:
            lines += _md_item(item) + [""]
    lines.append(f"_generated {utc_now()} by compatflow_")
    return "\n".join(lines) + "\n"


def _md_item(item: Note | Table | Figure | Link | Hits) -> list[str]:
    if isinstance(item, Hits):
        width = max((len(hits) for _, hits in item.queries), default=0)
        headers = ["query", *(f"hit {i}" for i in range(1, width + 1))]
        rows = [
            [text, *(f"{_cell(h.get('caption'))} ({_score(h.get('score'))})" for h in hits)]
            for text, hits in item.queries
        ]
        return [*_md_table(headers, rows), "", "*Thumbnails in the HTML report.*"]
    if isinstance(item, Note):
        return [f"_{_md(item.text)}_" if item.tone == "muted" else _md(item.text)]
    if isinstance(item, Link):
        return [f"[{_md(item.text)}]({item.href})" + ("" if item.exists else " (file not found)")]
    if isinstance(item, Figure):
        return [f"*Plot: {_md(item.title)} (in the HTML report)*"]
    out = [f"**{_md(item.caption)}**", ""] if item.caption else []
    return out + _md_table([str(h) for h in item.headers], [[_cell(c) for c in row] for row in item.rows])


def _md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(map(_md, headers)) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(map(_md, row)) + " |" for row in rows]


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
