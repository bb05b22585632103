"""Findings as Markdown, as a self-contained HTML page (every text escaped), and their
Recommendation section as JSON for the front page."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path

from servematrix.reporting.findings.common import CAPACITY_TITLE, Findings, Section, Table


def _markdown_table(table: Table) -> list[str]:
    def row(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    title = [f"**{table.title}**", ""] if table.title else []
    return [*title, row(table.header), row(["---"] * len(table.header)), *map(row, table.rows), ""]


def to_markdown(findings: Findings) -> str:
    lines = [f"# Findings: {findings.title}", ""]
    for section in findings.sections:
        lines += [f"## {section.title}", ""]
        if section.sentences:
            lines += [f"- {sentence}" for sentence in section.sentences]
            lines.append("")
        for table in section.tables:
            lines += _markdown_table(table)
    return "\n".join(lines)


def html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table.rows
    )
    caption = f"<caption>{html.escape(table.title)}</caption>" if table.title else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def to_html(findings: Findings) -> str:
    """A self-contained page (no external resources), every text escaped."""
    body = [f"<h1>Findings: {html.escape(findings.title)}</h1>"]
    for section in findings.sections:
        body.append(f"<h2>{html.escape(section.title)}</h2>")
        if section.sentences:
            body.append("<ul>")
            body += [f"<li>{html.escape(s)}</li>" for s in section.sentences]
            body.append("</ul>")
        body += [html_table(table) for table in section.tables]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>Findings: {html.escape(findings.title)}</title>\n"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.5}"
        "h2{margin-top:1.5em}table{border-collapse:collapse;font-size:0.9em}"
        "th,td{border:1px solid #ccc;padding:0.25em 0.5em;text-align:left}</style>\n"
        "</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )


def recommendation_json(findings: Findings) -> str:
    """The findings' Recommendation sentences with the capacity tables below them (the
    "Capacity at the SLO" section), for the front page."""
    section = next(
        (s for s in findings.sections if s.title == "Recommendation"),
        Section(
            "Recommendation",
            ["No capacity to recommend by: the workload caps concurrency (max_concurrency)."],
        ),
    )
    detail = [t for s in findings.sections if s.title == CAPACITY_TITLE for t in s.tables]
    merged = Section(section.title, section.sentences, section.tables + detail)
    return json.dumps(asdict(merged), indent=1) + "\n"


def recommendation_of(path: str | Path) -> Section:
    """The Recommendation section a findings job wrote as JSON."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return Section(data["title"], data["sentences"], [Table(**t) for t in data["tables"]])
