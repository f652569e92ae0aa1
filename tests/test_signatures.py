"""The package's public functions take their essentials positionally and the rest keyword-only
(torchtitan's ``__init__(self, config, *, deps)``): a call reads as what it does, and a new
option never shifts the meaning of an argument already passed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST_POSITIONAL = 4
PROTOCOLS = {"areal_eval/evaluation/rewards.py"}
"""Reward functions: ``(prompt, completions, prompt_ids, completion_ids, answer)``, the signature
AReaL's reward functions share, so that a user's own drops in."""


def too_many_positional() -> list[str]:
    found = []
    for path in sorted(p for top in ("areal_eval", "tasks", "commands", "flows") for p in (ROOT / top).rglob("*.py")):
        if str(path.relative_to(ROOT)) in PROTOCOLS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                if any("flow" in ast.unparse(d) for d in node.decorator_list):
                    continue  # a flow's parameters come by name: deployments, events, the command line
                names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(names) > MOST_POSITIONAL:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(names)})")
    return found


def test_public_functions_take_at_most_four_arguments_positionally_and_the_rest_by_keyword():
    assert too_many_positional() == []
