"""The engine's descriptor table against a dict, the structure it replaced."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idlekeeper.fdtable import FdTable

# Steps: hold a descriptor (with a fresh item), free it by its holder, free it by
# a stranger (which must do nothing), look one up.
_steps = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "remove-other", "get"]), st.integers(min_value=0, max_value=40)),
    max_size=200,
)


@given(_steps, st.integers(min_value=0, max_value=10))
def test_the_table_holds_what_a_dict_would(steps: list[tuple[str, int]], reserve: int) -> None:
    table: FdTable[object] = FdTable(reserve=reserve)
    model: dict[int, object] = {}
    for op, fd in steps:
        if op == "add":
            item = object()
            if fd in model:
                with pytest.raises(ValueError, match="held already"):
                    table.add(fd, item)
            else:
                table.add(fd, item)
                model[fd] = item
        elif op == "remove":
            holder = model.pop(fd, None)
            assert table.remove(fd, holder if holder is not None else object()) is (holder is not None)
        elif op == "remove-other":
            assert table.remove(fd, object()) is False
        else:
            assert table.get(fd) is model.get(fd)
        assert len(table) == len(model)
        assert table.values() == [model[k] for k in sorted(model)]
        # The engine's pass indexes the slots directly: every held descriptor has one,
        # and so does every reserved one.
        assert len(table.slots) >= max([reserve, *(k + 1 for k in model)])
        assert all(table.slots[k] is v for k, v in model.items())


def test_a_negative_descriptor_is_refused_and_never_found() -> None:
    table: FdTable[str] = FdTable(reserve=4)
    with pytest.raises(ValueError, match="not a descriptor"):
        table.add(-1, "x")
    assert table.get(-1) is None
    assert table.remove(-1, "x") is False
    assert len(table) == 0


def test_the_slots_never_shrink() -> None:
    table: FdTable[str] = FdTable()
    table.add(30, "a")
    table.remove(30, "a")
    assert len(table.slots) == 31
    assert table.get(30) is None
    assert table.values() == []
