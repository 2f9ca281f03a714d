"""The suite's own layout: pytest (rootdir import mode) cannot collect two test modules of one basename."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)
    repeated = sorted(name for name, count in names.items() if count > 1)
    assert repeated == [], f"test modules sharing a basename (pytest cannot collect both): {repeated}"
