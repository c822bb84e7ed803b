"""Writes the documentation pages that are derived from other files (conf.py calls `generate`).

* the user guide (guide/*.md) and the landing page's opening (_opening.md): the README's
  sections, split into pages, their links rewritten to the site's pages;
* results.md, contributing.md, changelog.md: experiments/RESULTS.md, CONTRIBUTING.md and
  CHANGELOG.md, links rewritten;
* notebooks/*.ipynb: colab/'s notebooks with a note that the build runs them with small
  settings;
* _method_hooks.md, _method_context.md: the tables of a method module's hooks and of its
  `ctx`, from `experiments.methods.Hooks` and `experiments.build.Context` (own_method.md
  includes them);
* api/*.md: one page per public module, an autosummary table and an autodoc entry for every
  name of the module's `__all__` (so a new public name is documented without editing here).

Generated files are not committed (docs/.gitignore); the README stays the one source.
"""

import functools
import importlib
import inspect
import json
import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Guide pages: (file stem, title, README `## ` headings it is made of, by prefix). A README
# section no page names gets a page of its own at the end, so nothing is left out.
GUIDE = (
    ("quickstart", "Quickstart", ("Quickstart", "Notebooks")),
    ("make_run", "`make run` and experiments",
     ("`make run`", "Experiments: one config per run")),
    ("methods", "Methods and gradient compression",
     ("Methods (", "Gradient compression", "Conventions")),
    ("planning", "Costs and planning real model sizes",
     ("What communication costs", "Planning real model sizes")),
    ("layouts", "Layouts", ("Layouts", "Methods over replicas of a sharded model")),
    ("elastic", "Checkpoints, multi-host runs and elastic training",
     ("Checkpoints, multi-host runs, faults",)),
    ("own", "Your own codec, method or model",
     ("Your own codec, transform or model", "Your own model, data and dashboard")),
)

# README sections shown elsewhere: the package layout opens the API reference.
ELSEWHERE = ("Layout",)

# Where a repository file is on the site (relative to docs/); other links become plain text.
SITE = {
    "README.md": "index.md",
    "docs/algorithms.md": "algorithms.md",
    "experiments/RESULTS.md": "results.md",
    "CONTRIBUTING.md": "contributing.md",
    "CHANGELOG.md": "changelog.md",
}
SITE.update({f"colab/{p.name}": f"notebooks/{p.name}" for p in (ROOT / "colab").glob("*.ipynb")})

NOTEBOOK_NOTE = (
    "```{note}\nThe outputs on this page are those of the documentation build, which runs the "
    "notebook with small settings (`JAXCOMM_NB_STEPS=8` steps, 8 emulated CPU devices): "
    "losses are those of a few steps, timings those of a CPU. Run it on Colab (setup cell "
    "below) or locally for the full settings.\n```")


def generate(docs=DOCS):
  """Writes every derived page under `docs` (a directory laid out like docs/)."""
  docs = pathlib.Path(docs)
  _write_guide(docs)
  hooks, context = method_contract()
  _write(docs / "_method_hooks.md", hooks)  # included by own_method.md
  _write(docs / "_method_context.md", context)
  for source in ("experiments/RESULTS.md", "CONTRIBUTING.md", "CHANGELOG.md"):
    page = SITE[source]
    _write(docs / page, _rewrite_links((ROOT / source).read_text(), source, page))
  _write_notebooks(docs / "notebooks")
  write_api(docs / "api")


def _write(path, text):
  """Writes only on a change, so that Sphinx rebuilds only what changed."""
  path.parent.mkdir(parents=True, exist_ok=True)
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


# --- README -> guide -------------------------------------------------------------------------


def readme_sections(text):
  """The README split at its `## ` headings: (opening, [(heading, body), ...])."""
  parts = re.split(r"^## (.+)\n", text, flags=re.M)  # code blocks hold no `## ` lines
  opening = parts[0]
  return opening, list(zip(parts[1::2], parts[2::2]))


