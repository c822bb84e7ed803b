"""Every name in a public module's `__all__` has an entry in the API reference (docs/api/).

The reference pages are written from the modules' `__all__` when the docs build starts
(docs/_generate.py); the first test checks the pages it writes, the second the objects
Sphinx actually documented (docs/_build/html/objects.inv, after `make docs`: .ci/run builds
the docs before the tests).
"""

import importlib
import importlib.util
import pathlib
import re
import zlib

import pytest

import jaxcomm

ROOT = pathlib.Path(__file__).resolve().parents[1]
INVENTORY = ROOT / "docs" / "_build" / "html" / "objects.inv"


def _generate():
  spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "_generate.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _public_names():
  names = set()
  for sub in jaxcomm.__all__:
    module = importlib.import_module(f"jaxcomm.{sub}")
    names |= {f"jaxcomm.{sub}.{name}" for name in module.__all__}
  return names


def test_reference_pages_have_an_entry_for_every_public_name(tmp_path):
  _generate().write_api(tmp_path)
  documented, modules = set(), set()
  for page in tmp_path.glob("*.md"):
    text = page.read_text()
    current = re.search(r"^\.\. currentmodule:: (\S+)$", text, re.M)
    for name in re.findall(r"^\.\. auto(?:function|class|exception|data):: (\S+)$", text, re.M):
      documented.add(f"{current.group(1)}.{name}")
    modules |= set(re.findall(r"^\.\. automodule:: (\S+)$", text, re.M))
  assert modules == {f"jaxcomm.{sub}" for sub in jaxcomm.__all__}
  missing = sorted(_public_names() - documented)
  assert not missing, f"no API reference entry for {missing}"
  index = (tmp_path / "index.md").read_text()
  assert all(f"\n{sub}\n" in index for sub in jaxcomm.__all__), index  # in the toctree


def _inventory_names(path):
  """The object names of a Sphinx objects.inv (version 2: 4 header lines, then zlib)."""
  raw = path.read_bytes()
  header_end = 0
  for _ in range(4):
    header_end = raw.index(b"\n", header_end) + 1
  lines = zlib.decompress(raw[header_end:]).decode().splitlines()
  return {line.split(" ", 1)[0] for line in lines if " py:" in line}


def test_built_reference_documents_every_public_name():
  if not INVENTORY.exists():
    pytest.skip("the docs are not built (make docs)")
  sources = [*(ROOT / "jaxcomm").rglob("*.py"), *(ROOT / "docs").glob("*.py")]
  newest = max(p.stat().st_mtime for p in sources)
  if INVENTORY.stat().st_mtime < newest:
    pytest.skip("the built docs are older than the sources (make docs)")
  missing = sorted(_public_names() - _inventory_names(INVENTORY))
  assert not missing, f"the built API reference has no entry for {missing}"


def _constants():
  """Every public name that is neither a class nor a function (constants, type aliases)."""
  gen = _generate()
  for sub in jaxcomm.__all__:
    module = importlib.import_module(f"jaxcomm.{sub}")
    for name in module.__all__:
      if gen._directive(getattr(module, name))[0] == "autodata":
        yield f"jaxcomm.{sub}.{name}"


def test_every_public_constant_is_described():
  """A constant has no docstring of its own: its `#:` comment where it is assigned is its
  description on the reference page (docs/conf.py)."""
  gen = _generate()
  constants = list(_constants())
  assert "jaxcomm.sync.GRAPHS" in constants and len(constants) >= 20
  missing = [c for c in constants if not gen.constant_doc(c)]
  assert not missing, f"no `#:` description where these are assigned: {missing}"
  site = INVENTORY.parent
  if INVENTORY.exists() and INVENTORY.stat().st_mtime >= max(
      p.stat().st_mtime for p in (ROOT / "jaxcomm").rglob("*.py")):
    page = (site / "api" / "sync.html").read_text()
    entry = page[page.index('id="jaxcomm.sync.GRAPHS"'):]
    described = re.search(r"<dd>\s*<p>([^<]+)", entry[:entry.index("</dd>")])
    assert described and "gossip graphs" in described.group(1), entry[:600]


def test_the_own_method_page_states_the_whole_contract(tmp_path):
  """docs/own_method.md includes the tables written from the hooks' record and from `ctx`:
  every hook with what it takes and returns and its default, every field of `ctx`; its
  example module loads with the hooks it declares and builds a run (abstract: nothing
  compiles)."""
  import dataclasses

  from experiments import build, config, methods
  hooks, context = _generate().method_contract()
  for field in dataclasses.fields(methods.Hooks):
    assert f"| `{field.name}` |" in hooks, field.name
  row = lambda name: next(line for line in hooks.splitlines() if line.startswith(f"| `{name}`"))
  assert row("defaults").endswith("| required |") and row("build").endswith("| required |")
  assert row("period").endswith("| `1`: a sync every step. |")
  assert "| `None`: the method's own one-device step is measured" in row("local_step")
  assert row("wrap_loss").endswith("| `loss_fn` itself |")
  for field in dataclasses.fields(build.Context):
    assert f"| `ctx.{field.name}` |" in context, field.name
  assert "| `ctx.participation(" in context and "| `ctx.codec(" in context
  page = (ROOT / "docs" / "own_method.md").read_text()
  assert "{include} _method_hooks.md" in page and "{include} _method_context.md" in page
  assert "\nown_method\n" in (ROOT / "docs" / "index.md").read_text()  # in the toctree
  (block,) = re.findall(r"```python\n(.*?)```", page, re.S)
  path = tmp_path / "clipped_diloco.py"
  path.write_text(block)
  mine = methods.hooks(methods.load_method(str(path)))
  settings = mine.defaults()
  assert (mine.period(settings), mine.local_step(settings)) == (10, "inner")
  c = config.with_method(config.base_config(), {"method": str(path), "clip": 0.5})
  run = build.build(c, abstract=True)
  assert run.config.method.clip == 0.5 and run.method_axes == "data"
