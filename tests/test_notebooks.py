"""Every notebook in colab/ runs top to bottom with small settings, without an error."""

import os
import pathlib
import sys

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def test_notebooks_exist_with_outputs_cleared():
  assert NOTEBOOKS, "no notebooks in colab/"
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
      if cell.cell_type == "code":
        assert not cell.outputs and cell.execution_count is None, (
            f"{path.name}: outputs not cleared")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
  # The kernel inherits this environment: the checkout's jaxcomm, small settings, no display.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  monkeypatch.setenv("JAXCOMM_NB_STEPS", "8")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  # Run the kernel on this interpreter (the one with jaxcomm's dependencies).
  client.kernel_manager_class = _manager_for(sys.executable)
  client.execute()  # raises CellExecutionError on the first failing cell
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert code and all(cell.execution_count for cell in code), f"{path.name}: cells not run"
  errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
  assert not errors, errors


def _manager_for(python):
  from jupyter_client.manager import KernelManager

  class _Manager(KernelManager):
    def format_kernel_cmd(self, extra_arguments=None):
      cmd = super().format_kernel_cmd(extra_arguments)
      return [python] + cmd[1:] if cmd and "python" in os.path.basename(cmd[0]) else cmd

  return _Manager
