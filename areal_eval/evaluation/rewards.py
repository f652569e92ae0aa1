"""Reward functions for generated answers, with AReaL's signature.

``fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float``: AReaL's
``gsm8k_reward_fn`` and any function written for AReaL plug in by dotted path. Built-ins:

* ``math``: the answer is checked with the ``math-verify`` package, as AReaL's GSM8K reward does;
* ``exact_match``: the text after the last ``####`` (else the whole text), normalised, equals
  the reference's.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable

RewardFn = Callable[..., float]


def final_answer(text: str) -> str:
    """The text after the last ``####`` (GSM8K's answer marker), else the whole text, normalised:
    lower case, single spaces, no trailing full stop, no thousands separators in numbers."""
    value = text.rsplit("####", 1)[1] if "####" in text else text
    value = " ".join(value.strip().lower().split()).rstrip(".")
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", value)


def exact_match(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    return float(final_answer(str(completions)) == final_answer(str(answer)))


def math(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """1.0 when ``math-verify`` finds the reference's answer in the completion."""
    from math_verify import parse, verify

    timeout = _math_verify_timeout()
    gold = parse(str(answer), parsing_timeout=timeout)
    pred = parse(str(completions), parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=timeout))


def _math_verify_timeout() -> int | None:
    """math-verify's timeouts use SIGALRM, which only a main thread can take: 5 s there (a
    pathological answer cannot stall the workers), none elsewhere."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_answer_key(text: str) -> str:
    """What ``math-verify`` extracts from ``text``, as a string: majority votes group by it."""
    from math_verify import parse

    parsed = parse(text, parsing_timeout=_math_verify_timeout())
    return str(parsed[-1]) if parsed else ""


BUILT_IN: dict[str, tuple[RewardFn, Callable[[str], str]]] = {
    "math": (math, math_answer_key),
    "exact_match": (exact_match, final_answer),
}
"""Built-in rewards with the key a majority vote groups answers by."""


def load_reward(name: str) -> tuple[RewardFn, Callable[[str], str]]:
    """A built-in reward, or a function by dotted path (``package.module.fn`` or
    ``package.module:fn``); answers of a user function are grouped by :func:`final_answer`."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module, _, attr = name.replace(":", ".").rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward function {name!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise ValueError(
            f"reward function {name!r} cannot be imported: not a built-in ({', '.join(BUILT_IN)}) "
            "nor a callable at a dotted path"
        )
    return fn, final_answer
