"""report.md and the tables of index.html, from report.json alone (read as a `Report`).

Model: the recommendation first, then the problems (failed requests, failed gates) when there
are any, then one table per metric group (`reports.metrics.GROUPS`:
memory, quality, divergence, serving), each with the variant's name in its first column, and the
paired comparisons against the reference as their own table (difference, 95% interval, p before
and after adjustment, the smallest difference the n could detect, verdict). Then the Pareto front,
KV saturation, the server check and the chat answers.
"""

from __future__ import annotations

import html
from typing import Any

from reports.comparisons import describe_delta, describe_mde
from reports.metrics import GROUPS, VARIANT
from reports.records import Column, Report
from reports.sittings import sitting_lines, twin_lines


def fmt(value: Any, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "bytes":
        return f"{value / 1e6:.2f} MB"
    if kind == "int":
        return f"{value:,.0f}"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "pct100":
        return f"{value:.1f}%"
    if kind == "float":
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def cell(row: dict[str, Any], col: Column) -> str:
    """A table cell: the value, and ± its standard error where the column has one."""
    text = fmt(row.get(col.key), col.format)
    stderr = row.get(col.stderr_key) if col.stderr_key else None
    if stderr is None or row.get(col.key) is None:
        return text
    if col.format == "pct":
        return f"{text} ± {100 * stderr:.1f}"
    return f"{text} ± {fmt(stderr, col.format)}"


def grouped_tables(report: Report) -> list[tuple[str, str, list[Column]]]:
    """[(group id, title, columns)]: the memory table carries the variant's steps; every table
    starts with the variant's name; groups without columns are left out."""
    cols = report.columns
    name = next(c for c in cols if c.key == VARIANT.key)
    out: list[tuple[str, str, list[Column]]] = []
    for group, title in GROUPS.items():
        if group == "variant":
            continue
        members = [c for c in cols if c.group == group]
        if group == "memory":
            members = [c for c in cols if c.group == "variant" and c is not name] + members
        if members:
            out.append((group, title, [name, *members]))
    return out


def comparison_rows(report: Report) -> list[list[str]]:
    """The paired table's cells: variant, metric, difference [interval], p, adjusted p, the
    smallest detectable difference, verdict."""
    return [
        [
            r.variant,
            report.label(r.metric),
            describe_delta(r),
            f"{r.p:.3g}",
            f"{r.p_adjusted:.3g}",
            describe_mde(r),
            r.verdict,
        ]
        for r in report.comparisons.rows
    ]


COMPARISON_HEAD = ["variant", "metric", "difference [95% CI]", "p", "p adjusted",
                   "detectable at this n", "verdict"]  # fmt: skip


def answer_table(report: Report) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(prompt, [(variant, answer)])]: every variant's greedy answer to each chat prompt."""
    answers = report.document.get("answers") or {}
    names = [v.name for v in report.variants if v.name in answers]
    if not names:
        return []
    prompts = [a["prompt"] for a in answers[names[0]]]
    return [(p, [(n, answers[n][i]["answer"]) for n in names]) for i, p in enumerate(prompts)]


