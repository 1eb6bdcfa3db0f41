"""Ratios of measured rows to a base row of the same run.

Every comparison in the lab and the benchmark is a ratio within one run (the
machines are shared; a ratio measured side by side holds, an absolute time
does not), so they all go through `add_ratios`.
"""

from typing import Any, Callable, Optional, Sequence

Row = dict[str, Any]


def ratios(row: Row, base: Row, fields: Sequence[str]) -> dict[str, float]:
  """`row[f] / base[f]` for every field both have (and base's is non-zero)."""
  return {f: row[f] / base[f] for f in fields
          if base.get(f) and row.get(f) is not None}


def add_ratios(rows: list[Row], name: str, fields: Sequence[str],
               is_base: Callable[[Row], bool],
               same_group: Callable[[Row, Row], bool] = lambda a, b: True,
               values: Callable[[Row], Row] = lambda row: row) -> None:
  """Sets `row[name]` to the row's ratios to the base row of its group.

  The base is the first row with `is_base` in the same group; `values` picks
  the dict the fields are read from. Rows with no base get None.
  """
  for row in rows:
    base: Optional[Row] = next(
        (b for b in rows if is_base(b) and same_group(b, row)), None)
    row[name] = base and ratios(values(row), values(base), fields)
