"""The short Markdown summary: a table and the verdict, to paste into a pull request or an issue.

Nothing in it depends on the machine that renders it or on the time it is rendered: only on the
results files (so a fixed fixture gives a fixed text).
"""

from __future__ import annotations

import re

from loadopt.report.data import Results, Run, common_labels, stored_size

# Only what a renderer would read as markup is escaped: a `<` that opens a tag, comment or autolink and an `&`
# that opens an entity. A verdict's "<= 512 px" stays readable in the raw text, as typed.
_OPENS_MARKUP = re.compile(r"&(?=#?\w+;)|<(?=[A-Za-z/!?])")


def _cell(text: str) -> str:
    """Text from the results (a config's name, a label, a reason) as literal Markdown: a renderer that accepts
    inline HTML (GitHub's, mkdocs') must show `<b>` as typed, and a `|` must not end a table cell."""
    text = _OPENS_MARKUP.sub(lambda m: "&amp;" if m.group() == "&" else "&lt;", text).replace("`", "&#96;")
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """A code span of `text`, which stays literal there but for a backtick, which would close it."""
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", " ") + "`"


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _ceiling(run: Run) -> str:
    return _cell(run.ceiling_cell())


def _header(res: Results) -> list[str]:
    lines = [f"### {_cell(res.title)}", ""]
    detail = " · ".join(p for p in (res.machine_line(), res.workload_line()) if p)
    if detail:
        lines += [detail, ""]
    if busy := res.busy_note():
        lines += [f"**Busy machine:** {_cell(busy)}", ""]
    if sources := res.bytes_sources():
        lines += [f"**Bytes from:** {_cell(sources)}", ""]
    return lines


def _ranking(res: Results) -> list[str]:
    ranked = res.ranked
    key, unit = res.rate_unit()
    ceilings = any(r.ceiling_fraction() is not None or r.ceiling_unreliable() for r in ranked)
    head = ["#", "loader setting", unit, "vs best", "stall", "wait p99 (ms)"] + (["of ceiling"] if ceilings else [])
    align = ["---:", "---", "---:", "---:", "---:", "---:"] + (["---"] if ceilings else [])
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    best = ranked[0].value(key) if ranked else None
    for rank, run in enumerate(ranked, start=1):
        rate = run.value(key)
        row = [str(rank), _code(run.label), _num(rate, ",.0f"),
               f"{rate / best:.2f}x" if rate is not None and best else "-",
               _num(run.value("stall_fraction"), ".1%"), _num(run.value("wait_p99_ms"), ",.1f")]
        lines.append("| " + " | ".join(row + ([_ceiling(run)] if ceilings else [])) + " |")
    if not ranked:
        lines = ["No loader setting was measured."]
    for run in res.unmeasured:
        lines.append(f"\nNot measured: {_code(run.label)} ({_cell(run.why_unmeasured())})")
    return lines


def _verdicts(res: Results) -> list[str]:
    lines = ["", f"**Decision:** {_cell(res.decision())}"]
    verdicts = res.verdicts()
    if verdicts:
        lines += ["", "**Bottlenecks:**"]
        lines += [f"- {f'{_code(label)}: ' if label else ''}{_cell(text)}" for label, text in verdicts]
    return lines


def _tiers(res: Results) -> list[str]:
    tiers = res.tiers()
    if not tiers:
        return []
    lines = ["", "**Storage tiers:**", "",
             "| tier | AU threshold | accelerators supported | dataset | delivered MB/s | samples/s | $/TB-month | "
             "$ per supported accelerator |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for tier in tiers:
        au = tier.get("au_threshold")
        lines.append(f"| {_cell(str(tier['name']))} | {_num(au, '.0%') if isinstance(au, (int, float)) else '-'} | "
                     f"{_num(_number(tier, 'accelerators_supported'), ',.0f')} | "
                     f"{stored_size(_number(tier, 'capacity_tb'))} | "
                     f"{_num(_number(tier, 'delivered_mb_s'), ',.1f')} | "
                     f"{_num(_number(tier, 'samples_per_s'), ',.0f')} | "
                     f"{_num(_number(tier, 'price_per_tb_month'), ',.2f')} | "
                     f"{_num(_number(tier, 'cost_per_supported_accelerator'), ',.2f')} |")
    return lines


def _number(tier: dict, key: str) -> float | None:
    value = tier.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def single(res: Results) -> str:
    return "\n".join(_header(res) + _ranking(res) + _verdicts(res) + _tiers(res)) + "\n"


def compare(files: list[Results]) -> str:
    """Side by side: each common loader setting's samples/s per file and its ratio to the first file."""
    base = files[0]
    names = " against ".join(_cell(f.tag) for f in files)
    lines = [f"### loadopt comparison: {names}", ""]
    lines += [f"- **{_cell(f.tag)}**: {_code(f.short_name)}: {_cell(f.title)}; {_cell(f.machine_line())}"
              for f in files]
    labels = common_labels(files)
    lines.append("")
    if labels:
        head = ["loader setting"] + [f"{f.tag} samples/s" for f in files] + [f"{f.tag}/{base.tag}" for f in files[1:]]
        lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
        for label in labels:
            rates = [next(r for r in f.ranked if r.label == label).value("samples_per_s") for f in files]
            ratios = [f"{rate / rates[0]:.2f}x" if rate is not None and rates[0] else "-" for rate in rates[1:]]
            lines.append("| " + " | ".join([_code(label)] + [_num(r, ",.0f") for r in rates] + ratios) + " |")
    else:
        lines.append("No loader setting was measured in every file.")
    for f in files:
        only = [r.label for r in f.ranked if r.label not in labels]
        if only:
            lines.append(f"\nOnly in {f.tag}: " + ", ".join(_code(label) for label in only))
    for f in files:
        lines += ["", f"**Decision ({_cell(f.tag)}):** {_cell(f.decision())}"]
    return "\n".join(lines) + "\n"


def render(files: list[Results]) -> str:
    return single(files[0]) if len(files) == 1 else compare(files)
