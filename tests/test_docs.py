"""Generated documentation stays in step with the code."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from asyncrl.config.docs import config_reference_markdown
from tests.helpers import REPO_ROOT


def test_config_reference_is_up_to_date():
    on_disk = (REPO_ROOT / "docs" / "config.md").read_text()
    assert on_disk == config_reference_markdown(), "docs/config.md is stale: run python scripts/gen_config_docs.py"


def test_config_reference_documents_every_field():
    text = config_reference_markdown()
    for section in ("run", "model", "rollout", "logging"):
        assert f"## `{section}`" in text
    assert "| `max_staleness` |" in text


def test_every_config_field_has_a_description():
    import typing

    from pydantic import BaseModel

    from asyncrl.config import Config

    missing, stack, seen = [], [("", Config)], set()
    while stack:
        prefix, model = stack.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                missing.append(f"{prefix}{name}")
            for candidate in (field.annotation, *typing.get_args(field.annotation)):
                for inner in (candidate, *typing.get_args(candidate)):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        stack.append((f"{prefix}{name}.", inner))
    assert not missing, f"config fields without a docstring: {missing}"


HISTORY = re.compile(r"\bissues? \d+|\bsessions? \d+|\bseed 00\d|\b(?:first|second|third|fourth) pass\b"
                     r"|(?<![-\w])items? \d+", re.I)
"""How the project got here, which belongs in commit messages and CHANGELOG.md: an issue number, a
numbered work session, a numbered planning document ("seed" and its number), a numbered pass of work or an
issue's numbered item ("item 4"; not an option such as ``--items 16``)."""


