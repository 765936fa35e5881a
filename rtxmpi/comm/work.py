"""`Work`: the handle of an asynchronous collective (Horovod / torch.distributed style)."""

SPIN_POLLS = 64  # polls of a shared-memory completion in wait() before the deadline-aware wait


class Work:
    """Handle of a collective started with `async_op=True`.

    `wait(timeout_s=None)` blocks until the operation completes and returns its result (the
    reduced input array, or the new output array); past the deadline (the group's `timeout_s`
    unless given) it raises CollectiveTimeout on every waiting rank. `test()` returns True once the
    operation has completed and never blocks. Results are valid only after `wait()` or a True
    `test()`; until then the input array must not be read or written.
    """

    __slots__ = ("group", "op", "seq", "_requests", "_finish", "_keep", "_result", "_done", "_span")

    def __init__(self, group, op, seq, requests, finish, keep=None):
        """keep: objects whose memory MPI reads or writes until the requests complete (send and
        receive buffers); held here so they cannot be freed and reused while in flight."""
        self.group, self.op, self.seq = group, op, seq
        self._requests = requests
        self._finish = finish
        self._keep = keep
        self._result = None
        self._done = False
        self._span = None  # (start_s, args) while traced (rtxmpi.comm.traced)

    def _complete(self):
        self._done = True
        self._requests = None
        self._result = self._finish()
        self._finish = self._keep = None
        return self._result

    def test(self):
        """True when the operation has completed (runs its completion step); never blocks."""
        if self._done:
            return True
        if self.group.backend.test(self._requests):
            self._complete()
            return True
        return False

    def wait(self, timeout_s=None):
        """Block until done; return the result. Raises CollectiveTimeout past the deadline."""
        if not self._done:
            requests = self._requests
            if callable(requests) and not getattr(requests, "no_spin", False):  # a shared-memory
                # poll: the peers are usually microseconds away (a recv's poll waits for MPI
                # messages, whose progress needs the core the spin would hold)
                for _ in range(SPIN_POLLS):
                    if requests():
                        return self._complete()
            self.group.backend.wait(
                self._requests, op=self.op, seq=self.seq,
                timeout_s=self.group.timeout_s if timeout_s is None else float(timeout_s))
            self._complete()
        return self._result

    def is_completed(self):
        return self._done

    def then(self, fn):
        """Make the result fn(result): at completion, or now when already done. Returns self."""
        if self._done:
            self._result = fn(self._result)
        else:
            finish = self._finish
            self._finish = lambda: fn(finish())
        return self

    @property
    def result(self):
        """The result once completed (None before)."""
        return self._result

    def __repr__(self):
        state = "done" if self._done else "pending"
        return f"<Work {self.op} #{self.seq} on '{self.group.name}' {state}>"


class CompletedWork(Work):
    """A Work whose operation already finished (host-staged device arrays, single rank)."""

    __slots__ = ()

    def __init__(self, group, op, seq, result):
        super().__init__(group, op, seq, None, None)
        self._done = True
        self._result = result
