"""``slow_tests.txt`` names tests that exist: a renamed or deleted test would otherwise leave a stale line behind, and
a renamed one would silently join the default selection again."""
import ast
import os

from tests.conftest import SLOW_TESTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _test_functions(path: str) -> set[str]:
    """``name`` and ``Class::name`` of every function the test file defines (a node id's part before any ``[``)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef))
    return names


def test_every_listed_slow_test_exists():
    assert SLOW_TESTS
    missing = []
    for node_id in sorted(SLOW_TESTS):
        path, _, rest = node_id.partition("::")
        name = rest.split("[", 1)[0]
        if not os.path.isfile(os.path.join(ROOT, path)) or name not in _test_functions(path):
            missing.append(node_id)
    assert not missing, f"slow_tests.txt names tests that do not exist: {missing}"


def test_a_renamed_test_is_caught():
    """The check itself fails on a name the file does not define."""
    assert "test_every_listed_slow_test_exists" in _test_functions("tests/test_slow_list.py")
    assert "test_no_such_test" not in _test_functions("tests/test_slow_list.py")
