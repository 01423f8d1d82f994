"""CUDA streams: which stream hora's data-plane work runs on, and how it is ordered with the user's streams.

A CUDA collective crosses threads and streams three times: the caller produces the tensor on its current
stream (the autograd thread's stream during backward), the thread that ran the negotiation round launches the
collective, and the caller reads the result in ``synchronize()``, on whatever stream is current then. Each
crossing is ordered explicitly, never by luck of both sides using the default stream:

1. at submit, an event is recorded on the producing stream (:func:`producer_event`, the current stream of
   the *tensor's* device, which need not be the current device);
2. every launch runs on one :class:`LaunchStream` per runtime (a dedicated stream of hora's device, whichever
   thread runs the round: the negotiator thread does not inherit the user's ``torch.cuda.set_device``),
   which first waits for that event; the backends order their own streams after it;
3. ``synchronize()`` orders the waiter's current stream after the work: a backend's ``Work.wait()`` does
   that, and for work hora did itself on the launch stream (a fused batch's copies) :class:`EventWork` does.

Memory: a tensor allocated on one stream and used on another must be recorded on the other
(``Tensor.record_stream``), or the caching allocator may hand its memory out again while that stream still
uses it: :func:`used_on` for the user's tensors a fused batch copies on the launch stream,
:func:`consumed_here` for outputs allocated at launch and read by the caller.

On CPU nothing here runs: the callers check for a device or a CUDA tensor first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def producer_event(tensor: torch.Tensor) -> Any:
    """An event recorded now on the current stream of ``tensor``'s device (the stream that produced it)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def consumed_here(tensor: torch.Tensor) -> None:
    """``tensor`` was allocated on the launch stream and is read on the current stream from now on."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))


def used_on(tensor: torch.Tensor, stream: Any) -> None:
    """``tensor`` (allocated on a user's stream) is also used by ``stream``."""
    tensor.record_stream(stream)


class EventWork:
    """The Work of an op hora completed itself on the launch stream: ``wait()`` orders the waiter's current
    stream after it (the host does not block); ``is_completed()`` asks the GPU."""

    __slots__ = ("_device", "_event")

    def __init__(self, stream: Any) -> None:
        self._device = stream.device
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def wait(self, timeout: Any = None) -> bool:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())


class LaunchStream:
    """The stream one runtime launches every collective from, on its device (made on first use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    @property
    def stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    @contextlib.contextmanager
    def active(self) -> Iterator[Any]:
        """Make hora's device and stream current on this thread for the block (a round's launches)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield self.stream

    def wait(self, event: Any) -> None:
        """The launch stream waits (on the GPU) for work recorded in ``event``."""
        self.stream.wait_event(event)

    def done(self) -> EventWork:
        return EventWork(self.stream)
