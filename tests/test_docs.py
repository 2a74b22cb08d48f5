"""The documentation holds together: every relative link and anchor resolves,
and every example is in examples/README.md's table with the command it runs by."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted([os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md"),
               os.path.join(ROOT, "examples", "README.md")]
              + [os.path.join(ROOT, "docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                 if name.endswith(".md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path):
    """GitHub's anchors of a Markdown file's headings."""
    with open(path, encoding="utf-8") as f:
        headings = [line.lstrip("#").strip() for line in f if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_and_anchors_resolve(doc):
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):          # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(where):
            broken.append(f"{target}: no file {os.path.relpath(where, ROOT)}")
        elif anchor and where.endswith(".md") and anchor not in anchors(where):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(where, ROOT)}")
    assert not broken, f"{os.path.relpath(doc, ROOT)}: " + "; ".join(broken)


def test_every_example_is_in_the_examples_table():
    with open(os.path.join(ROOT, "examples", "README.md"), encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| `")]
    listed = {re.match(r"\| `([^`]+)`", row).group(1) for row in rows}
    examples = {os.path.relpath(os.path.join(d, name), os.path.join(ROOT, "examples"))
                for d, _, names in os.walk(os.path.join(ROOT, "examples"))
                for name in names if name.endswith(".py")}
    assert examples == listed, f"not in the table: {sorted(examples - listed)}; " \
                               f"in the table only: {sorted(listed - examples)}"
