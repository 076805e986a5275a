"""MkDocs hooks: pages that include Markdown files kept outside ``docs/`` (README.md, BENCHMARKS.md), and the
images outside ``docs/`` that pages show.

A page says ``<!-- include: PATH -->`` (the whole file) or ``<!-- include: PATH "## Heading" -->`` (the
body of that section: what follows the heading, up to the next heading of its level or above), PATH relative
to the page. The comment is invisible where GitHub renders the page; the site gets the text, with its relative
links rewritten to work from the including page: a link into ``docs/`` becomes that page, a link to a file
that has a page of its own (``PAGE_OF``) becomes that page, and an image outside ``docs/`` is copied into the
site under its repository path. A page's own links get the same treatment, so a page may link to
``../BENCHMARKS.md`` (which GitHub shows) and the site links to its page (reproduce.md). So README's module table,
BENCHMARKS.md and docs/design.md's pictures exist once, in their files.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
INCLUDE = re.compile(r'^<!-- include: (?P<path>\S+)(?: "(?P<heading>[^"]+)")? -->$', re.MULTILINE)
# A Markdown link or image whose target is relative: ](target) or ](target "title").
LINK = re.compile(r'(!?\[[^\]]*\])\(([^)\s#]*)(#[^)\s]*)?((?: "[^"]*")?)\)')
IMAGE = re.compile(r'!\[[^\]]*\]\(([^)\s#]+)')
# Repository files that are pages of the site under another name.
PAGE_OF = {"README.md": "index.md", "BENCHMARKS.md": "reproduce.md"}
# Files whose images outside docs/ the site copies (benchmarks/results/**/*.png), relative to the repository.
IMAGE_SOURCES = ("docs/benchmarks-log.md", "BENCHMARKS.md")


def _section(text: str, heading: str, source: Path) -> str:
    """The body of the section of ``text`` under the line ``heading`` (e.g. ``## Architecture``), outside code:
    what follows the heading, up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines, start, fenced = text.splitlines(keepends=True), None, False
    for number, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        if start is None and line.rstrip("\n") == heading:
            start = number
        elif start is not None and re.match(rf"#{{1,{level}}} ", line):
            return "".join(lines[start + 1 : number])
    if start is None:
        raise ValueError(f"{source.relative_to(REPO)} has no heading {heading!r}")
    return "".join(lines[start + 1 :])


def _rebase(text: str, source: Path, page_dir: str) -> str:
    """``text`` from repository file ``source``, its relative links rewritten for a page in ``page_dir``
    (relative to docs/)."""

    def target(match: re.Match) -> str:
        label, path, anchor, title = match.group(1), match.group(2), match.group(3) or "", match.group(4)
        if re.match(r"[a-z][a-z0-9+.-]*:", path) or path.startswith("/"):
            return match.group(0)  # a URL
        resolved = (source.parent / path).resolve() if path else source
        repo_path = resolved.relative_to(REPO).as_posix()
        if resolved.is_relative_to(DOCS):
            docs_path = resolved.relative_to(DOCS).as_posix()
        else:
            docs_path = PAGE_OF.get(repo_path, repo_path)  # images: copied to their repository path (on_files)
        link = posixpath.relpath(docs_path, page_dir or ".")
        return f"{label}({link}{anchor}{title})"

    fenced, out = False, []
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        out.append(line if fenced else LINK.sub(target, line))
    return "".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    page_file = DOCS / page.file.src_uri
    page_dir = posixpath.dirname(page.file.src_uri)

    def include(match: re.Match) -> str:
        source = (page_file.parent / match.group("path")).resolve()
        text = source.read_text()
        if match.group("heading"):
            text = _section(text, match.group("heading"), source)
        return _rebase(text, source, page_dir)

    # The page's own links first (a link to ../BENCHMARKS.md works on GitHub; here it becomes reproduce.md),
    # then the included text, rebased from its own file.
    return INCLUDE.sub(include, _rebase(markdown, page_file, page_dir))


def on_files(files: Files, config) -> Files:
    """Copy the images outside docs/ that the files of ``IMAGE_SOURCES`` show into the site, at their repository
    paths."""
    for name in IMAGE_SOURCES:
        source = REPO / name
        for link in dict.fromkeys(IMAGE.findall(source.read_text())):
            image = (source.parent / link).resolve()
            if not image.is_file() or image.is_relative_to(DOCS):
                continue
            path = image.relative_to(REPO).as_posix()
            if files.get_file_from_path(path) is None:
                files.append(File(path, src_dir=str(REPO), dest_dir=config["site_dir"],
                                  use_directory_urls=config["use_directory_urls"]))
    return files
