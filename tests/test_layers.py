"""The package's layers: no module imports one of a higher layer, and no imports go round in a cycle.

Every import counts, wherever it is written (at the top, inside a function, under
``TYPE_CHECKING``): a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    {"config", "disk", "estimates", "paired", "redaction"},  # configs, files, statistics: import nothing of ours
    {"jsonl", "data"},  # records on disk, data sets
    {
        "launchers",
        "launchers.devices",
        "launchers.reaper",
        "launchers.process_control",
        "distributed",
    },  # processes: devices, ranks, clean-up
    {"launchers.local", "launchers.forked_ranks", "launchers.fork_server"},  # torchrun jobs on this machine
    {"alerts", "scheduling", "feedback"},  # pure decisions: which checkpoint to evaluate, alert on, ask of training
    {"runs"},  # a run's directory and ledger
    {"checkpoints"},
    {"integrations"},  # trainers' side: publishing from HF, AReaL-style loops
    {"models"},
    {"evaluation"},  # the ranks' side: evaluators, the worker, warm workers, job specs
    {  # evaluation slots on Ray and Slurm, beside the local launcher: a module per launcher
        "launchers.node_agent",
        "launchers.slot_pool",
        "launchers.slurm_node",
        "launchers.slurm_queue",
        "launchers.ray_slots",
        "launchers.slurm_slots",
    },
    {"evaluation.jobs"},  # the flow's side: ``eval`` settings (every launcher's) and one checkpoint's job
    {"sinks", "logged_models", "curve_plot", "failures", "compare"},  # what is made of results
    {"tracking", "recording"},  # the one recording step: MLflow, then the other sinks
    {"lifecycle"},  # one run's lifecycle, on every path
    {"train_config"},  # the training job's settings (the flow's side and the ranks')
    {"pipeline", "train", "cli", "diagnostics"},  # the combined config and the entry points
]
"""Each entry: a module's name under ``areal_eval``, its first part (a package or a flat module)
or, for the launchers (processes on this machine, and slots on clusters above the ranks' side of
evaluation) and for ``evaluation.jobs`` (the flow's side, above the slots), its first two."""
OUTSIDE = {"tasks": len(LAYERS), "commands": len(LAYERS) + 1, "flows": len(LAYERS) + 2}
"""The Prefect side, above the library: tasks, what a command does around its flow, then the flows."""


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] in OUTSIDE:
        return OUTSIDE[parts[0]]
    if parts[0] != "areal_eval" or len(parts) == 1:
        return None
    for name in (".".join(parts[1:3]), parts[1]):
        if (layer := next((i for i, names in enumerate(LAYERS) if name in names), None)) is not None:
            return layer
    return None


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from pkg import module`` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            )
    return {m for m in found if m in modules}


def project_graph() -> dict[str, set[str]]:
    paths = [p for top in ("areal_eval", "tasks", "commands", "flows") for p in (ROOT / top).rglob("*.py")]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) - {module_name(p)} for p in paths}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in graph.items()
        for t in targets
        if layer_of(t) is not None and layer_of(t) > layer_of(m)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    graph = project_graph()
    assert [m for m in graph if m != "areal_eval" and layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    assert upward_imports(project_graph()) == []


def test_no_imports_go_round_in_a_cycle():
    assert cycles(project_graph()) == []


@pytest.mark.parametrize(
    "graph, problem",
    [
        (
            {"areal_eval.runs.ledger": {"areal_eval.lifecycle.shared_run"}, "areal_eval.lifecycle.shared_run": set()},
            "upward",
        ),
        (
            {
                "areal_eval.scheduling.a": {"areal_eval.scheduling.b"},
                "areal_eval.scheduling.b": {"areal_eval.scheduling.a"},
            },
            "cycle",
        ),
    ],
)
def test_the_checks_catch_an_upward_import_and_a_cycle(graph, problem):
    assert bool(upward_imports(graph)) == (problem == "upward")
    assert bool(cycles(graph)) == (problem == "cycle")


def test_every_library_module_has_a_test_file_or_a_line_saying_where_it_is_tested():
    listed = (ROOT / "tests" / "README.md").read_text()
    untested = []
    for path in sorted(p for top in ("areal_eval", "tasks", "commands") for p in (ROOT / top).rglob("*.py")):
        if path.name == "__init__.py":
            continue
        relative = (
            path.relative_to(ROOT / "areal_eval")
            if path.is_relative_to(ROOT / "areal_eval")
            else path.relative_to(ROOT)
        )
        mirror = ROOT / "tests" / relative.parent / f"test_{path.name}"
        if not mirror.exists() and f"`{path.relative_to(ROOT)}`" not in listed:
            untested.append(str(path.relative_to(ROOT)))
    assert untested == [], "add a test file, or a line in tests/README.md"