def _write_guide(docs):
  source = "README.md"
  opening, sections = readme_sections((ROOT / source).read_text())
  opening = re.sub(r"\A# .*\n", "", opening)  # index.md has the title
  _write(docs / "_opening.md", _rewrite_links(opening, source, "index.md"))
  used, pages = set(ELSEWHERE), []
  for stem, title, prefixes in GUIDE:
    chosen = []
    for prefix in prefixes:
      match = ([h for h, _ in sections if h == prefix and h not in used] or
               [h for h, _ in sections if h.startswith(prefix) and h not in used])
      if not match:
        raise ValueError(f"docs/_generate.py: the README has no section '## {prefix}...'")
      used.add(match[0])
      chosen.append(match[0])
    pages.append((stem, title, chosen))
  for heading, _ in sections:  # sections no page names: a page each
    if heading not in used:
      stem = re.sub(r"[^a-z0-9]+", "_", heading.lower()).strip("_")
      pages.append((stem, heading, [heading]))
  bodies = dict(sections)
  for stem, title, chosen in pages:
    if len(chosen) == 1:
      text = f"# {title}\n\n{bodies[chosen[0]].strip()}\n"
    else:
      text = f"# {title}\n\n" + "\n".join(f"## {h}\n\n{bodies[h].strip()}\n" for h in chosen)
    _write(docs / "guide" / f"{stem}.md", _rewrite_links(text, source, f"guide/{stem}.md"))
  toc = "\n".join(f"{stem}" for stem, _, _ in pages)
  _write(docs / "guide" / "index.md",
         "# User guide\n\nThe README's sections, one topic per page.\n\n"
         f"```{{toctree}}\n:maxdepth: 2\n\n{toc}\n```\n")


def _rewrite_links(text, source, page):
  """Points `[text](target)` links of `source` (a repository path) at the site's pages.

  Targets outside the site (source files, other folders) become code text: the site has
  no page for them and a link would be dead.
  """
  here = os.path.dirname(source)

  def one(match):
    label, target = match.group(1), match.group(2)
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      return match.group(0)
    path, _, anchor = target.partition("#")
    repo_path = os.path.normpath(os.path.join(here, path))
    if repo_path not in SITE:
      return label if label.startswith("`") else f"{label} (`{repo_path}`)"
    rel = os.path.relpath(SITE[repo_path], os.path.dirname(page) or ".")
    return f"[{label}]({rel}{'#' + anchor if anchor else ''})"

  return re.sub(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)", one, text)


# --- notebooks --------------------------------------------------------------------------------


def _write_notebooks(out):
  for path in sorted((ROOT / "colab").glob("*.ipynb")):
    nb = json.loads(path.read_text())
    note = {"cell_type": "markdown", "id": "docs-note", "metadata": {},
            "source": NOTEBOOK_NOTE}
    nb["cells"].insert(1, note)  # after the title cell
    _write(out / path.name, json.dumps(nb, indent=1) + "\n")
  links = "\n".join(sorted(p.stem for p in (ROOT / "colab").glob("*.ipynb")))
  _write(out / "index.md",
         "# Notebooks\n\nThe Colab notebooks of `colab/`, run when the site is built with "
         "small settings (8 steps on 8 emulated CPU devices), their outputs shown. Each "
         "notebook runs top to bottom on "
         "Colab (CPU, GPU or TPU runtime) or locally on 8 emulated CPU devices; its first "
         "cells say how to install jaxcomm there and which cells need how many devices.\n\n"
         f"```{{toctree}}\n:maxdepth: 1\n\n{links}\n```\n")


# --- a method's contract ---------------------------------------------------------------------


def _attributes(doc):
  """{name: text} of the `Attributes:` section of a Google-style docstring."""
  lines = inspect.cleandoc(doc).splitlines()
  out, name = {}, None
  for line in lines[lines.index("Attributes:") + 1:]:
    entry = re.match(r"  (\w+): (.*)", line)
    if entry:
      name = entry.group(1)
      out[name] = entry.group(2)
    elif line.startswith("    ") and name:
      out[name] += " " + line.strip()
    else:
      break
  return out


def _cell(text):
  """Text for a Markdown table cell: pipes escaped, and `<` and `>` outside code spans
  (`optimizer.<name>` is no HTML tag)."""
  parts = re.split(r"(`[^`]*`)", text.replace("|", "\\|"))
  return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;")
                 for p in parts)


def _default_of(fn):
  """What a hook's default returns, called with stand-ins for its arguments."""
  names = list(inspect.signature(fn).parameters)
  args = [object() for _ in names]
  out = fn(*args)
  given = [n for n, a in zip(names, args) if out is a]
  return f"`{given[0]}` itself" if given else f"`{out!r}`"


