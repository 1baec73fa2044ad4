"""The log-event registry (lamina.events) is the one place for each event: every event the
daemon's code logs is registered with the level it is logged at and the module that logs it,
nothing registered is dead, and docs/operations.md shows exactly the registry's table."""

from __future__ import annotations

import ast
from pathlib import Path

from lamina import events

SRC = Path(__file__).resolve().parents[1] / "src" / "lamina"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
LEVELS = {"debug": "debug", "info": "info", "warning": "warning", "error": "error",
          "exception": "error"}
STEP_KINDS = ("conversion", "merge")
"""What ``{kind}`` in an f-string event name stands for (the steps that retry, get
cancelled or re-planned)."""
BEGIN, END = "<!-- events:begin -->", "<!-- events:end -->"


def _names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        literal = "".join(v.value for v in node.values
                          if isinstance(v, ast.Constant) and isinstance(v.value, str))
        return [kind + literal for kind in STEP_KINDS]
    return []


def logged() -> set[tuple[str, str, str]]:
    """(event, level, logger) of every structlog call in the daemon's modules."""
    out = set()
    for path in [*(SRC / "compacter").rglob("*.py"), *(SRC / "service").rglob("*.py")]:
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and node.args):
                continue
            target = node.func.value
            if not (isinstance(target, ast.Name) and target.id in ("log", "bound")):
                continue
            for name in _names(node.args[0]):
                if "." in name and " " not in name:
                    out.add((name, LEVELS[node.func.attr], module))
    return out


def test_every_logged_event_is_registered_with_its_level_and_logger() -> None:
    found = logged()
    assert len(found) > 30
    wrong = sorted((name, level, module) for name, level, module in found
                   if (events.BY_NAME.get(name) is None
                       or events.BY_NAME[name].level != level
                       or events.BY_NAME[name].logger != module))
    assert not wrong, f"logged but not registered as such (name, level, logger): {wrong}"


def test_nothing_registered_is_dead() -> None:
    names = {name for name, _, _ in logged()}
    assert not [e.name for e in events.EVENTS if e.name not in names]
    assert len(events.BY_NAME) == len(events.EVENTS)


def test_operations_doc_shows_the_registry() -> None:
    text = DOCS.read_text()
    assert BEGIN in text
    assert END in text
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip() + "\n"
    assert shown == events.table(), "docs/operations.md's event table is stale: " \
        "paste lamina.events.table() between its markers"
