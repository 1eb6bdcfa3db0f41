"""Params no optimizer sees: a low-bit Linear's state kept among its params
(delayed scaling's amax histories, a 4-bit Linear's Hadamard signs), each
written over by its "gradient" in the train step (flax's "overwrite with
gradient"), so they live in the TrainState and are checkpointed with the
params. `split_meta` takes them out of a params tree, `merge_meta` puts them
back."""

from typing import Any, Mapping

# A delayed-scaling Linear's amax histories (float32 [history_length]): its
# input `x`, its weight `w` and its output gradient `g`.
HISTORY_NAMES = ('fp8_x_amax_history', 'fp8_w_amax_history',
                 'fp8_g_amax_history')
# A 4-bit Linear's Hadamard signs (`fp4.matmul`): state like the histories,
# its "gradient" itself, so the overwrite keeps it.
FP4_SIGNS = 'fp4_hadamard_signs'
# Every param no optimizer sees, written over by its "gradient".
META_NAMES = HISTORY_NAMES + (FP4_SIGNS,)


def split_meta(tree: Mapping[str, Any]) -> tuple[dict, dict]:
  """(the amax histories, everything else) of a params tree (or one of the
  same structure: gradients, shardings), each a nested dict without empty
  branches. Any nesting of mappings: Haiku's two levels, or a flat dict."""
  meta, rest = {}, {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      sub_meta, sub_rest = split_meta(value)
      if sub_meta:
        meta[key] = sub_meta
      if sub_rest or not sub_meta:
        rest[key] = sub_rest
    elif key in META_NAMES:
      meta[key] = value
    else:
      rest[key] = value
  return meta, rest


def merge_meta(rest: Mapping[str, Any], meta: Mapping[str, Any]) -> dict:
  """`split_meta` undone: `rest` with `meta`'s leaves put back."""
  merged = dict(rest)
  for key, value in meta.items():
    if isinstance(value, Mapping):
      merged[key] = merge_meta(rest.get(key, {}), value)
    else:
      merged[key] = value
  return merged
