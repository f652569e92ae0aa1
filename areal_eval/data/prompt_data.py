"""Prompts with reference answers, and texts to score, for causal-LM evaluation.

Prompt rows are ``{"prompt": str, "answer": str}``, or AReaL's GSM8K form ``{"question": str,
"answer": "... #### 42"}``. Text rows are ``{"text": str}``, or ``{"prompt": str, "completion":
str}`` where only the completion is scored. Readers fail on the first bad row with its file and
line, because a silently skipped row changes every metric.
"""

from __future__ import annotations

from pathlib import Path

from areal_eval import jsonl
from areal_eval.data.preference_data import DataError


def _rows(path: str | Path, what: str):
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such {what} file")
    try:
        yield from jsonl.rows(path)
    except jsonl.JsonlError as exc:
        raise DataError(str(exc)) from exc


def _text(row: dict, key: str, where: str, allow_empty: bool = False) -> str:
    value = row.get(key)
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise DataError(f"{where}: field '{key}' must be a string with text in it")
    return value


def read_prompts(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer") -> list[dict]:
    """Rows ``{"id", "prompt", "answer", "line"}``; a ``question`` stands in for a missing
    ``prompt`` (GSM8K). ``id`` is the row's index in the file: what sampling seeds derive from."""
    prompts = []
    for lineno, row in _rows(path, "prompt"):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with '{prompt_field}' and '{answer_field}'")
        key = prompt_field if prompt_field in row or "question" not in row else "question"
        if answer_field not in row:
            raise DataError(f"{where}: no '{answer_field}': every prompt needs a reference answer to score against")
        answer = row[answer_field]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        row = {**row, answer_field: answer}
        prompts.append(
            {
                "id": len(prompts),
                "prompt": _text(row, key, where),
                "answer": _text(row, answer_field, where),
                "line": lineno,
            }
        )
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def read_texts(path: str | Path, completion_field: str = "completion") -> list[dict]:
    """Rows ``{"prompt", "completion"}``: a ``text`` row is all completion (empty prompt)."""
    texts = []
    for lineno, row in _rows(path, "text"):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with 'text', or 'prompt' and '{completion_field}'")
        if "text" in row:
            texts.append({"prompt": "", "completion": _text(row, "text", where), "line": lineno})
        elif "prompt" in row and completion_field in row:
            texts.append(
                {
                    "prompt": _text(row, "prompt", where, allow_empty=True),
                    "completion": _text(row, completion_field, where),
                    "line": lineno,
                }
            )
        else:
            raise DataError(f"{where}: expected 'text', or 'prompt' and '{completion_field}'")
    if not texts:
        raise DataError(f"{path}: no texts")
    return texts
