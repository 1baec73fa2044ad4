"""lamina.trace.order's integer sorts: the radix sort gives exactly numpy's stable order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from lamina.trace.order import RADIX_MIN_ROWS, argsort_ints, by_lead

INT64 = np.iinfo(np.int64)


def _cases(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Values of every width of range the radix sort cuts differently, with many ties."""
    return {
        "one value": np.full(n, -7, np.int64),
        "one digit": rng.integers(-300, 300, n),
        "two digits": rng.integers(0, 1 << 20, n),
        "three digits, negative": rng.integers(-(1 << 40), -(1 << 39), n),
        "full range": rng.integers(INT64.min, INT64.max, n, endpoint=True),
        "extremes": rng.choice(np.array([INT64.min, -1, 0, 1, INT64.max]), n),
        "sorted runs": np.concatenate([np.sort(rng.integers(0, 1 << 20, n // 7))
                                       for _ in range(7)]),
        "sorted runs, long keys": np.concatenate([np.sort(rng.integers(0, 1 << 60, n // 5))
                                                  for _ in range(5)]),
        "descending": np.arange(n, 0, -1, dtype=np.int64) // 3,
    }


@pytest.mark.parametrize("n", [0, 1, RADIX_MIN_ROWS - 1, RADIX_MIN_ROWS, 50_000])
def test_argsort_ints_is_numpys_stable_order(n: int) -> None:
    rng = np.random.default_rng(n)
    for name, case in _cases(rng, n).items():
        values = case.astype(np.int64)
        want = np.argsort(values, kind="stable")
        got = argsort_ints(values)
        assert got.dtype == want.dtype, name
        assert np.array_equal(got, want), name
        if len(values) and values.min() >= 0:
            unsigned = values.astype(np.uint64) + np.uint64(1 << 63)  # uint64 past 2^63
            assert np.array_equal(argsort_ints(unsigned),
                                  np.argsort(unsigned, kind="stable")), name


def test_by_lead_keeps_ties_in_order_and_copies_nothing_in_order() -> None:
    rng = np.random.default_rng(5)
    n = 3 * RADIX_MIN_ROWS
    lead = np.concatenate([np.sort(rng.integers(0, 100, n // 3)) for _ in range(3)])
    table = pa.table({"k": lead, "i": np.arange(n)})
    got = by_lead(table, "k")
    assert got.column("k").to_numpy().tolist() == sorted(lead.tolist())
    i = got.column("i").to_numpy()
    k = got.column("k").to_numpy()
    assert bool(np.all((k[1:] > k[:-1]) | (i[1:] > i[:-1])))  # equal leads: input order
    assert by_lead(got, "k") is got
