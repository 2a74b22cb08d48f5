"""The one op table and the one op x dtype check, for every face.

A face spells its ops its own way (torch's ``ReduceOp.AVG``, Horovod's
``hvd.Average``, a metric's ``"mean"``) and maps them onto the names of
``OPS``; what an op does with a dtype is decided here, once. Where faces
differ on purpose (torch refuses the mean of integers, as gloo does, where
Horovod floors it and a metric gives floats), the difference is a field of
the face's ``Rules``, not a check of its own.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, Tuple

import numpy as np

__all__ = ["Op", "OPS", "Rules", "TABLE", "TORCH", "HOROVOD", "METRICS", "check_op",
           "identity", "mpi_op"]


@dataclass(frozen=True)
class Op:
    """One reduction op.

    Args:
        name: its name in the table (what a Collective's ``op`` holds).
        mpi: the MPI op the data is reduced by ("sum" for the mean: the one
            mean is applied after, mpigrad._engine.settle).
        floating: whether it takes floating-point values (complex: see
            ``complex``).
        complex: whether it takes complex values.
        integers: whether it takes integers.
    """

    name: str
    mpi: str
    floating: bool = True
    complex: bool = True
    integers: bool = True


OPS: Dict[str, Op] = {op.name: op for op in (
    Op("sum", "sum"),
    Op("mean", "sum"),
    Op("max", "max", complex=False),
    Op("min", "min", complex=False),
    Op("prod", "prod", complex=False),
    Op("band", "band", floating=False, complex=False),
    Op("bor", "bor", floating=False, complex=False),
    Op("bxor", "bxor", floating=False, complex=False),
)}


@dataclass(frozen=True)
class Rules:
    """What a face offers of the table, and how it spells it.

    Args:
        ops: the table's ops the face offers.
        bool_ops: the ops that take bool arrays.
        integer_mean: the mean of integers: "refuse" (TypeError), "float"
            (float64 results) or "trunc" (divided, then cast toward zero:
            integer results, as Horovod's).
        spelled: the face's name of each op, for its messages.
    """

    ops: Tuple[str, ...]
    bool_ops: FrozenSet[str]
    integer_mean: str
    spelled: Dict[str, str] = field(default_factory=dict)

    def name(self, op: str) -> str:
        """The face's spelling of ``op``."""
        return self.spelled.get(op, op)


#: what the table itself allows (every request is checked against it in its agreement,
#: whatever its face checked before): bools take every op, integer means are exact
TABLE = Rules(tuple(OPS), frozenset(OPS), "float")
#: torch.distributed's ReduceOp, as gloo takes it
TORCH = Rules(tuple(OPS), frozenset({"max", "min", "band", "bor", "bxor"}), "refuse",
              {"sum": "SUM", "mean": "AVG", "max": "MAX", "min": "MIN", "prod": "PRODUCT",
               "band": "BAND", "bor": "BOR", "bxor": "BXOR"})
#: Horovod's ops (its Adasum is a pairwise exchange of its own, not a table op)
HOROVOD = Rules(("mean", "sum", "min", "max", "prod"), frozenset({"max", "min", "prod"}),
                "trunc", {"sum": "hvd.Sum", "mean": "hvd.Average", "max": "hvd.Max",
                          "min": "hvd.Min", "prod": "hvd.Product"})
#: a metric's allreduce (mpigrad.allreduce, mpigrad.jax.allreduce): bools are counted
METRICS = Rules(("sum", "mean", "max", "min"), frozenset({"sum", "mean", "max", "min"}),
                "float")


def check_op(op: str, dtypes: Iterable[Any], what: str, rules: Rules) -> Op:
    """The table's ``op`` for arrays of ``dtypes`` under a face's ``rules``;
    ValueError for an op the face does not offer, TypeError for a dtype the
    op does not take (naming what to use instead)."""
    if op not in rules.ops:
        offered = ", ".join(rules.name(o) for o in rules.ops)
        raise ValueError(f"{what}: expecting one of the ops {offered}, got {rules.name(op)!r}")
    entry = OPS[op]
    spelled = rules.name(op)
    for dtype in dict.fromkeys(dtypes):     # each dtype once, in order (calls have hundreds)
        dtype = np.dtype(dtype)
        kind = dtype.kind
        if kind == "V" and dtype.name == "bfloat16":       # (dtype.name costs: asked last)
            kind = "f"
        if kind == "b":
            if op not in rules.bool_ops:
                raise TypeError(f"{what}: {spelled} of bool arrays is not defined here: "
                                f"expecting {rules.name('max')} (any) or {rules.name('min')} "
                                "(all), or cast to an integer dtype to count")
        elif kind in "iu":
            if op == "mean" and rules.integer_mean == "refuse":
                raise TypeError(f"{what}: {spelled} needs floating-point arrays, got "
                                f"{dtype.name}: use {rules.name('sum')} and divide")
            if not entry.integers:
                raise TypeError(f"{what}: {spelled} needs floating-point arrays, got "
                                f"{dtype.name}")
        elif kind == "c":
            if not entry.complex:
                raise TypeError(f"{what}: {spelled} of complex values is not defined")
        elif kind == "f":
            if not entry.floating:
                raise TypeError(f"{what}: {spelled} needs integer or bool arrays, got "
                                f"{dtype.name}")
        else:
            raise TypeError(f"{what}: expecting numeric or bool arrays, got {dtype.name}")
    return entry


def mpi_op(op: str) -> str:
    """The MPI op the data of a table ``op`` is reduced by."""
    return OPS[op].mpi


def identity(op: str, dtype: Any) -> Any:
    """The value of ``dtype`` that leaves a reduction by ``op`` unchanged (a
    rank that takes part without data of its own: Horovod's joined ranks)."""
    dtype = np.dtype(dtype)
    mpi = OPS[op].mpi
    if mpi in ("min", "max"):
        if dtype.kind == "b":
            return dtype.type(mpi == "min")
        if dtype.kind in "iu":
            limits = np.iinfo(dtype)
            return dtype.type(limits.max if mpi == "min" else limits.min)
        return dtype.type(np.inf if mpi == "min" else -np.inf)
    if mpi == "band":
        return dtype.type(-1 if dtype.kind == "i" else np.iinfo(dtype).max) \
            if dtype.kind in "iu" else dtype.type(True)
    return dtype.type(1 if mpi == "prod" else 0)
