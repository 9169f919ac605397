"""Each measured figure in one place: docs/benchmarks.md.

Other docs say what a figure means and link to its section of benchmarks.md; they do
not paste benchmark output or quote its numbers. These tests catch the worst
regressions of that rule (a bench's output pasted elsewhere, a scrape's size quoted
again) and check that every link into benchmarks.md names a heading it has.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BENCHMARKS = DOCS / "benchmarks.md"

# Every Markdown file a reader is sent to, except benchmarks.md itself.
OTHER_DOCS = [p for p in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))] if p != BENCHMARKS]
# docs/dev/architecture.md has its own editor; it is still checked for its links.
FIGURE_CHECKED = [p for p in OTHER_DOCS if p != DOCS / "dev" / "architecture.md"]

# What benchmark figures look like when pasted outside benchmarks.md.
FIGURE_PATTERNS: dict[str, re.Pattern[str]] = {
    # bench.scale / bench.monitoring / bench.dashboard's unit
    "CPU s per 1,000 records": re.compile(r"CPU s(?:econds)? per 1,000", re.IGNORECASE),
    # a scrape's size
    "MB of text": re.compile(r"\d\s*(?:MB|MiB|kB|KiB) of text"),
    # "ratio open/unwatched 1.04", "ratio 1.11"
    "a ratio with its value": re.compile(r"\bratios?\b[^.\n|`]{0,30}?\b\d+\.\d+"),
    # a bench's machine-readable last line: "dashboard_cpu_ratio=1.11", "view_ms=49.5"
    "a bench's last-line key=value": re.compile(
        r"\b[a-z][a-z0-9_]*(?:_ratio|_per_s|_us|_ns|_ms|_pct|_vs_[a-z_]+)=-?\d"
    ),
    # a bench's timing table row: "frames.load (typed + phases)   4.16 s"
    "a bench's timing row": re.compile(r"^\S.*\S {3,}\d+(?:\.\d+)? s$", re.MULTILINE),
    # "(~2 µs each", "~40 ns": a measured cost quoted in passing
    "an approximate cost in µs or ns": re.compile(r"~\s?\d+(?:\.\d+)?\s?(?:µs|us|ns)\b"),
}

LINK_TO_BENCHMARKS = re.compile(r"\]\((?:[./]*docs/|\.\./|\./)?benchmarks\.md#([^)\s]+)\)")
LINK_INSIDE = re.compile(r"\]\(#([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _outside_fences(text: str) -> list[str]:
    """The lines of a Markdown file that are not inside a fenced code block."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to '-'."""
    slug = heading.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _outside_fences(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def figures_in(text: str) -> list[tuple[str, str]]:
    """(pattern name, matched text) for each benchmark-style figure in ``text``."""
    found = []
    for name, pattern in FIGURE_PATTERNS.items():
        found += [(name, m.group(0)) for m in pattern.finditer(text)]
    return found


def test_anchor_rule() -> None:
    assert (
        github_anchor("Live views — `python -m bench.monitoring`, `python -m bench.dashboard`")
        == "live-views--python--m-benchmonitoring-python--m-benchdashboard"
    )
    assert github_anchor("What one scrape and one OTLP export cost") == (
        "what-one-scrape-and-one-otlp-export-cost"
    )
    assert github_anchor("On a GPU — `python -m traceml_ai run x/gpu_step_costs.py`") == (
        "on-a-gpu--python--m-traceml_ai-run-xgpu_step_costspy"
    )


def test_the_patterns_catch_pasted_bench_output() -> None:
    pasted = (
        "round 1: CPU s per 1,000 records: dashboard off 0.0525; ratio open/unwatched 1.04\n"
        "dashboard_cpu_ratio=1.11 view_ms=49.5 dropped_batches=0\n"
        "frames.load (typed + phases)           4.16 s\n"
        "At 1,024 ranks one scrape is about 7 MB of text.\n"
        "a profiler context (~2 µs each)\n"
    )
    names = {name for name, _ in figures_in(pasted)}
    assert names == set(FIGURE_PATTERNS), names
    # Rules and formats are not figures.
    assert not figures_in(
        "at most about 5 % of one core; `traceml_system_cpu_ratio`; "
        "prints `paired_overhead_us=<x> step_us=<z>`; bounded to 450 s"
    )


@pytest.mark.parametrize("path", FIGURE_CHECKED, ids=lambda p: str(p.relative_to(REPO)))
def test_no_benchmark_figures_outside_benchmarks_md(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = figures_in(text)
    assert not found, (
        f"{path.relative_to(REPO)} quotes benchmark figures {found}: keep them in "
        "docs/benchmarks.md and link to its section instead"
    )


def test_the_scrape_figure_is_in_benchmarks_md() -> None:
    # The figure the other docs link to is still where they send the reader.
    text = BENCHMARKS.read_text(encoding="utf-8")
    assert figures_in(text), "benchmarks.md holds no figure: did the patterns break?"
    assert re.search(r"\d series, [\d.]+ MB \(\d+ kB gzipped\)", text)
    assert "what-one-scrape-and-one-otlp-export-cost" in anchors(BENCHMARKS)


def test_every_link_into_benchmarks_md_names_a_heading() -> None:
    known = anchors(BENCHMARKS)
    links: list[tuple[str, str]] = []
    for path in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        pattern = LINK_INSIDE if path == BENCHMARKS else LINK_TO_BENCHMARKS
        links += [(str(path.relative_to(REPO)), m.group(1)) for m in pattern.finditer(text)]
    assert links, "no link into benchmarks.md found: did the link pattern break?"
    broken = [(where, a) for where, a in links if a not in known]
    assert not broken, f"links to headings benchmarks.md does not have: {broken}"


def test_every_anchor_link_between_docs_names_a_heading() -> None:
    # The same rule for every "file.md#anchor" and "#anchor" link of the docs.
    link = re.compile(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)")
    broken = []
    for path in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for m in link.finditer(path.read_text(encoding="utf-8")):
            target = (path.parent / m.group(1)).resolve() if m.group(1) else path
            if not target.exists() or m.group(2) not in anchors(target):
                broken.append((str(path.relative_to(REPO)), m.group(0)))
    assert not broken, f"links to headings that do not exist: {broken}"
