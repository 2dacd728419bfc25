"""Generated documentation stays in step with the code."""

from __future__ import annotations

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


def test_design_sections_cited_in_the_code_exist():
    """Docstrings cite docs/design.md by section; each cited section is a heading there."""
    import re

    headings = set(re.findall(r"^#+ (.+)$", (REPO_ROOT / "docs" / "design.md").read_text(), re.M))
    cited: dict[str, set[str]] = {}
    for path in [*(REPO_ROOT / "asyncrl").rglob("*.py"), *(REPO_ROOT / "scripts").glob("*.py")]:
        for group in re.findall(r'docs/design\.md ((?:"[^"\n]+"(?:, )?)+)', path.read_text()):
            for section in re.findall(r'"([^"]+)"', group):
                cited.setdefault(section, set()).add(path.name)
    assert cited, "no citation found: the pattern is stale"
    missing = {section: sorted(files) for section, files in cited.items() if section not in headings}
    assert not missing, f"sections cited but not in docs/design.md: {missing}"


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
