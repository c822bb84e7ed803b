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
