"""Plain-text rendering for the terminal: findings with the fix, the summary table, what the counts mean."""

from __future__ import annotations

from collections.abc import Sequence

from ..causes.common import names, note_for
from ..flowmap import Finding, FlowMap

LABEL_WIDTH = 23


def summary_table(fm: FlowMap, variants: Sequence[str] | None = None) -> str:
    """One row per scenario, one column per variant: reached/trainable, or the run's error."""
    variants = list(variants or fm.variant_names)
    label_width = max(LABEL_WIDTH, *(len(s) + 2 for s in fm.scenario_names))
    columns = [[_cell_text(fm, v, s) for s in fm.scenario_names] for v in variants]
    widths = [max(len(v), *(len(c) for c in col)) + 3 for v, col in zip(variants, columns, strict=True)]
    lines = [" " * label_width + "".join(v.ljust(w) for v, w in zip(variants, widths, strict=True)).rstrip()]
    for i, s in enumerate(fm.scenario_names):
        row = f"{s}:".ljust(label_width)
        row += "".join(col[i].ljust(w) for col, w in zip(columns, widths, strict=True))
        lines.append(row.rstrip())
    return "\n".join(lines)


def _cell_text(fm: FlowMap, variant: str, scenario: str) -> str:
    run = fm.run(variant, scenario)
    if run.error is not None:
        return "no grad path" if run.error.type == "NoGradPath" else f"error: {run.error.type}"
    reached, total = fm.count(variant, scenario)
    return f"{reached}/{total}"


def meaning_lines(fm: FlowMap, variant: str | None = None) -> list[str]:
    """Per scenario, which parameters the reference variant does not reach, and why when a note says so."""
    variant = variant or fm.variant_names[0]
    lines = []
    for s in fm.scenario_names:
        run = fm.run(variant, s)
        if run.error is not None:
            lines.append(f"{s}: failed at {run.error.stage}: {run.error.message}")
            continue
        reached = fm.reached(variant, s)
        missing = [p for p in fm.trainable if p not in reached]
        if not missing:
            lines.append(f"{s}: every trainable parameter gets a non-zero gradient")
            continue
        by_note: dict[str, list[str]] = {}
        for p in missing:
            by_note.setdefault(note_for(p, fm.notes) or "", []).append(p)
        parts = [f"{names(ps)} ({note})" if note else names(ps) for note, ps in by_note.items()]
        lines.append(f"{s}: {len(missing)} not reached: " + "; ".join(parts))
    return lines


def finding_lines(finding: Finding) -> list[str]:
    lines = [f"{finding.severity.upper()} {finding.cause}: {finding.message}"]
    if finding.fix:
        lines.append(f"  fix: {finding.fix}")
    return lines


def verdict(fm: FlowMap) -> str:
    counts = {sev: sum(f.severity == sev for f in fm.findings) for sev in ("error", "warning", "info")}
    if counts["error"]:
        head = f"PROBLEM: {counts['error']} error(s)"
    elif counts["warning"]:
        head = f"check: {counts['warning']} warning(s)"
    else:
        head = "OK: no problem found"
    extra = [f"{n} {sev}" for sev, n in counts.items() if n and not (sev == "error" and counts["error"])]
    return head + (f" ({', '.join(extra)})" if extra and not head.startswith("check") else "")


def render(fm: FlowMap) -> str:
    """The whole terminal report: verdict and serious findings first, then the table, then details."""
    serious = [f for f in fm.findings if f.severity != "info"]
    info = [f for f in fm.findings if f.severity == "info"]
    out = [f"gradprobe: {verdict(fm)}", ""]
    for f in serious:
        out.extend(finding_lines(f))
    if serious:
        out.append("")
    out.append(f"parameters reached per scenario (non-zero gradient / trainable), {fm.device} {fm.dtype}:")
    out.append(summary_table(fm))
    out.append("")
    out.extend(meaning_lines(fm))
    if info:
        out.append("")
        for f in info:
            out.extend(finding_lines(f))
    return "\n".join(out) + "\n"
