"""A bare clone is enough: no code, test or benchmark reads the sibling folder `../shared`, and every
`dsv4-model.md §X` citation names a section that docs/dsv4-model.md has.

Both are text scans of tests/, bench/, dsv4serve/ and kernels/ (the spec they check against is the
heading list of docs/dsv4-model.md), so a moved file or a renumbered section fails here, not in a clone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTES = REPO / "docs" / "dsv4-model.md"
SCANNED_DIRS = ("tests", "bench", "dsv4serve", "kernels")
BINARY_SUFFIXES = {".gz", ".pyc", ".so", ".safetensors", ".pt", ".bin", ".png", ".jpg", ".cubin", ".ptx"}
# bench/RESULTS.md is a dated log: the commands in it are recorded as they were run, not read by anything.
EXEMPT = {Path(__file__).resolve(), REPO / "bench" / "RESULTS.md"}

# ../shared, shared/data, shared/docs as text, and the same folder built with pathlib ("shared" / "data")
SIBLING = re.compile(r"\.\./shared\b|\bshared/(?:data|docs)\b|[\"']shared[\"']\s*/\s*[\"'](?:data|docs)[\"']")
# a citation: the file name, then one or more sections: §2.5 / §2.3, §2.6 / §2.2-2.7 / §3.3-§3.4
CITATION = re.compile(r"dsv4-model\.md(?P<refs>(?:[\s,]*(?:and\s+)?§\d+(?:\.\d+)*(?:\s*[-–]\s*§?\d+(?:\.\d+)*)?)*)")
SECTION_REF = re.compile(r"§(\d+(?:\.\d+)*)(?:\s*[-–]\s*§?(\d+(?:\.\d+)*))?")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)


def scanned_files() -> list[Path]:
    """Every text file under the scanned folders, skipping caches and hidden folders."""
    files = []
    for top in SCANNED_DIRS:
        for path in sorted((REPO / top).rglob("*")):
            parts = path.relative_to(REPO).parts
            if not path.is_file() or path.resolve() in EXEMPT or path.suffix in BINARY_SUFFIXES:
                continue
            if any(p == "__pycache__" or p.startswith(".") for p in parts):
                continue
            files.append(path)
    return files


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None  # a binary file without a known suffix: it cannot name a folder either


def sibling_references(text: str) -> list[str]:
    """The lines of `text` that point at the sibling folder `../shared` (its data or docs)."""
    return [line.strip() for line in text.splitlines() if SIBLING.search(line)]


def cited_sections(refs: str) -> list[str]:
    """'§2.2-2.7' -> 2.2 .. 2.7; '§2.3, §2.6' -> 2.3, 2.6; '§3' -> 3."""
    sections = []
    for first, last in SECTION_REF.findall(refs):
        if not last:
            sections.append(first)
            continue
        head, _, lo = first.rpartition(".")
        head_last, _, hi = last.rpartition(".")
        assert head == head_last, f"a range across sections: §{first}-{last}"
        sections += [f"{head}.{n}" if head else str(n) for n in range(int(lo), int(hi) + 1)]
    return sections


def note_sections() -> set[str]:
    return set(HEADING.findall(NOTES.read_text(encoding="utf-8")))


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ('REAL = Path(__file__).resolve().parents[3] / "shared/data/DeepSeek-V4-Flash/config.json"', True),
        ('default = REPO.parent / "shared" / "data" / "DeepSeek-V4-Flash"', True),
        ("#   cp ../shared/data/DeepSeek-V4-Flash/config.json .gpu/", True),
        ("see /work/shared/docs/dsv4-model.md", True),
        ("one shared expert; K = V is a single head shared by all heads", False),
        ('assert result["shared"] <= SHARED_PER_BLOCK[arch]', False),
        ("REAL_MODEL = REPO / 'tests' / 'data' / 'DeepSeek-V4-Flash'", False),
    ],
)
def test_the_scan_finds_the_forms_a_sibling_path_takes(line, flagged):
    """The detector itself, on the forms the tree used before its data moved into tests/data."""
    assert bool(sibling_references(line)) == flagged


def test_no_file_reads_the_sibling_shared_folder():
    offenders = {}
    for path in scanned_files():
        text = read_text(path)
        if text and (lines := sibling_references(text)):
            offenders[str(path.relative_to(REPO))] = lines
    assert not offenders, f"these read ../shared, which a clone does not have (use tests/data, docs/): {offenders}"


def test_the_section_parser_reads_ranges_and_lists():
    refs = CITATION.search("(dsv4-model.md §2.2-2.7; §9 elsewhere)").group("refs")
    assert cited_sections(refs) == ["2.2", "2.3", "2.4", "2.5", "2.6", "2.7"]
    refs = CITATION.search("dsv4-model.md\n§2.3, §2.6) on the paged").group("refs")
    assert cited_sections(refs) == ["2.3", "2.6"]
    assert cited_sections(CITATION.search("dsv4-model.md §3.3-§3.4:").group("refs")) == ["3.3", "3.4"]
    assert CITATION.search("dsv4-model.md, step 6").group("refs") == ""


def test_every_citation_of_the_model_notes_names_an_existing_section():
    sections = note_sections()
    assert {"1", "2.0", "2.5", "2.12", "3.2", "3.5", "4.2", "8"} <= sections  # the heading scan works
    citations, missing, unnumbered = 0, [], []
    for path in scanned_files():
        text = read_text(path) or ""
        for match in CITATION.finditer(text):
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}"
            cited = cited_sections(match.group("refs"))
            if not cited:
                unnumbered.append(where)
            missing += [f"{where} §{s}" for s in cited if s not in sections]
            citations += 1
    assert citations >= 20, f"only {citations} citations found: is the scan still reading the tree?"
    assert not unnumbered, f"cite a section (dsv4-model.md §N.M), not the whole file: {unnumbered}"
    assert not missing, f"sections that docs/dsv4-model.md does not have: {missing}"


def test_relative_links_to_the_model_notes_resolve():
    """A README beside the data links to the notes by a relative path; it must land on docs/."""
    links = 0
    for path in scanned_files():
        for rel in re.findall(r"((?:\.\./)+docs/dsv4-model\.md)", read_text(path) or ""):
            assert (path.parent / rel).resolve() == NOTES.resolve(), f"{path.relative_to(REPO)}: {rel}"
            links += 1
    assert links >= 1
