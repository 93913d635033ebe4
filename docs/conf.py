"""Sphinx configuration: ``make docs`` builds the site into docs/_build/html."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE / "_ext")]

import idlekeeper  # noqa: E402 (the repository root is on the path now)

project = "idlekeeper"
author = "idlekeeper developers"
copyright = "idlekeeper developers"
version = release = idlekeeper.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinxcontrib_trio",  # async signatures: `await`, `async with`, `async for`
    "myst_parser",  # the guides are Markdown, as the README was
    "generated",  # docs/_ext/generated.py: every command's options and every metric, from the code
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Markdown: `#anchor` links to headings of other pages, and ::: fences for admonitions.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Plain ``` blocks (sample output) are shown as text; languages are named where it matters.
highlight_language = "none"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}

html_theme = "furo"
html_title = f"idlekeeper {release}"
