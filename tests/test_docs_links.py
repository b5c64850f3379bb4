"""README.md and docs/ link to what exists: every relative link's file (and its #anchor, where it
names a heading of a markdown page), and every raw result under docs/results/ is linked from a
page, so a result moved or renamed without its page, or a heading reworded under a link, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    a repeated id numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", m.group(1)).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path, images: bool = False) -> list:
    """The link targets of a page; with `images`, (is it an image, target) pairs."""
    found = [(m.group(0).startswith("!"), m.group(1)) for m in LINK.finditer(FENCE.sub("", page.read_text()))]
    return found if images else [t for _, t in found]


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        raw = DOCS / "results" in page.parents
        for image, target in links(page, images=True):
            if re.match(r"[a-z]+:", target) or (raw and image):
                continue  # http(s) not checked offline; a raw report's plot is stored for some runs only
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_raw_result_is_linked_from_a_page():
    linked = {(page.parent / t.partition("#")[0]).resolve() for page in PAGES for t in links(page)}
    results = [f for f in (DOCS / "results").rglob("*") if f.is_file()]
    assert results, "docs/results/ holds the raw results"
    unlinked = [str(f.relative_to(ROOT)) for f in results if f.resolve() not in linked]
    assert not unlinked, f"raw results no page links: {unlinked}"
    named = re.compile(r"\d{4}-\d\d-\d\d-(?:[a-z]\d{3}(?:x\d+)?|cpu|sim)-")
    assert not [f.name for f in results if not named.match(f.name)], "raw results are named DATE-CARD-..."
