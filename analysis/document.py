"""A tiny document model rendered both as Markdown and as one self-contained HTML page, and the
one way a generated page is written (:func:`write_document`).

The report is built once as a list of blocks (headings, paragraphs, tables, figures) and
rendered twice, so ``report.md`` and ``report.html`` always say the same thing. Inline text may
use ``**bold**`` and `` `code` `` (the only Markdown the HTML renderer translates). Figures are
referenced by relative file name in Markdown and embedded as base64 PNG data URIs in HTML.

Every page :mod:`analysis` generates — the report (``report.md``, ``report.html``),
``docs/findings.md`` (:mod:`analysis.findings`) and ``docs/reproductions.md``
(:mod:`analysis.reproduce.page`) — is a :class:`Document` written by :func:`write_document`.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, Union

from analysis.text import write_atomic

__all__ = ["Block", "Bullets", "Document", "Heading", "Image", "Para", "Table", "write_document"]


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Para:
    text: str


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    caption: str = ""


@dataclass
class Image:
    path: Path  # PNG on disk, next to the report
    title: str
    caption: str


Block = Union[Heading, Para, Bullets, Table, Image]


@dataclass
class Document:
    title: str
    blocks: list[Block] = field(default_factory=list)

    def h(self, level: int, text: str) -> None:
        self.blocks.append(Heading(level, text))

    def p(self, text: str) -> None:
        self.blocks.append(Para(text))

    def bullets(self, items: Sequence[str]) -> None:
        self.blocks.append(Bullets(list(items)))

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[object]],
              caption: str = "") -> None:
        self.blocks.append(Table(list(columns), [[str(c) for c in r] for r in rows], caption))

    def image(self, path: Path, title: str, caption: str) -> None:
        self.blocks.append(Image(path, title, caption))

    # ----------------------------------------------------------------------------------------
    def to_markdown(self, base: Path) -> str:
        """Markdown with figure links relative to ``base`` (the report's folder)."""
        out = [f"# {self.title}", ""]
        for b in self.blocks:
            if isinstance(b, Heading):
                out += ["#" * (b.level + 1) + " " + b.text, ""]
            elif isinstance(b, Para):
                out += [b.text, ""]
            elif isinstance(b, Bullets):
                out += [f"- {item}" for item in b.items] + [""]
            elif isinstance(b, Table):
                if b.caption:
                    out += [b.caption, ""]
                out.append("| " + " | ".join(_md_cell(c) for c in b.columns) + " |")
                out.append("|" + "|".join("---" for _ in b.columns) + "|")
                out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in b.rows]
                out.append("")
            elif isinstance(b, Image):
                rel = b.path.relative_to(base).as_posix() if b.path.is_relative_to(base) \
                    else b.path.as_posix()
                out += [f"![{b.path.stem}]({rel})", "", f"*{b.caption}*", ""]
        return "\n".join(out).rstrip() + "\n"

    def to_html(self) -> str:
        """One HTML page with inline CSS and every figure embedded as a base64 PNG."""
        body = [f"<h1>{_inline(self.title)}</h1>"]
        for b in self.blocks:
            if isinstance(b, Heading):
                lvl = min(b.level + 1, 6)
                anchor = re.sub(r"[^a-z0-9]+", "-", b.text.lower()).strip("-")
                body.append(f'<h{lvl} id="{anchor}">{_inline(b.text)}</h{lvl}>')
            elif isinstance(b, Para):
                body.append(f"<p>{_inline(b.text)}</p>")
            elif isinstance(b, Bullets):
                body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items)
                            + "</ul>")
            elif isinstance(b, Table):
                head = "".join(f"<th>{_inline(c)}</th>" for c in b.columns)
                rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>"
                               for r in b.rows)
                cap = f"<caption>{_inline(b.caption)}</caption>" if b.caption else ""
                body.append(f"<table>{cap}<thead><tr>{head}</tr></thead>"
                            f"<tbody>{rows}</tbody></table>")
            elif isinstance(b, Image):
                data = base64.b64encode(b.path.read_bytes()).decode("ascii")
                body.append(
                    f'<figure><img alt="{html.escape(b.path.stem)}" '
                    f'data-file="{html.escape(b.path.name)}" '
                    f'src="data:image/png;base64,{data}"/>'
                    f"<figcaption><b>{_inline(b.title)}.</b> {_inline(b.caption)}</figcaption>"
                    "</figure>")
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"/>"
                f"<title>{html.escape(self.title)}</title><style>{_CSS}</style></head>"
                "<body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_document(doc: Document, path: str | Path) -> Path:
    """Render ``doc`` for ``path`` and write it there atomically
    (:func:`analysis.text.write_atomic`): a ``.html`` path gets the self-contained HTML page, any
    other the Markdown, its figure links relative to the page's folder. Returns ``path``."""
    path = Path(path)
    text = doc.to_html() if path.suffix == ".html" else doc.to_markdown(path.parent)
    write_atomic(path, text)
    return path


_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
    "line-height:1.45;color:#222}table{border-collapse:collapse;margin:.6em 0 1.2em;"
    "font-size:.85em}th,td{border:1px solid #ccc;padding:.25em .5em;text-align:left}"
    "th{background:#f3f3f3}caption{caption-side:top;text-align:left;font-style:italic;"
    "padding:.3em 0}figure{margin:1.2em 0}img{max-width:100%}figcaption{font-size:.85em;"
    "color:#444}code{background:#f3f3f3;padding:0 .2em}"
)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _inline(text: str) -> str:
    """Escape HTML, then translate `code` and **bold** — bold around code spans too
    (``**`rl` at `fp16`**``), never inside one: code spans are set aside as numbered
    placeholders between NUL characters (removed from the text first) while bold is matched."""
    spans: list[str] = []

    def keep(m: re.Match[str]) -> str:
        spans.append(f"<code>{m.group(0)[1:-1]}</code>")
        return f"\x00{len(spans) - 1}\x00"

    text = re.sub(r"`[^`]+`", keep, html.escape(text).replace("\x00", ""))
    text = re.sub(r"\*\*([^*]+?)\*\*", r"<b>\1</b>", text)
    return re.sub("\x00([0-9]+)\x00", lambda m: spans[int(m.group(1))], text)
