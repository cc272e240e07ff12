"""Selecting modules by name or `re:` regex, as recipes write them.

A plain target matches a module whose name is the target or ends in `.target` (`q_proj` matches
`model.layers.0.self_attn.q_proj`); `re:PATTERN` matches names that the regex fully matches.
"""

from __future__ import annotations

import difflib
import re

from compress.registry import StepError


def matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.fullmatch(target[3:], name) is not None
    return name == target or name.endswith("." + target)


def select(module_names: list[str] | None, targets: list[str], field: str = "targets") -> list[str]:
    """Names matched by any target; StepError when a target matches nothing (with close names).
    With `module_names` None (the model is not at hand yet) only the regexes are checked."""
    for target in targets:
        if target.startswith("re:"):
            try:
                re.compile(target[3:])
            except re.error as e:
                raise StepError(f"{field}: {target!r} is not a valid regex ({e})") from None
        if module_names is None:
            continue
        if not any(matches(n, target) for n in module_names):
            leaves = sorted({n.rsplit(".", 1)[-1] for n in module_names})
            close = difflib.get_close_matches(target.removeprefix("re:"), leaves, n=5, cutoff=0.4)
            hint = (
                f"close names: {', '.join(close)}"
                if close
                else f"module names end in: {', '.join(leaves[:12])}"
            )
            raise StepError(f"{field}: {target!r} matches no module of this model; {hint}")
    return [n for n in module_names or [] if any(matches(n, t) for t in targets)]


def as_peft_regex(targets: list[str]) -> str:
    """One regex for PEFT's `target_modules` (a string is matched in full against module names)."""
    parts = [t[3:] if t.startswith("re:") else rf"(.*\.)?{re.escape(t)}" for t in targets]
    return "|".join(f"(?:{p})" for p in parts)
