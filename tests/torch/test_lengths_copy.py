"""The forward's asynchronous copy of the document lengths (xattn.torch.ops._LengthsCopy) goes on the stream of
cu_seqlens' device, and its event is recorded there too (issue #42, case 5): with q and cu_seqlens on cuda:1
while cuda:0 is current, an event on cuda:0's stream says nothing about the copy, and the backward could read
the previous batch's lengths from the reused pinned buffer. Checked on the CPU with stand-ins of the CUDA
stream API that record which stream each step lands on."""

import contextlib
from types import SimpleNamespace

import torch

import xattn.torch.ops as ops


class _Streams:
    """Fake torch.cuda stream API: current device 0, one stream per device, a stream context."""

    def __init__(self):
        self.current = {0: "stream(cuda:0)", 1: "stream(cuda:1)"}
        self.device = 0
        self.active = None
        self.copies, self.records = [], []

    def current_stream(self, device=None):
        index = self.device if device is None else torch.device(device).index
        return self.active if self.active and device is None else self.current[index]

    @contextlib.contextmanager
    def stream(self, s):
        before = self.active
        self.active = s
        try:
            yield
        finally:
            self.active = before

    def event(self):
        streams = self

        class Event:
            def record(self, stream=None):
                streams.records.append(stream if stream is not None else streams.current_stream())

            def synchronize(self):
                pass
        return Event()


class _Host:
    def __init__(self, streams, values):
        self.streams, self.values = streams, values

    def copy_(self, src, non_blocking=False):
        self.streams.copies.append(self.streams.current_stream())
        self.values = src.values

    def tolist(self):
        return list(self.values)


def test_copy_and_event_on_the_stream_of_cu_seqlens_device(monkeypatch):
    streams = _Streams()
    monkeypatch.setattr(torch.cuda, "current_stream", streams.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", streams.stream)
    monkeypatch.setattr(torch.cuda, "Event", streams.event)
    monkeypatch.setattr(ops, "_pinned", lambda shape, dtype: _Host(streams, []), raising=False)
    cu = SimpleNamespace(device=torch.device("cuda", 1), shape=(3,), dtype=torch.int32, _version=0,
                         values=[0, 5, 9])
    copy = ops._LengthsCopy(cu, cu)
    assert streams.copies == ["stream(cuda:1)"] * 2
    assert streams.records == ["stream(cuda:1)"]  # not the current device's stream(cuda:0)
    assert copy.lengths(cu, cu) == ([5, 4], [5, 4])
    cu._version = 1  # written since the copy: the backward reads cu_seqlens again
    assert copy.lengths(cu, cu) is None
