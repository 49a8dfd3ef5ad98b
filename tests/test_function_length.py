"""No function in polychip/ is longer than 60 lines (DESIGN.md's standard); the measure is
tests/function_lengths.py's (decorators excluded, docstring included)."""
from __future__ import annotations

import textwrap

import pytest

from function_lengths import lengths
from test_layers import REPO

pytestmark = pytest.mark.device_independent   # runs no device (conftest.py)

LIMIT = 60


def test_no_function_in_the_package_is_longer_than_the_limit():
    over = sorted((n, where) for n, where in lengths(REPO) if n > LIMIT)
    assert over == [], f"split these (over {LIMIT} lines): {over}"


def test_the_measure_counts_a_function_from_def_to_its_last_line(tmp_path):
    (tmp_path / "polychip").mkdir()
    (tmp_path / "polychip/m.py").write_text(textwrap.dedent('''
        @decorated
        def f(x):
            """doc"""
            y = x + 1
            return y

        class C:
            async def g(self):
                return 1
    '''))
    assert sorted(lengths(tmp_path)) == [(2, "polychip/m.py:9 g"), (4, "polychip/m.py:3 f")]
