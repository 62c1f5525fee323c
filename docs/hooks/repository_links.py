"""MkDocs hook: the guides' links to repository files outside ``docs/`` become pages and files of the site.

The guides link to ``../benchmarks/results/<m>.md``, ``../examples/...`` and other files of the repository, so
that the links work where the markdown is read (GitHub, an editor). MkDocs only knows ``docs/``: this hook adds
every repository file such a link reaches to the site under ``repository/<path>`` (markdown as pages, the rest as
static files, and, transitively, what those pages link to) and rewrites the links to point there. A link to a file
that does not exist is left as written, so MkDocs reports it and ``mkdocs build --strict`` fails, as it does for a
broken link inside ``docs/``.

The rewriting (:func:`rewrite_links`) is plain Python, tested in ``tests/test_docs.py`` without MkDocs.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

SITE_FOLDER = "repository"

# An inline link or image target: ](target "title") or ](target#anchor); not an absolute URL or a bare anchor.
_LINK = re.compile(r"(?P<open>\]\()(?P<target>[^)\s#]+)(?P<rest>[^)]*\))")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def site_path(repo_path: str, docs_folder: str) -> str:
    """Where a repository file (POSIX path relative to the root) lives in the site's source tree."""
    prefix = docs_folder.rstrip("/") + "/"
    return repo_path[len(prefix) :] if repo_path.startswith(prefix) else f"{SITE_FOLDER}/{repo_path}"


def _resolve(target: str, page_repo_path: str) -> str | None:
    """The repository path a relative link of a page points to, or None (URL, absolute, or above the root)."""
    if "://" in target or target.startswith(("/", "mailto:", "data:")):
        return None
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), target))
    return None if joined.startswith("..") else joined


def rewrite_links(markdown: str, page_repo_path: str, docs_folder: str, repo_root: Path) -> tuple[str, set[str]]:
    """Rewrite a page's links to existing repository files outside ``docs_folder`` to their place in the site.

    Args:
        markdown: the page's markdown.
        page_repo_path: the page's path relative to the repository root (``docs/heat.md``,
            ``benchmarks/results/heat_throughput.md``).
        docs_folder: the MkDocs ``docs_dir`` relative to the repository root (``docs``).
        repo_root: the repository root on disk.

    Returns:
        The rewritten markdown and the repository paths of the outside files it links to (links inside fenced code
        blocks are left alone; links to missing files are left as written and not returned).
    """
    page_site = site_path(page_repo_path, docs_folder)
    reached: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        target = _resolve(match["target"], page_repo_path)
        if target is None or not (repo_root / target).is_file():
            return match.group(0)
        target_site = site_path(target, docs_folder)
        if target_site.startswith(SITE_FOLDER + "/"):
            reached.add(target)
        relative = posixpath.relpath(target_site, posixpath.dirname(page_site) or ".")
        return f"{match['open']}{relative}{match['rest']}"

    lines, in_fence = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
        lines.append(line if in_fence or _FENCE.match(line) else _LINK.sub(replace, line))
    return "\n".join(lines), reached


def _repo_root_and_docs(config: Any) -> tuple[Path, str]:
    root = Path(config["config_file_path"]).resolve().parent
    return root, Path(config["docs_dir"]).resolve().relative_to(root).as_posix()


def _repo_path(file: Any, root: Path) -> str:
    return Path(file.abs_src_path).resolve().relative_to(root).as_posix()


def on_files(files: Any, config: Any) -> Any:
    """Add the repository files the pages link to (and what those link to) to the site."""
    from mkdocs.structure.files import File

    root, docs_folder = _repo_root_and_docs(config)
    pending = [_repo_path(f, root) for f in files.documentation_pages()]
    seen: set[str] = set(pending)
    while pending:
        page = pending.pop()
        _, reached = rewrite_links((root / page).read_text(encoding="utf-8"), page, docs_folder, root)
        for target in sorted(reached - seen):
            seen.add(target)
            files.append(File.generated(config, site_path(target, docs_folder), abs_src_path=str(root / target)))
            if target.endswith(".md"):
                pending.append(target)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Point the page's links to outside files at their copies in the site."""
    root, docs_folder = _repo_root_and_docs(config)
    rewritten, _ = rewrite_links(markdown, _repo_path(page.file, root), docs_folder, root)
    return rewritten
