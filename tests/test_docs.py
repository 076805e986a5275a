"""The docs follow the code: README's module table lists every module, and every pointer into
docs/design.md names a section that exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).parent.parent
DESIGN = REPO / "docs" / "design.md"
# The docs site's other pages (README's content, reorganised), which point into the design doc too.
DOCS_PAGES = sorted(path for path in (REPO / "docs").rglob("*.md") if path != DESIGN)
# A pointer into the design doc, as code and README write it: docs/design.md "Section name".
SECTION_REFERENCE = re.compile(r'docs/design\.md,? "([^"]+)"')


def readme_section(title: str) -> str:
    """The README's ``## title`` section, up to the next level-2 heading."""
    readme = (REPO / "README.md").read_text()
    start = readme.index(f"\n## {title}\n")
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end >= 0 else len(readme)]


def module_table_rows() -> list[tuple[str, str]]:
    """(path, description) of every table row of README's architecture section whose first cell is a
    ``conveyor/...`` path."""
    rows = re.findall(r"^\| `(conveyor/[^`]+)` \| (.*) \|$", readme_section("Architecture"), flags=re.MULTILINE)
    assert rows, "README's architecture section has no module table"
    return rows


def design_headings() -> list[str]:
    return [line.lstrip("#").strip() for line in DESIGN.read_text().splitlines() if re.match(r"#{1,6} ", line)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def joined_lines(text: str) -> str:
    """``text`` with line breaks (and the comment marks that continue a comment) turned into spaces, so a
    pointer split over two lines reads as one."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#|//)?[ \t]*", " ", text)


def pointing_files() -> list[Path]:
    """The files that may point into docs/design.md (this one, which spells out the patterns, aside)."""
    files = [REPO / "README.md", *(REPO / "conveyor").rglob("*.py"), *(REPO / "conveyor").rglob("*.proto"),
             *(REPO / "benchmarks").rglob("*.py"), *(REPO / "tests").rglob("*.py"), *DOCS_PAGES]
    return [path for path in files if path != Path(__file__)]


def test_module_table_paths_exist_and_are_listed_once():
    paths = [path for path, _ in module_table_rows()]
    missing = [path for path in paths if not (REPO / path).is_file()]
    assert not missing, f"README's module table lists files that do not exist: {missing}"
    repeated = sorted({path for path in paths if paths.count(path) > 1})
    assert not repeated, f"README's module table lists these more than once: {repeated}"
    blank = [path for path, description in module_table_rows() if not description.strip()]
    assert not blank, f"README's module table says nothing about: {blank}"


def test_every_module_is_in_the_module_table():
    listed = {path for path, _ in module_table_rows()}
    modules = {
        path.relative_to(REPO).as_posix() for path in (REPO / "conveyor").rglob("*.py")
        if path.name != "__init__.py" and not path.name.startswith("seed_pb2")
    }
    unlisted = sorted(modules - listed)
    assert not unlisted, f"add a row for each to README's module table (## Architecture): {unlisted}"


def test_design_doc_references_name_existing_sections():
    headings = set(design_headings())
    found, broken = 0, []
    for source in pointing_files():
        text = joined_lines(source.read_text())
        for section in SECTION_REFERENCE.findall(text):
            found += 1
            if section not in headings:
                broken.append(f"{source.relative_to(REPO)}: {section!r}")
        if source.suffix != ".md" and text.count("docs/design.md") != len(SECTION_REFERENCE.findall(text)):
            broken.append(f"{source.relative_to(REPO)}: a docs/design.md pointer without a \"Section name\"")
    assert found, "no pointers into docs/design.md found: the pattern is out of date"
    assert not broken, f"pointers into docs/design.md name no section of it: {broken}"


def test_no_pointer_to_the_old_design_file():
    old_name = "DESIGN.md"
    stale = [str(source.relative_to(REPO)) for source in pointing_files() if old_name in source.read_text()]
    assert not stale, f"{old_name} is not in the repository; point to docs/design.md \"Section\" instead: {stale}"


def test_links_to_design_doc_anchors_resolve():
    anchors = {anchor(heading) for heading in design_headings()}
    links = re.findall(r"\(docs/design\.md#([^)]+)\)", (REPO / "README.md").read_text())
    links += [link for page in DOCS_PAGES for link in re.findall(r"\((?:\.\./)*design\.md#([^)]+)\)", page.read_text())]
    links += re.findall(r"\]\(#([^)]+)\)", DESIGN.read_text())
    assert links
    dangling = sorted(set(links) - anchors)
    assert not dangling, f"links to headings docs/design.md does not have: {dangling}"
