"""What every reduction through MPI shares: its arrays packed per message
dtype (half precision as float32, bools as their message dtype, Horovod's
prescale applied), and each result settled: the one mean
(mpigrad._engine.settle), the postscale, and the cast back into the output's
dtype."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._base.dtypes import assign, message_dtype
from .._engine.settle import mean_factor, rescaled, settle
from .spec import Collective

__all__ = ["Message", "Layout", "layout", "messages", "factor_of", "settled"]

#: one message of a reduction: its dtype, the positions of the arrays it holds, its memory
Message = Tuple[np.dtype, List[int], np.ndarray]
#: a reduction's messages: each one's dtype and the positions of the arrays it holds
Layout = List[Tuple[np.dtype, List[int]]]


def layout(spec: Collective) -> Layout:
    """``spec``'s messages: each message dtype (in the order first seen) and
    the positions of the sends it holds (the same for every call of a
    signature)."""
    grouped: Dict[np.dtype, List[int]] = {}
    for i, a in enumerate(spec.sends):
        grouped.setdefault(message_dtype(a.dtype, spec.op), []).append(i)
    return list(grouped.items())


def messages(spec: Collective, as_is: bool, known: Optional[Layout] = None) -> List[Message]:
    """``spec``'s sends packed into one flat message per message dtype (its
    ``layout``, or the one ``known``), prescaled; where ``as_is`` and a
    message would hold one array of its own dtype unscaled, that array
    itself (not a copy)."""
    out: List[Message] = []
    for wire, members in (layout(spec) if known is None else known):
        alone = len(members) == 1 and spec.sends[members[0]].dtype == wire
        if as_is and alone and spec.prescale == 1.0:
            flat = spec.sends[members[0]].reshape(-1)
        else:
            flat = np.empty(sum(spec.sends[i].size for i in members), wire)
            offset = 0
            for i in members:
                send = spec.sends[i].reshape(-1)
                part = flat[offset:offset + send.size]
                if spec.prescale != 1.0:
                    send = rescaled(send, spec.prescale, integer=send.dtype.kind in "iub")
                assign(part, send)
                offset += send.size
        out.append((wire, members, flat))
    return out


def factor_of(spec: Collective, dtype: np.dtype, divisor: int) -> Any:
    """What a floating-point reduction of ``dtype`` (its message dtype) is multiplied
    by: the mean's factor over ``divisor`` ranks for op "mean" (the engine's one
    mean) times ``spec.postscale``, in the real dtype; None where it is 1."""
    factor = mean_factor(dtype, divisor) if spec.op == "mean" else None
    if spec.postscale != 1.0:
        factor = np.finfo(dtype).dtype.type((1.0 if factor is None else factor)
                                            * spec.postscale)
    return factor


def settled(summed: np.ndarray, outs: Sequence[np.ndarray], spec: Collective,
            divisor: int) -> None:
    """Write the reduction ``summed`` (one message: the outputs' values end to
    end, in its message dtype) into ``outs``: the mean over ``divisor`` ranks
    for op "mean" (floating point: times its factor, the engine's one mean;
    integers: divided exactly, cast toward zero into integer outputs, as
    Horovod's),
    times ``spec.postscale``, cast to each output's dtype."""
    mean = spec.op == "mean"
    if summed.dtype.kind in "fc":
        settle(summed, factor_of(spec, summed.dtype, divisor))
        values = summed
    else:
        values = summed
        if mean and divisor != 1:
            integer = all(out.dtype.kind in "iub" for out in outs)
            values = rescaled(summed, divisor=divisor, integer=integer)
        if spec.postscale != 1.0:
            values = rescaled(values, spec.postscale, integer=outs[0].dtype.kind in "iub")
    offset = 0
    for out in outs:
        flat = out.reshape(-1)
        part = values[offset:offset + flat.size]
        offset += flat.size
        if flat is part or np.shares_memory(flat, part):
            continue
        if flat.dtype == np.bool_:
            flat[...] = part != 0
        else:
            assign(flat, part)
