"""Every relative link in the project's Markdown (README, docs, bench and the rest) names a file that
exists, and every `#anchor` in one names a heading of the page it points to, as GitHub renders it:
the README and docs are read by following their links, and a page moved or a heading renamed must
not leave them pointing nowhere."""
import re
from pathlib import Path

import pytest

from helpers import REPO_ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"#{1,6} (.*)")
FENCE = re.compile(r"```.*?```", re.S)


def markdown_files() -> list[Path]:
    """The project's own pages: every .md below the root outside hidden folders (.venv, .models, .run)."""
    return sorted(p for p in REPO_ROOT.rglob("*.md")
                  if not any(part.startswith(".") for part in p.relative_to(REPO_ROOT).parts))


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub gives the page's headings (a repeated heading's copies get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = HEADING.match(line)
        if match:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https://, mailto: -- not checked offline
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    return broken


def test_the_anchor_rule_matches_githubs():
    assert github_anchor("Side by side: Prism, vLLM, llama.cpp, Hugging Face") == \
        "side-by-side-prism-vllm-llamacpp-hugging-face"
    assert github_anchor("Interface: the ensemble model `prism`") == "interface-the-ensemble-model-prism"
    assert github_anchor("Startup and recovery from a killed stub (int8 default)") == \
        "startup-and-recovery-from-a-killed-stub-int8-default"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# A heading\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading) [gone](missing.md) [bad](other.md#nothing) "
                    "[web](https://example.com/x.md)\n```\n[in code](nowhere.md)\n```\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nothing: no heading with that anchor"]


def test_the_readme_and_docs_are_among_the_pages():
    names = {p.relative_to(REPO_ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/results.md", "bench/README.md"} <= names


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []
