"""The README and docs/ stay inside the repository: every relative link resolves to a file here, none climbs
out of it, and the README stays a user's page (its run logs live in docs/benchmark-log.md)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MAX_LINES = 350


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_resolve_inside_the_repository():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if ROOT not in path.parents or not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_readme_is_short_and_points_to_the_docs():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for doc in ("architecture.md", "benchmarks.md", "benchmark-log.md", "serving.md", "openai-api.md"):
        assert f"docs/{doc}" in text
