"""Every repository path named in the docs (README.md, docs/*.md) and in the code's docstrings, comments and
strings (fairseq_tnn/, benchmarks/, scripts/, tests/) exists: a file moved or renamed without its mentions
fails here, naming each stale mention by file and line.

A path is a word starting with one of the repository's top-level directories (`fairseq_tnn/`, `tests/`,
`scripts/`, `benchmarks/`, `docs/`, `configs/`, `data/`); a `::test_name` suffix, a `#anchor` and trailing
punctuation are dropped, `{a,b}` is expanded into each path, and `\\.` (a regex's escaped dot) reads as a dot.
It exists if it does relative to the repository root, or, for a mention inside tests/, relative to tests/
(where pytest node ids such as `scripts/test_docs.py::test_x` are written from). A glob (`*.py`) or a
placeholder (`configs/experiments/<preset>.yaml`) must match at least one file. The only exceptions are
NOT_IN_THE_REPOSITORY below: paths relative to an output directory, each with its reason. An anchor named
with its page (`docs/setup.md#tests`, or a Markdown link `[text](setup.md#tests)` in a page) must be one of
the page's headings as GitHub writes its anchor."""
import itertools
import re
from pathlib import Path

from helpers import ROOT

TOP = ("fairseq_tnn", "tests", "scripts", "benchmarks", "docs", "configs", "data")
# A top-level directory not preceded by a path character (so `$OUT/tests/x` and URLs do not count).
PATH = re.compile(rf"(?<![\w./$~-])((?:{'|'.join(TOP)})/[\w./*?<>{{}},:#-]*)")
TRAILING = ".,;:"

# Mentions that name a file an output directory holds, not the repository: (path, reason).
NOT_IN_THE_REPOSITORY = {
    "tests/junit.xml": "scripts/gpu_check.sh's tests part, relative to its report directory (results/gpu-check/)",
    "tests/pytest.log": "scripts/gpu_check.sh's tests part, relative to its report directory (results/gpu-check/)",
    "data/preprocess.log": "scripts/gpu_check.sh's data part, relative to its report directory (results/gpu-check/)",
    "data/my-corpus": "the text splits scripts/prepare-corpus.sh writes for docs/data.md's example input",
    "data/corpus": "the text splits scripts/prepare-corpus.sh writes for its header's example input",
    "data/wikitext-103/gpt2_bpe": "the GPT-2 BPE files scripts/prepare-wikitext-103.sh downloads",
}


def sources():
    """The files whose mentions are checked: the docs, and the text files of the code directories."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for top in ("fairseq_tnn", "benchmarks", "scripts", "tests"):
        files += [p for p in sorted((ROOT / top).rglob("*"))
                  if p.suffix in (".py", ".sh", ".sbatch", ".md") and "__pycache__" not in p.parts]
    return files


def expand_braces(path: str):
    """`a/{b,c}.py` -> [`a/b.py`, `a/c.py`] (every group; no nesting)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def mentions(text: str):
    """(line number, path as cleaned) for every repository path named in a text."""
    out = []
    for number, line in enumerate(text.replace("\\.", ".").splitlines(), 1):
        for match in PATH.finditer(line):
            path = re.split(r"[:#]", match.group(1))[0].rstrip(TRAILING)
            if "}" in path and "{" not in path:  # the end of a format string or a dict, not a path
                path = path[:path.index("}")]
            path = path.rstrip(TRAILING)
            out += [(number, p) for p in expand_braces(path)]
    return out


def exists(path: str, source: Path) -> bool:
    bases = [ROOT] + ([ROOT / "tests"] if source.is_relative_to(ROOT / "tests") else [])
    pattern = re.sub(r"<[^<>/]*>", "*", path)
    for base in bases:
        if any(c in pattern for c in "*?[") and any(base.glob(pattern.rstrip("/"))):
            return True
        if (base / pattern).exists():
            return True
    return False


def missing(text: str, source: Path):
    """'file:line: path' for every path a text names that is not there."""
    where = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
    return [f"{where}:{n}: {p}" for n, p in mentions(text) if p not in NOT_IN_THE_REPOSITORY and not exists(p, source)]


# A page of docs/ or README.md with an anchor, named anywhere; in a Markdown page, also [text](page.md#anchor)
PAGE_ANCHOR = re.compile(r"(?<![\w./$~-])((?:docs/[\w.-]+|README)\.md)#([\w-]+)")
LINK_ANCHOR = re.compile(r"\]\(([^()\s#:]*)#([\w-]+)\)")


def heading_anchors(page: Path) -> set:
    """The anchors GitHub gives a Markdown page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # a `# comment` in a code block is no heading
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def missing_anchors(text: str, source: Path):
    """'file:line: page#anchor' for every anchor a text names that its page (an existing .md file) has no heading for."""
    named = set()
    for number, line in enumerate(text.splitlines(), 1):
        named |= {(number, ROOT / page, anchor) for page, anchor in PAGE_ANCHOR.findall(line)}
        if source.suffix == ".md":
            named |= {(number, (source.parent / page).resolve() if page else source, anchor)
                      for page, anchor in LINK_ANCHOR.findall(line)}
    where = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
    return [f"{where}:{n}: {page.relative_to(ROOT)}#{anchor}" for n, page, anchor in sorted(named)
            if page.suffix == ".md" and page.is_file() and anchor not in heading_anchors(page)]


def test_every_named_path_exists():
    files = sources()
    assert len(files) > 80 and ROOT / "README.md" in files and ROOT / "fairseq_tnn" / "ops" / "ski.py" in files
    found = sum(len(mentions(f.read_text())) for f in files)
    assert found > 300, found  # the scan sees the paths (a regex that matched nothing would pass trivially)
    broken = [m for f in files for m in missing(f.read_text(), f)]
    assert not broken, "paths named but not in the repository:\n" + "\n".join(broken)


def test_every_named_anchor_exists():
    files = sources()
    named = sum(len(PAGE_ANCHOR.findall(f.read_text())) + len(LINK_ANCHOR.findall(f.read_text())) for f in files)
    assert named > 20, named
    broken = [m for f in files for m in missing_anchors(f.read_text(), f)]
    assert not broken, "anchors named but not a heading of their page:\n" + "\n".join(broken)
