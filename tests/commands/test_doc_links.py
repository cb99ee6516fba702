"""Every relative link in the documentation names a file that exists (a user follows them literally)."""

from __future__ import annotations

import re

import pytest
from support import ROOT

DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("jobs/*.md"), *ROOT.glob("bench/**/*.md"),
               *ROOT.glob("tests/**/*.md")])
# [text](target#anchor): a target with a '/' or a file suffix (math such as nf[0](t) has neither)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_from_the_document_folder(doc):
    # docs/configuration.md and docs/benchmarks.md (moved out of the README) linked docs/plan.md, bench/...
    # relative to the repository root: 28 links that led nowhere from docs/
    text = doc.read_text()
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or not ("/" in target or re.search(r"\.\w+$", target)):
            continue
        if not (doc.parent / target).exists():
            broken.append(f"line {text[:match.start()].count(chr(10)) + 1}: {target}")
    assert not broken, broken
