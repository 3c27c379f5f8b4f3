"""One vocabulary: no state or outcome is a bare string outside ``vocab`` (read with ast).

A word of the lifecycle and its outcomes (an engine's state, an operation's or a part's
status, a migration's outcome and steps, a fleet kind) used as a value in code is a member of
its ``vocab`` enum, so a misspelt one is an error where it is written, not a branch that
never runs. The check finds such words where code decides or records with them: compared
(``==``, ``!=``, ``in``, ``case``), returned, or given to (or assigned as) a field named
state, status, outcome, step or kind. Prose and key names that happen to be spelt alike (a
drill report's ``lost`` count) are not decisions and are not counted.
"""

from __future__ import annotations

import ast

from ckpt_controller import vocab as v
from support import ROOT

#: the enums whose words must not be written as bare strings
WORDS = frozenset(m.value for e in (v.CheckpointState, v.OutcomeStatus, v.OperationStatus,
                                    v.PartStatus, v.MigrationOutcome, v.MigrationStep,
                                    v.FleetKind, v.OperationKind, v.Trigger)
                  for m in e)
#: fields whose values are words of the vocabulary
FIELDS = frozenset({"state", "status", "outcome", "step", "kind", "trigger", "source", "dest"})


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def literals(source: str) -> list[tuple[int, str]]:
    """(line, word) of every vocabulary word used as a bare string where code decides or
    records with it."""
    found = []

    def words_in(node: ast.AST | None) -> None:
        if node is None:
            return
        keys = set()  # a key's name (``d["lost"]``, ``d.get("state")``) is no value
        for sub in ast.walk(node):
            if isinstance(sub, ast.JoinedStr):
                return  # a message, not a value
            if isinstance(sub, ast.Subscript):
                keys.add(id(sub.slice))
            if isinstance(sub, ast.Call) and _name(sub.func) in ("get", "pop") and sub.args:
                keys.add(id(sub.args[0]))
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str) \
                    and sub.value in WORDS and id(sub) not in keys:
                found.append((sub.lineno, sub.value))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for part in (node.left, *node.comparators):
                words_in(part)
        elif isinstance(node, ast.match_case):
            words_in(node.pattern)
        elif isinstance(node, ast.Return):
            if isinstance(node.value, (ast.Constant, ast.Tuple, ast.IfExp)):
                words_in(node.value)
        elif isinstance(node, ast.keyword) and node.arg in FIELDS:
            words_in(node.value)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_name(t) in FIELDS for t in targets):
                words_in(node.value)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value in FIELDS:
                    words_in(value)
    return sorted(set(found))


def test_no_state_or_outcome_is_a_bare_string_outside_vocab():
    hits = [f"{path.relative_to(ROOT)}:{line}: {word!r}"
            for path in sorted((ROOT / "ckpt_controller").rglob("*.py"))
            if path.name != "vocab.py"
            for line, word in literals(path.read_text())]
    assert hits == []


def test_the_check_finds_each_kind_of_use():
    """Each use the check looks for, in code written for the test, is found; a message
    and a key spelt alike are not."""
    code = '''
if op.status == "running": pass
if part.status in ("failed", "lost"): pass
match end.step:
    case "receive": pass
def f():
    return "moved"
Part(status="pending")
mig.outcome = "stayed"
doc = {"state": "prepared", "lost": 3}
log.info(f"{x} failed")
total = {k: 0 for k in ("sent", "lost")}
ok = total["lost"] == 0 and reply.get("succeeded")
'''
    assert [w for _, w in literals(code)] == ["running", "failed", "lost", "receive",
                                              "moved", "pending", "stayed", "prepared"]
