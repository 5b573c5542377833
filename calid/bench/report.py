"""Benchmark tables: printed, and written as JSON and Markdown side by side."""
from __future__ import annotations

import json
from pathlib import Path


def parse_numbers(text: str, kind=float) -> list:
    """'0.4,0.7' -> [0.4, 0.7] for a CLI option; a clear error otherwise."""
    from calid.errors import CalidError

    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CalidError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out_dir: Path, name: str, title: str, meta: dict, rows: list[dict], columns: list[str],
                 notes: list[str]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / f"{name}.json"
    md = out_dir / f"{name}.md"
    js.write_text(json.dumps({"title": title, "meta": meta, "rows": rows, "notes": notes}, indent=2) + "\n")
    body = [f"# {title}", ""] + [f"- {k}: {v}" for k, v in meta.items()] + ["", markdown_table(rows, columns), ""]
    body += [f"- {n}" for n in notes]
    md.write_text("\n".join(body) + "\n")
    return js, md


def resume_meta(meta_path: Path, meta: dict, resuming: bool, before: dict | None = None) -> None:
    """A resumable benchmark's settings: when ``resuming`` (results exist), those at ``meta_path`` must equal
    ``meta`` (else a CalidError names what changed); then ``meta`` is written there. ``before``: what results
    stored before a setting was recorded ran with (their meta lacks its key)."""
    from calid.errors import CalidError

    if resuming and meta_path.exists():
        old = {**(before or {}), **json.loads(meta_path.read_text())}
        changed = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if changed:
            raise CalidError(f"{meta_path.parent} holds results run with other settings {changed}; rerun with "
                             "--fresh (or another --out)")
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
