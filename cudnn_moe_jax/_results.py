"""Result object of every op: unpacks like a tuple (cuDNN key order), indexes like a dict, is a JAX pytree."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import jax
import jax.export


class OpResult:
    """Ordered mapping of output name -> array (or None when the op does not produce that output).

    `d, d_col, amax, sfd_row, sfd_col = grouped_gemm_quant(...)` unpacks in cuDNN's key order;
    `out["d_tensor"]`, `out.d_tensor` and `out[1]` all work. Registered as a pytree, so it crosses `jax.jit`.
    """

    __slots__ = ("_keys", "_values")

    def __init__(self, keys: Sequence[str], values: Sequence[Any]):
        if len(keys) != len(values):
            raise ValueError("keys and values differ in length")
        object.__setattr__(self, "_keys", tuple(keys))
        object.__setattr__(self, "_values", tuple(values))

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def items(self):
        return tuple(zip(self._keys, self._values))

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __getitem__(self, key):
        if isinstance(key, (int, slice)):
            return self._values[key]
        try:
            return self._values[self._keys.index(key)]
        except ValueError:
            raise KeyError(f"{key!r}; this result has {self._keys}") from None

    def get(self, key, default=None):
        return self[key] if key in self._keys else default

    def __getattr__(self, name):
        if name.startswith("_"):  # slots not set yet (copy/pickle build the object without __init__)
            raise AttributeError(name)
        if name in self._keys:
            return self._values[self._keys.index(name)]
        raise AttributeError(f"{name!r}; this result has {self._keys}")

    def __setattr__(self, name, value):
        raise AttributeError("OpResult is immutable")

    def __reduce__(self):  # copy, deepcopy and pickle rebuild through __init__
        return (OpResult, (self._keys, self._values))

    def __repr__(self) -> str:
        def describe(v):
            return "None" if v is None else f"{getattr(v, 'dtype', type(v).__name__)}{list(getattr(v, 'shape', ()))}"

        return "OpResult(" + ", ".join(f"{k}={describe(v)}" for k, v in self.items()) + ")"


jax.tree_util.register_pytree_node(
    OpResult,
    lambda r: (r._values, r._keys),
    lambda keys, values: OpResult(keys, tuple(values)),
)

# Results can be the output of a `jax.export`-ed function: teach export to (de)serialize the key tuple.
jax.export.register_pytree_node_serialization(
    OpResult,
    serialized_name="cudnn_moe_jax.OpResult",
    serialize_auxdata=lambda keys: ",".join(keys).encode(),
    deserialize_auxdata=lambda data: tuple(data.decode().split(",")),
)
