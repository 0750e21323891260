"""The order of the tests, for pytest-xdist (scripts/test.sh runs one worker
per core): a long test that starts last keeps one worker busy while the others
have nothing left to run. The programs of test_examples.py (up to minutes
each) start first, then the other tests marked slow, then the rest, each group
in collection order."""

from __future__ import annotations


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        if item.module.__name__ == "test_examples":
            return 0
        return 1 if item.get_closest_marker("slow") is not None else 2

    items.sort(key=rank)
