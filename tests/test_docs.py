"""The documentation holds together: the README stays a page a newcomer reads in minutes and
points to a page under docs/ for every topic, and no link between the pages, no image and no
anchor is broken (the topics moved out of the README once; a link into a section that moved
would otherwise fail silently on GitHub)."""

from __future__ import annotations

import re

from conftest import REPO

README_MAX_LINES = 300
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def doc_files() -> list:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            REPO / "bench" / "results" / "README.md"]


def anchors(path) -> set:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces
    as hyphens. Lines inside code fences are not headings."""
    found, in_fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def broken_links(path, root=REPO) -> list:
    """Each relative link or image of a markdown file whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return broken


def test_the_readme_is_short_starts_with_its_two_commands_and_links_every_docs_page():
    """A newcomer's page: at most 300 lines, the first code block installs and runs the main job
    and then installs and runs the tests, and every topic's page under docs/ is linked."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, \
        f"README.md has {len(text.splitlines())} lines: move a topic to a page under docs/"
    first_block = text.split("```", 2)[1]
    assert "pip install -r requirements.txt && torchrun --nproc-per-node 2 ddp_train.py" \
        in first_block
    assert "pip install -r requirements-test.txt && python -m pytest" in first_block
    linked = {t.partition("#")[0] for t in LINK.findall(text)}
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md"))
                if f"docs/{p.name}" not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_link_image_and_anchor_in_the_docs_resolves():
    problems = [b for path in doc_files() for b in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_a_broken_anchor_is_found(tmp_path):
    """The checker itself: a heading inside a code fence is no anchor, a missing file is named."""
    page = tmp_path / "page.md"
    page.write_text("# A title: `--flag`\n\n```\n# not a heading\n```\n"
                    "[ok](#a-title---flag) [bad](#not-a-heading) [gone](other.md)\n")
    assert anchors(page) == {"a-title---flag"}
    assert broken_links(page, tmp_path) == ["page.md: #not-a-heading (no such heading)",
                                            "page.md: other.md (no such file)"]
