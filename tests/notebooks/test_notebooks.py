"""Executes every example notebook on the confined cellblock-python kernel and checks what a reader would see.

Expected values are computed here from first principles (a sieve; the CSV read with the csv module), never
copied from a previous run, so a kernel that returned wrong numbers would fail.
"""
import base64
import csv
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

SOURCE = Path(os.environ.get("CELLBLOCK_SOURCE_DIR", Path(__file__).resolve().parents[2]))
NOTEBOOKS = SOURCE / "notebooks"
KERNEL = "cellblock-python"


def _texts(cell):
    """All text a reader sees under a cell: streams and text/plain of results and displays."""
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(o.text)
        elif "data" in o:
            out.append(o.data.get("text/plain", ""))
    return "".join(out)


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    """A copy of notebooks/ used as the kernel's workspace, so the notebooks find data/ and nothing else."""
    ws = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, ws)
    monkeypatch.setenv("CELLBLOCK_WORKSPACE", str(ws))
    return ws


def _execute(path: Path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name=KERNEL, timeout=180, resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.validate(nb)
    return [c for c in nb.cells if c.cell_type == "code"]


def _first_primes(count):
    limit = 1000
    sieve = [True] * (limit + 1)
    sieve[0:2] = [False, False]
    for n in range(2, int(limit**0.5) + 1):
        if sieve[n]:
            sieve[n * n :: n] = [False] * len(sieve[n * n :: n])
    return [n for n, p in enumerate(sieve) if p][:count]


def test_first_60_primes_notebook(workspace):
    primes = _first_primes(60)
    expected = sum(primes)
    cells = _execute(workspace / "first_60_primes.ipynb")
    assert _texts(cells[0]) == f"{primes[:10]} ... {primes[-1]}\n"
    results = [o for c in cells for o in c.outputs if o.output_type == "execute_result"]
    assert [r.data["text/plain"] for r in results] == [str(expected)]
    assert f"sieve agrees: {expected}" in _texts(cells[-1])
    assert [c.execution_count for c in cells] == [1, 2, 3]


def test_fruit_sales_notebook(workspace):
    units = Counter()
    revenue = Counter()
    with open(workspace / "data" / "fruit_sales.csv", newline="") as f:
        for row in csv.DictReader(f):
            units[row["product"]] += int(row["units"])
            revenue[row["product"]] += int(row["units"]) * float(row["unit_price"])
    best, best_units = units.most_common(1)[0]

    cells = _execute(workspace / "fruit_sales.ipynb")
    table = next(o for o in cells[1].outputs if o.output_type == "execute_result")
    html = table.data["text/html"]
    for product, count in units.items():
        assert product in html and f"<td>{count}</td>" in html, product
    assert f"Most units sold: {best} ({best_units} units)" in _texts(cells[2])
    top_revenue = max(revenue, key=revenue.get)
    assert f"Most revenue: {top_revenue} (${revenue[top_revenue]:.2f})" in _texts(cells[2])

    images = [o for o in cells[3].outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1, "the bar chart appears once, without plt.show()"
    assert base64.b64decode(images[0].data["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")


def test_nbconvert_cli_executes_in_place(workspace):
    """The README's `jupyter nbconvert --execute` route, as a person would type it."""
    out = workspace / "executed.ipynb"
    subprocess.run(
        ["/usr/bin/jupyter", "nbconvert", "--to", "notebook", "--execute",
         f"--ExecutePreprocessor.kernel_name={KERNEL}", "--ExecutePreprocessor.timeout=180",
         "--output", str(out), str(workspace / "first_60_primes.ipynb")],
        check=True, capture_output=True, timeout=300,
    )
    nb = nbformat.read(out, as_version=4)
    assert "7699" in "".join(_texts(c) for c in nb.cells if c.cell_type == "code")


CHECKED_ABOVE = {"first_60_primes.ipynb", "fruit_sales.ipynb"}


def test_every_notebook_in_the_folder_runs(workspace):
    """A notebook added to notebooks/ is run too (without errors), not only the ones checked value by value above;
    the count check catches a renamed or moved notebook that the tests above would no longer find."""
    found = sorted(path.name for path in NOTEBOOKS.glob("*.ipynb"))
    assert len(found) >= len(CHECKED_ABOVE) and CHECKED_ABOVE <= set(found), found
    for name in found:
        if name in CHECKED_ABOVE:
            continue
        cells = _execute(workspace / name)  # raises CellExecutionError on a cell that fails
        assert cells, f"{name} has no code cell"