def _prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of what a file says to its readers: all of a Markdown file, a YAML file's
    comments, a Python file's comments and string literals (docstrings, messages)."""
    text = path.read_text()
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    if path.suffix in (".yaml", ".yml"):
        return [(n, line[line.index("#"):]) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [(tok.start[0], tok.string) for tok in tokens if tok.type in (tokenize.COMMENT, tokenize.STRING)]


def history_lines(paths) -> list[str]:
    """``path:line: text`` of every line of ``paths`` that tells the project's history (``HISTORY``)."""
    found = []
    for path in paths:
        for line, text in _prose(path):
            for offset, part in enumerate(text.splitlines()):
                if HISTORY.search(part):
                    found.append(f"{path}:{line + offset}: {part.strip()}")
    return found


def _documentation() -> list[Path]:
    """The README, docs/, tests/README.md, the configs, the package's sources (and the scripts and
    workflows users run) and the tests; CHANGELOG.md is the history and is not among them, nor this
    file, whose examples of history lines are the check's own."""
    root = REPO_ROOT
    tests = (path for path in sorted((root / "tests").rglob("*.py")) if path.resolve() != Path(__file__).resolve())
    return [root / "README.md", root / "tests" / "README.md", *sorted((root / "docs").rglob("*.md")),
            *sorted((root / "configs").glob("*.yaml")),
            *(path for folder in ("asyncrl", "scripts", "workflows") for path in sorted((root / folder).rglob("*.py"))),
            *tests]


def test_the_docs_say_what_the_product_is_not_how_it_got_here():
    found = history_lines(_documentation())
    assert not found, "history belongs in CHANGELOG.md or the commit message:\n" + "\n".join(found)


def test_a_history_line_put_back_is_caught(tmp_path):
    (tmp_path / "guide.md").write_text("# Guide\n\nThe plan counts it since the third pass (issue 1234).\n")
    (tmp_path / "recipe.yaml").write_text("# Seed 009's example\nmodel: {path: x}  # session 99\nname: issue 3\n")
    (tmp_path / "module.py").write_text('"""Calibrated in the fourth pass."""\nx = "issue 12"  # fine here\nissue_7 = 1\n'
                                        '"""Item 4: the run stops."""\nx = "make_trie.py --items 16"\n')
    found = history_lines(sorted(tmp_path.iterdir()))
    assert [f.split(": ", 1)[0].rsplit("/", 1)[1] for f in found] == [
        "guide.md:3", "module.py:1", "module.py:2", "module.py:4", "recipe.yaml:1", "recipe.yaml:2"], found
    assert history_lines([tmp_path / "guide.md"]) == [f"{tmp_path / 'guide.md'}:3: The plan counts it since the third pass (issue 1234)."]
    assert not (REPO_ROOT / "CHANGELOG.md") in _documentation()
    assert REPO_ROOT / "tests" / "run" / "test_train_loop.py" in _documentation()


def test_the_performance_guide_stays_a_guide():
    """docs/performance.md says how to measure, profile and plan; measured figures go to docs/benchmarks.md."""
    lines = (REPO_ROOT / "docs" / "performance.md").read_text().count("\n")
    assert lines <= 600, f"docs/performance.md has {lines} lines (at most 600): move results to docs/benchmarks.md"


CITATION = re.compile(r'(?:(?<![`\w/])docs/(\w+)\.md|`docs/(\w+)\.md`),? \(?((?:"[^"\n]+"(?:, )?)+)')
"""``docs/<file>.md "Section"`` (also with a comma, in parentheses, or several sections): how the
code and the docs cite a section. A path inside an inline code span (`` `docs/x.md "Section"` ``)
is an example, not a citation."""


def _headings(doc: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    return re.findall(r"^#+ (.+)$", text, re.M)


def _names(heading: str, cited: str) -> bool:
    """A citation names a heading by its whole text or by the part before its colon or parenthesis."""
    return heading == cited or heading.startswith((cited + ":", cited + " ("))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_sections_cited_by_name_exist():
    """Code and docs cite sections as ``docs/<file>.md "Section"`` and link them as ``file.md#anchor``;
    each names a heading of that file."""
    sources = [*(path for folder in ("asyncrl", "scripts", "workflows") for path in (REPO_ROOT / folder).rglob("*.py")),
               REPO_ROOT / "README.md", REPO_ROOT / "tests" / "README.md", *(REPO_ROOT / "docs").rglob("*.md"),
               *(REPO_ROOT / "configs").glob("*.yaml")]
    missing, cited = [], 0
    for path in sources:
        text = path.read_text().replace('\\"', '"')  # a citation inside a Python string: \"Section\"
        for match in CITATION.finditer(text):
            doc = REPO_ROOT / "docs" / f"{match.group(1) or match.group(2)}.md"
            for section in re.findall(r'"([^"]+)"', match.group(3)):
                cited += 1
                if not doc.is_file() or not any(_names(h, section) for h in _headings(doc)):
                    missing.append(f"{path.relative_to(REPO_ROOT)}: {doc.name} \"{section}\"")
        if path.suffix == ".md":
            for name, anchor in re.findall(r"\]\((\w+)\.md#([\w-]+)\)", text):
                cited += 1
                doc = REPO_ROOT / "docs" / f"{name}.md"
                if not doc.is_file() or anchor not in {_slug(h) for h in _headings(doc)}:
                    missing.append(f"{path.relative_to(REPO_ROOT)}: {name}.md#{anchor}")
    assert cited > 20, "hardly any citation found: the pattern is stale"
    assert not missing, f"sections cited but not headings of the file cited: {missing}"


def test_the_accelerator_extras_the_readme_names_install_jax_plugins():
    """README's set-up names ``.[cuda]`` and ``.[tpu]``: they exist in setup.cfg and bring JAX's
    own plugin (pinned to the installed jax by jax's extra), nothing of ours."""
    import configparser
    import re

    parser = configparser.ConfigParser()
    parser.read(REPO_ROOT / "setup.cfg")
    extras = parser["options.extras_require"]
    requirements = {name: [line.strip() for line in extras[name].splitlines() if line.strip()] for name in ("cuda", "tpu")}
    assert requirements == {"cuda": ["jax[cuda13]"], "tpu": ["jax[tpu]"]}
    readme = (REPO_ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):readme.index("## Quickstart")]
    assert re.search(r"pip install -e '\.\[dev,cuda\]'", setup) and "pip install -e '.[tpu]'" in setup


def test_the_glossary_terms_are_linked_from_the_pages_that_use_them():
    """docs/glossary.md has a heading per term; the terms the docs use unexplained are linked to it
    from a page that uses them (the anchors are checked by test_sections_cited_by_name_exist)."""
    glossary = REPO_ROOT / "docs" / "glossary.md"
    anchors = {_slug(h) for h in _headings(glossary)}
    linked = {anchor for page in [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")] if page != glossary
              for anchor in re.findall(r"\(glossary\.md#([\w-]+)\)", page.read_text())}
    required = {"rlvr", "remat", "ocdbt", "megacore", "splash-attention", "hbm-and-vmem", "thunk-sequence"}
    assert required <= anchors and required <= linked, (required - anchors, required - linked)
    assert "docs/glossary.md" in (REPO_ROOT / "README.md").read_text()
