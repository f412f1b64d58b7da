"""Stopping a run cleanly: on SIGTERM / SIGINT or when `train.max_runtime` runs out.

A scheduler preempts a job with SIGTERM (SLURM: then SIGKILL after KillWait, 30 s by default);
a user presses Ctrl-C. Either way the trainer finishes the step in flight, saves a checkpoint,
waits for it and exits 0, so a requeued job resumes where this one stopped. The first signal
puts back the default handlers, so a second one ends the process at once (the last complete
checkpoint stays the one a restart restores: orbax commits a save by renaming its folder).

In a multi-process job a signal may reach only some processes, and a deadline may pass a step
earlier on one host than on another; a process that stopped alone would leave the others
waiting forever in the next collective. The processes therefore agree: every step each one
contributes its flag to a one-int all-reduce, dispatched after its train step and read one
step later, when that step's metrics are read anyway (the host does not wait for the device
more than before). All processes read the same value at the same step, so all stop after the
same step. One process needs no agreement and stops after the step in flight.
"""
from __future__ import annotations

import signal
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_early_signal: list[str] = []  # a signal `catch_early` remembered, not yet taken by a StopRequest


def catch_early() -> None:
    """From now until a StopRequest is installed, SIGTERM / SIGINT are remembered instead of
    ending the process: train.py calls this first (this module loads no jax at import), so a
    job preempted while it imports, loads data, builds or restores exits 0 before its first
    step, with nothing lost. A second signal still ends it at once."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _remember)


def release_early() -> None:
    """Back to Python's own handlers, for a command that does not train (a dry run, a sharding
    inspection): a signal `catch_early` remembered is delivered now, later ones as usual."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _early_signal:
        signal.raise_signal(signal.Signals[_early_signal.pop(0)])


def _remember(signum, frame) -> None:
    del frame
    _early_signal.append(signal.Signals(signum).name)
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


class StopRequest:
    """`poll()` once per step, after dispatching it: True when the run should stop after it.

    The signal handlers live between `install()` and `uninstall()`, and only on the main
    thread (the one Python delivers signals to)."""

    def __init__(self, max_runtime_s: float = 0.0, started: float | None = None):
        self.deadline = (started or time.monotonic()) + max_runtime_s if max_runtime_s else None
        self.signal_name: str | None = None
        self._previous: dict = {}
        self._agree = None  # the processes' agreement, made at the first poll (it compiles)

    def install(self) -> "StopRequest":
        if _early_signal:  # signalled while starting: the default handlers are back already
            self.signal_name = _early_signal.pop(0)
            return self
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            # None: a handler installed outside Python, which Python cannot put back.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        del frame
        self.signal_name = signal.Signals(signum).name
        for sig in SIGNALS:  # a second signal: the default action, now
            signal.signal(sig, signal.SIG_DFL)

    def local(self) -> bool:
        """This process wants to stop (a signal, or the deadline passed)."""
        return self.signal_name is not None or (
            self.deadline is not None and time.monotonic() >= self.deadline)

    def poll(self) -> bool:
        """Whether every process stops after the step just dispatched (the same answer on all
        processes: with several, it is the agreed flag of one step earlier)."""
        import jax
        if jax.process_count() == 1:
            return self.local()
        if self._agree is None:
            self._agree = _Agreement()
        return self._agree(self.local())

    def before_start(self) -> bool:
        """Whether to stop before the first step: a signal came while the run started (a
        deadline that passed then still gets its step and checkpoint). Agreed by a blocking
        all-gather, as no step is in flight to hide it behind."""
        import jax
        signalled = self.signal_name is not None
        if jax.process_count() == 1:
            return signalled
        import numpy as np
        from jax.experimental import multihost_utils
        return bool(np.any(multihost_utils.process_allgather(np.asarray(signalled))))

    def reason(self) -> str:
        if self.signal_name is not None:
            return f"{self.signal_name} received"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "train.max_runtime reached"
        return "another process was asked to stop"


class _Agreement:
    """The max over all processes of a per-process flag, one step late (see the module doc)."""

    def __init__(self):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        # Over every device, like the train step: a program on a subset of them (one device per
        # process) let gloo match its all-reduce with a train-step collective on CPU
        # ("Received data size doesn't match expected size").
        mesh = Mesh(np.asarray(jax.devices()), ("devices",))
        self._sharding = NamedSharding(mesh, P("devices"))
        self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
        self._local_devices = jax.local_device_count()
        self._pending = None

    def __call__(self, flag: bool) -> bool:
        import jax
        import numpy as np
        flags = jax.make_array_from_process_local_data(
            self._sharding, np.full((self._local_devices,), int(flag), np.int32))
        previous, self._pending = self._pending, self._reduce(flags)
        return previous is not None and bool(previous)
