"""The house rules of DESIGN.md, checked on the package's import graph (every import statement, module-level,
function-level and TYPE_CHECKING alike, as import-linter's graph library reads them):

- the layer contracts in pyproject.toml `[tool.importlinter]` hold (imports point downward only; algorithms/ and
  kernels/ never import megatron; rollout engines know no trainer), run with import-linter's own command;
- no two modules of the package import each other, directly or through others (no import circle);
- no module is over the size STYLE.md aims for.
"""

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_gspo"
MAX_LINES = 600


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(PACKAGE, cache_dir=None)


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (each is at least one import circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        # Iterative Tarjan: (module, iterator over its imports) frames.
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            advanced = False
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_layer_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


def test_no_import_circles(graph):
    assert import_cycles(graph) == []


def test_the_cycle_finder_sees_a_circle():
    # The check above must be able to fail: one more import closing a loop is found as a circle.
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    graph.add_import(importer="megatron_gspo.errors", imported="megatron_gspo.training.trainer")
    cycles = import_cycles(graph)
    assert len(cycles) == 1 and {"megatron_gspo.errors", "megatron_gspo.training.trainer"} <= set(cycles[0])


def test_the_graph_holds_imports_inside_functions(graph):
    # The circles the package had went through imports inside functions (batch -> packing -> batch); the CLI
    # imports the trainer only inside its command functions.
    assert graph.direct_import_exists(importer="megatron_gspo.cli.main", imported="megatron_gspo.training.trainer")


def test_modules_stay_small():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / PACKAGE).rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