def method_contract():
  """(the table of `experiments.methods.Hooks`, the table of `experiments.build.Context`) as
  Markdown, from the record and its docstring: the page "Your own method" includes both."""
  import dataclasses

  from experiments import build
  from experiments import methods
  text = _attributes(methods.Hooks.__doc__)
  rows = ["| hook | takes, returns | what it is for | default |", "|---|---|---|---|"]
  for field in dataclasses.fields(methods.Hooks):
    signature, _, rest = text[field.name].partition("`")[2].partition("`")
    required = field.default is dataclasses.MISSING
    what = re.sub(r"^(, required)?: ", "", rest)
    default = "required"
    if not required:  # the record's default, and what the docstring says it means
      what, _, said = what.partition(" Default")
      why = said.split(": ", 1)[1] if ": " in said else ""
      default = _default_of(field.default)
      if why and not why.startswith(default):
        default += f": {why}"
    rows.append(f"| `{field.name}` | {_cell(f'`{signature}`')} | {_cell(what)} | "
                f"{_cell(default)} |")
  hooks = "\n".join(rows) + "\n"
  text = _attributes(build.Context.__doc__)
  rows = ["| field | type | what it holds |", "|---|---|---|"]
  for field in dataclasses.fields(build.Context):
    default = "" if field.default is dataclasses.MISSING else f" (default `{field.default!r}`)"
    rows.append(f"| `ctx.{field.name}` | {_cell(f'`{field.type}`')} | "
                f"{_cell(text[field.name])}{default} |")
  for name, fn in inspect.getmembers(build.Context, inspect.isfunction):
    if not name.startswith("_"):
      summary = " ".join(inspect.getdoc(fn).split("\n\n")[0].split())
      signature = str(inspect.signature(fn, eval_str=True)).replace("self, ", "")
      rows.append(f"| {_cell(f'`ctx.{name}{signature}`')} | method | {_cell(summary)} |")
  return hooks, "\n".join(rows) + "\n"


# --- API reference -----------------------------------------------------------------------------


def public_modules():
  """The documented modules: every subpackage named in `jaxcomm.__all__`."""
  import jaxcomm
  return [f"jaxcomm.{sub}" for sub in jaxcomm.__all__]


def constant_doc(fullname):
  """The description of a public constant (`jaxcomm.sync.GRAPHS`): the `#:` comment above
  its assignment in the module of its package that assigns it (Sphinx's attribute docs; a
  re-exported constant has no docstring of its own). [] when there is none."""
  import pkgutil

  modname, _, name = fullname.rpartition(".")
  package = importlib.import_module(modname)
  modules = [modname] + [f"{modname}.{m.name}"
                         for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
  for module in modules:
    lines = [line for line in _attr_docs(module).get(("", name), []) if line.strip()]
    if lines:
      return lines
  return []


@functools.lru_cache(maxsize=None)
def _attr_docs(module):
  """Sphinx's attribute docs (`#:` comments) of a module, parsed once."""
  from sphinx.pycode import ModuleAnalyzer
  from sphinx.pycode import PycodeError
  try:
    return ModuleAnalyzer.for_module(module).find_attr_docs()
  except PycodeError:
    return {}


def _directive(obj):
  if inspect.isclass(obj):
    if issubclass(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple: fields, no methods
      return "autoclass", []
    if issubclass(obj, BaseException):
      return "autoexception", []
    return "autoclass", [":members:"]
  if inspect.isroutine(obj) or hasattr(obj, "__wrapped__"):
    return "autofunction", []
  return "autodata", [":no-value:"]


def api_page(modname):
  """The reference page of one module: its docstring, a summary table, every public name."""
  module = importlib.import_module(modname)
  names = list(module.__all__)
  lines = [f"# `{modname}`", "", "```{eval-rst}", f".. automodule:: {modname}", "   :no-members:",
           "", f".. currentmodule:: {modname}", "", ".. autosummary::", "   :nosignatures:", ""]
  lines += [f"   {name}" for name in names]
  lines.append("")
  for name in names:
    directive, options = _directive(getattr(module, name))
    lines.append(f".. {directive}:: {name}")
    lines += [f"   {option}" for option in options]
    lines.append("")
  lines.append("```")
  return "\n".join(lines) + "\n"


def write_api(out):
  """Writes api/index.md and api/<module>.md for every public module."""
  out = pathlib.Path(out)
  modules = public_modules()
  for modname in modules:
    _write(out / f"{modname.split('.', 1)[1]}.md", api_page(modname))
  toc = "\n".join(modname.split(".", 1)[1] for modname in modules)
  opening, sections = readme_sections((ROOT / "README.md").read_text())
  del opening
  layout = dict(sections).get("Layout", "").strip()
  _write(out / "index.md",
         "# API reference\n\nGenerated from the docstrings of every public module: each name "
         "in a subpackage's `__all__` has an entry, with its `>>>` example (the test suite "
         "runs them). The package, as laid out in the README:\n\n"
         f"{layout}\n\n```{{toctree}}\n:maxdepth: 1\n\n{toc}\n```\n")
