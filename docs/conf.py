"""Sphinx configuration of jaxcomm's documentation site (`make docs`).

The guide, the notebooks and the API reference are derived from the README, colab/ and the
`__all__` of every public module when the build starts (docs/_generate.py), so a new README
section or public name appears without editing this file.
"""

import inspect
import os
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS)]  # the checkout's jaxcomm, then _generate

import _generate  # noqa: E402
import jaxcomm  # noqa: E402

_generate.generate(DOCS)

project = "jaxcomm"
author = "the jaxcomm authors"
copyright = "the jaxcomm authors"
release = version = jaxcomm.__version__

extensions = [
    "myst_nb",  # Markdown (MyST) pages and .ipynb notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.viewcode",
]
exclude_patterns = ["_build", "_opening.md", "_method_*.md", "**/.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}

# Notebooks are run when the site is built, with the small settings tests/test_notebooks.py
# uses (8 steps, 8 emulated CPU devices; on Colab they run longer), so their pages show the
# outputs; jupyter-cache keeps them until a notebook's code changes (docs/_build/.jupyter_cache).
# A notebook that fails fails the build.
os.environ.setdefault("JAXCOMM_NB_STEPS", "8")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(DOCS.parent), os.environ.get("PYTHONPATH")) if p)
nb_execution_mode = "cache"
nb_execution_timeout = 600  # seconds per cell
nb_execution_raise_on_error = True
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 4  # README links such as results.md#make-run
# RESULTS.md goes from `##` to `####` under some tables: a style, not an error. A short
# `name` that matches several objects links to the first (`table()`: three classes have one).
suppress_warnings = ["myst.header", "ref.python"]

autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False
autosummary_generate = False  # api/*.md hold the entries themselves
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# `name` in a docstring is a cross-reference when Sphinx knows the name, code otherwise.
default_role = "py:obj"

# optax / jax / flax are linked only when their inventories are reachable: this build runs
# offline (no network but package registries), so by default types print as plain text.
# JAXCOMM_DOCS_INTERSPHINX=1 turns the links on where the network allows.
if os.environ.get("JAXCOMM_DOCS_INTERSPHINX") == "1":
  extensions.append("sphinx.ext.intersphinx")
  intersphinx_mapping = {
      "python": ("https://docs.python.org/3", None),
      "jax": ("https://docs.jax.dev/en/latest", None),
      "optax": ("https://optax.readthedocs.io/en/latest", None),
      "flax": ("https://flax.readthedocs.io/en/latest", None),
  }

html_theme = "sphinx_book_theme"
html_title = f"jaxcomm {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
# jaxcomm.css: a reading column as wide as the window, tables and code blocks that wrap
# (tests/test_docs_layout.py measures them in headless Chromium).
html_static_path = ["_static"]
html_css_files = ["jaxcomm.css"]


def _resolve_short_names(app, env, node, contnode):
  """`comm.inspect` in a docstring links to `jaxcomm.comm.inspect` when that exists."""
  target = node.get("reftarget", "")
  if node.get("refdomain") != "py" or not target or target.startswith("jaxcomm."):
    return None
  domain = env.get_domain("py")
  full = f"jaxcomm.{target.lstrip('~.')}"
  if full not in domain.objects:
    return None
  node["reftarget"] = full
  return domain.resolve_xref(env, node["refdoc"], app.builder, node.get("reftype", "obj"),
                             full, node, contnode)


# A backtick span: ``literal`` or `reference`.
_SPAN = re.compile(r"(``.+?``|`[^`]+`)")


def _as_rest(line):
  """One docstring line, written for help(), made safe for reStructuredText.

  `|x|` is an absolute value, not a substitution; `Codec`s is a plural, but reST needs a
  break after a closing backtick (an escaped space renders as nothing).
  """
  parts = _SPAN.split(line)
  for i, part in enumerate(parts):
    if i % 2 == 0:
      parts[i] = part.replace("|", "\\|")
    elif i + 1 < len(parts) and re.match(r"[A-Za-z0-9]", parts[i + 1]):
      parts[i] = part + "\\ "
  return "".join(parts)


def _docstring_as_rest(app, what, name, obj, options, lines):
  """Docstrings are plain text with backticks; this keeps their notation from being markup."""
  del app, options
  if what == "data" and (not lines or inspect.getdoc(type(obj)) and (
      "\n".join(lines).strip() == inspect.getdoc(type(obj)).strip())):
    # A re-exported constant has no docstring of its own (not dict's or tuple's): its `#:`
    # comment where it is assigned.
    lines[:] = _generate.constant_doc(name)
  example = False
  for i, line in enumerate(lines):
    stripped = line.strip()
    example = stripped.startswith(">>>") or (example and bool(stripped))
    if not example:
      lines[i] = _as_rest(line)


def setup(app):
  app.connect("autodoc-process-docstring", _docstring_as_rest)
  app.connect("missing-reference", _resolve_short_names)
