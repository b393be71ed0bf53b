"""bench/overrides.py: the module constants a GPU run sets from its command line (a flag checked
or timed before it turns on) take the literal, go back exactly, and a misspelt name stops the run
by name."""

import pytest

from bench.overrides import restore, set_constants
from k3serve.ops import moe_triton


def test_constants_are_set_from_literals_and_restored():
    before = (moe_triton.GLUON_DECODE_ROWS, moe_triton.GLUON_PREFILL)
    saved = set_constants("k3serve.ops.moe_triton.GLUON_DECODE_ROWS=16, k3serve.ops.moe_triton.GLUON_PREFILL=False")
    assert (moe_triton.GLUON_DECODE_ROWS, moe_triton.GLUON_PREFILL) == (16, False)
    assert moe_triton.row_block(16, 896, True, True) == 16  # the code reads the constant at call time
    restore(saved)
    assert (moe_triton.GLUON_DECODE_ROWS, moe_triton.GLUON_PREFILL) == before


def test_a_misspelt_constant_stops_the_run():
    with pytest.raises(SystemExit, match="GLUON_DECODE_ROW"):
        set_constants("k3serve.ops.moe_triton.GLUON_DECODE_ROW=16")
    assert set_constants("") == []