def _md_table(head: list[str], rows: list[list[str]], numeric: list[bool]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def front_sentence(report: Report) -> str:
    axis = report.quality_axis
    text = f"Pareto front (weight memory vs {axis.key}): {', '.join(report.pareto_front) or '–'}."
    if axis.excluded:
        text += (
            f" Not on this axis (trained or calibrated on its data): {', '.join(axis.excluded)}."
        )
    return text


def saturation_lines(report: Report) -> list[str]:
    lines = []
    for v in report.variants:
        for length, sat in (v.load or {}).get("saturation", {}).items():
            kv_tokens = (v.load or {})["kv_tokens"]
            lines.append(
                f"{v.name}, prompt {length}: KV saturated at concurrency "
                f"{sat['measured_concurrency'] or 'not reached'} (estimate "
                f"{sat['estimated_concurrency']:.1f} from {kv_tokens:.0f} KV tokens)"
            )
    return lines


def server_check_lines(report: Report) -> list[str]:
    check = report.document.get("server_check")
    if not check:
        return []
    lines = [f"Server check ({check['variant']}, lm-eval local-completions vs in-process, "
             f"tolerance {check['abs_tol']} + {check['rel_tol']}·|ll| nats): "
             f"{'agree' if check['ok'] else 'DISAGREE'}"]  # fmt: skip
    for task, t in check["tasks"].items():
        lines.append(
            f"- {task}: {t['requests']} requests, max |Δ| {t['max_abs_diff']:.2e} nats "
            f"(relative {t['max_rel_diff']:.1e})"
        )
    return lines


def markdown(report: Report) -> str:
    m = report.document["machine"]
    lines = [
        f"# {report.title}",
        "",
        f"Created {report.created} on {m['platform']}, {m['cpu_count']} CPUs, torch "
        f"{m['torch']}{', ' + m['cuda'] if m['cuda'] else ''}.",
        "",
        "## Recommendation",
        "",
        *(f"- {s}" for s in report.recommendation.sentences),
    ]
    if report.problems:
        lines += ["", "## Problems", "", *(f"- {p}" for p in report.problems)]
    for _, title, cols in grouped_tables(report):
        lines += ["", f"## {title}", ""]
        rows = [[cell(v.row, c) for c in cols] for v in report.variants]
        lines += _md_table([c.label for c in cols], rows, [c.format != "text" for c in cols])
    paired = comparison_rows(report)
    if paired:
        lines += ["", f"## Paired against {report.comparisons.reference}", ""]
        lines += _md_table(COMPARISON_HEAD, paired, [False, False, True, True, True, True, False])
        lines += ["", f"({report.comparisons.adjustment}.)"]
    lines += ["", front_sentence(report), ""]
    lines += [f"- {s}" for s in saturation_lines(report)]
    sittings = sitting_lines(report.document)
    lines += ["", sittings[0], "", *(f"- {s}" for s in sittings[1:])] if sittings else []
    twins = twin_lines(report.document)
    lines += ["", *(f"- {s}" for s in twins)] if twins else []
    checks = server_check_lines(report)
    lines += ["", *checks] if checks else []
    for prompt, answers in answer_table(report):
        lines += ["", f"### {prompt}", ""]
        lines += [f"- **{name}**: {' '.join(answer.split())}" for name, answer in answers]
    return "\n".join(lines) + "\n"


def _html_table(table_id: str, head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return (
        f"<div style='overflow-x:auto'><table id='{table_id}'><thead><tr>{th}</tr></thead>"
        f"<tbody>{body}</tbody></table></div>"
    )


def _inline_bold(text: str) -> str:
    """The recommendation's **name** markup as <b>, the rest escaped."""
    parts = html.escape(text).split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


def html_tables(report: Report) -> str:
    items = "".join(f"<li>{_inline_bold(s)}</li>" for s in report.recommendation.sentences)
    parts = [f"<section id='recommendation'><h2>Recommendation</h2><ul>{items}</ul></section>"]
    if report.problems:
        found = "".join(f"<li>{html.escape(p)}</li>" for p in report.problems)
        parts.append(f"<section id='problems'><h2>Problems</h2><ul>{found}</ul></section>")
    for group, title, cols in grouped_tables(report):
        rows = [[cell(v.row, c) for c in cols] for v in report.variants]
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(_html_table(group, [c.label for c in cols], rows))
    paired = comparison_rows(report)
    if paired:
        parts.append(f"<h2>Paired against {html.escape(report.comparisons.reference or '')}</h2>")
        parts.append(_html_table("paired", COMPARISON_HEAD, paired))
        parts.append(f"<p>{html.escape(report.comparisons.adjustment)}.</p>")
    parts.append(f"<p id='front'>{html.escape(front_sentence(report))}</p>")
    sittings = sitting_lines(report.document)
    if sittings:
        items = "".join(f"<li>{html.escape(s)}</li>" for s in sittings[1:])
        parts.append(f"<p id='sittings'>{html.escape(sittings[0])}</p><ul>{items}</ul>")
    twins = "".join(f"<li>{html.escape(s)}</li>" for s in twin_lines(report.document))
    if twins:
        parts.append(f"<ul id='twins'>{twins}</ul>")
    return "".join(parts) + html_answers(report)


def html_answers(report: Report) -> str:
    """Greedy chat answers side by side: one row per prompt, one column per variant."""
    rows = answer_table(report)
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(n)}</th>" for n, _ in rows[0][1])
    body = "".join(
        f"<tr><td>{html.escape(p)}</td>"
        + "".join(f"<td class='answer'>{html.escape(a)}</td>" for _, a in answers)
        + "</tr>"
        for p, answers in rows
    )
    return (
        "<h2>Greedy chat answers</h2><div style='overflow-x:auto'><table id='answers'>"
        f"<thead><tr><th>prompt</th>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )
