"""docs/ stays true: the architecture page shows the streams and subjects in code, the
configuration reference is what `kiln config docs` generates, and the README leads
with the two commands."""

from __future__ import annotations

import re
from pathlib import Path

from kiln.ops.cli import config_reference, topology_markdown

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_architecture_tables_match_contracts():
    text = (DOCS / "architecture.md").read_text()
    m = re.search(r"<!-- topology:begin[^>]*-->\n(.*?)<!-- topology:end -->", text, re.S)
    assert m, "docs/architecture.md lost its topology markers"
    assert m.group(1) == topology_markdown(), "docs/architecture.md is stale: paste `kiln topology --markdown`"


def test_configuration_reference_is_current():
    assert (DOCS / "configuration.md").read_text() == config_reference(), (
        "docs/configuration.md is stale: run `kiln config docs > docs/configuration.md`"
    )


def test_readme_leads_with_the_two_commands():
    readme = (DOCS.parent / "README.md").read_text()
    blocks = re.findall(r"```(?:sh|bash)?\n(.*?)```", readme, re.S)
    assert blocks and blocks[0].split() == ["make", "run"], blocks[:1]
    assert blocks[1].split() == ["make", "test"], blocks[:2]
    ci = (DOCS.parent / ".ci" / "run").read_text()
    assert "make test" in ci
