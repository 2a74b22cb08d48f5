"""The one pipeline: a CallPlan executed as stage -> sum -> settle -> write out.

Every call runs here, blocking or overlapped, through MPI or node memory, in
the caller's memory or in private staging:

- stage: each bucket's memory to sum, as the CallPlan's ``where`` says
  (nothing to do for the caller's memory, a pack into the bucket buffer or
  the results, a private copy);
- sum: the message runs handed to the CallPlan's backend, in launch order;
- settle: the mean and the finite check of every summed bucket (the backend
  calls the call's Settle when the memory is in cache);
- write out: results copied where the caller reads them, after verify and
  the row-sparse gradients, so that a private call writes nothing of the
  caller's before everything is summed.

A blocking call marks every gradient ready at once. An overlapped call
(``Reducer.start``) marks them as backward finishes them: a run is launched
once its buckets are complete and every run before it in launch order has
been launched, so all ranks issue the same messages in the same order
whatever order their gradients arrive in. A backend that sums everything at
once (node memory) and a private call (verify, on_failure="shrink") defer
every run to ``finish``.
"""

import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from .run_order import LaunchOrder
from .negotiate import CallPlan, Flags, Where
from .settle import Settle
from .sparse import reduce_sparse

__all__ = ["Pipeline"]


class Pipeline:
    """One call in flight: ``mark`` gradients ready, then ``finish``.

    Args:
        call: the call's CallPlan.
        comm: the Reducer's Communicator (row-sparse gathers, verify).
        settings: the Reducer's Settings (check_finite, verify, sparse).
    """

    def __init__(self, call: CallPlan, comm: Any, settings: Any) -> None:
        self.call = call
        self.comm = comm
        self.settings = settings
        entry, buffers = call.entry, call.entry.buffers
        self.grads = call.inputs.host
        self.outs: List[Any] = call.outs
        self.results = call.results
        buckets = entry.plan.buckets
        self.settle = Settle([b.dtype for b in buckets], buffers.starts, [b.size for b in buckets],
                             entry.limits if settings.check_finite else None,
                             call.divisor)
        self.summation = call.backend.start(overlapped=call.kind == Flags.START, wire=call.wire)
        self.summed_by: str = call.backend.name
        self.incremental = call.backend.incremental and not call.private
        # per bucket: (its memory to sum, what writes its results out after
        # or None, the memory its addend is read from where that differs or None)
        self.staged: List[Any] = [None] * len(buckets)
        self.order = LaunchOrder(call.runs, entry.bucket_of, [len(b.indices) for b in buckets],
                                 entry.plan.count)

    @property
    def measured(self) -> Dict[str, float]:
        """Each candidate backend's agreed time in ms, where one was chosen by
        measurement for this kind of call; else empty."""
        return {} if self.call.trial is None else self.call.trial.measured

    @property
    def finite(self) -> Optional[bool]:
        """With check_finite: every value of the call is finite (after finish)."""
        return self.settle.finite

    def mark(self, *indices: int) -> None:
        """Gradients ``indices`` are final (checked; local)."""
        self.order.mark(indices)

    def launch(self) -> None:
        """Launch every run that became complete; move the summation on."""
        if self.incremental:
            self._launch(complete_only=True)
            self.summation.progress()

    def finish(self) -> Any:
        """Sum what is left, settle, write out; return the results in the
        caller's structure and array kinds."""
        began = time.perf_counter()
        with np.errstate(all="ignore"):     # nan and inf propagate, as in the trainer
            self._launch(complete_only=False)
            self.summation.complete(self.settle)
            if self.call.beside is not None:        # check=False: before anything else
                self.call.beside.complete()
            if self.settings.verify:
                self.comm.verify_same([flat for flat, _, _ in self.staged], "reduced buckets")
            if self.call.entry.plan.sparse:        # new objects: nothing of the caller's
                reduce_sparse(self.comm, self.call.entry.plan, self.grads, self.outs,
                              self.call.divisor, self.settings, self.settle)
            for _, write_out, _ in self.staged:
                if write_out is not None:
                    write_out()
        if self.call.trial is not None:
            self.call.trial.record(self.call.backend, time.perf_counter() - began)
        return self.call.inputs.hand_back(self.outs, self.call.inplace)

    def _launch(self, complete_only: bool) -> None:
        """Stage and submit runs in launch order: with ``complete_only``, up to
        the first whose buckets are not all ready; else all. A blocking call
        stages every bucket before its first message (packing while a message
        is in flight only competes with it for the memory)."""
        due = self.order.due(complete_only)
        for first, last in due:
            for i in range(first, last + 1):
                self.staged[i] = self._stage(i)
        for first, last in due:
            staged = self.staged[first:last + 1]
            self.summation.submit(first, last, [flat for flat, _, _ in staged],
                                  [source for _, _, source in staged])

    def _stage(self, i: int) -> Any:
        """(bucket ``i``'s memory to sum, what writes its results out after or
        None, the memory its addend is read from where that differs or None)."""
        buffers, grads, outs, results = self.call.entry.buffers, self.grads, self.outs, self.results
        where = self.call.where[i]
        if where is Where.CALLER:
            own = buffers.own_memory(i, grads)
            return (buffers.arrays[i] if own is None else own), None, None
        if where is Where.APART:              # a plain reduce's, read out of the gradient
            assert results is not None
            return results.spans[i], None, buffers.own_memory(i, grads)
        if where is Where.RESULT:             # a plain reduce's
            assert results is not None
            target = results.spans[i]
            buffers.gather(i, grads, target)
            return target, None, None
        if where is Where.HALF:               # in half precision
            if results is not None and not buffers.half_results(i, results):
                return buffers.half_staged(i, grads, outs)    # results not back to back
            source = buffers.half_memory(i, grads)
            if results is None:               # in place: the gradient's own memory
                return (source, None, None) if source is not None else \
                    buffers.half_staged(i, grads, grads)
            target = results.spans[i]
            if source is None:
                buffers.gather(i, grads, target)
            return target, None, source
        if where is Where.BUFFER:
            flat = buffers.pack(i, grads)
            if results is None:
                return flat, lambda: buffers.unpack(i, outs), None
            return flat, lambda: buffers.unpack_new(i, outs, results), None
        # PRIVATE: the buffer holds the caller's gradients (its views)
        whole = buffers.held(i, grads) == len(self.call.entry.plan.buckets[i].indices)
        flat = (buffers.arrays[i] if whole else buffers.pack(i, grads)).copy()
        if results is not None:
            return flat, lambda: buffers.unpack_new(i, outs, results, flat), None
        return flat, _copy_back(flat, buffers.arrays[i], lambda: buffers.unpack(i, outs)), None


def _copy_back(flat: np.ndarray, buffer: np.ndarray,
               unpack: Callable[[], None]) -> Callable[[], None]:
    """Write a private copy's results into the bucket buffer, then into the gradients."""
    def write_out() -> None:
        buffer[...] = flat
        unpack()
    return write_out
