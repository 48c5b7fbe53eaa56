"""Find host synchronisations and host-to-device copies on a per-step path, on the CPU.

A server replays the pruner's per-layer work inside CUDA graphs and runs it eagerly between them.
Either way it must never wait for the device or copy host values to it: a wait stalls the
scheduler on every layer call, and under graph capture a host-to-device copy raises (or, in some
releases, is captured with a stale value).  ``torch.cuda.set_sync_debug_mode`` catches some of this
on a GPU; :class:`HostSyncDetector` catches the same code on the CPU, where the tensors live on the
host and nothing actually synchronises, by recognising the operations that would:

* reading a tensor's value into Python: ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``,
  ``bool(t)`` / ``int(t)`` / ``float(t)`` / ``t.__index__()`` (``if t:``, ``range(t)``),
  ``torch.equal``, ``torch.allclose``, printing a tensor;
* building a tensor from host values: ``torch.tensor`` / ``torch.as_tensor`` / ``torch.asarray`` /
  ``torch.from_numpy`` of Python or NumPy data (a tensor argument is fine);
* writing Python values into a tensor through indexing: ``t[i] = True`` (torch makes a host tensor of
  the value and copies it over);
* outputs whose size depends on the data: ``nonzero``, ``argwhere``, one-argument ``where``,
  ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` with tensor repeats and no
  ``output_size``, and indexing (reading or writing) with a boolean mask.

The Python-level API is watched with a :class:`~torch.overrides.TorchFunctionMode`, and the aten
operations behind it with a :class:`~torch.utils._python_dispatch.TorchDispatchMode`, so calls made
inside torch itself are seen as well.  Each finding names the operation and the innermost frame of
this package that led to it.

Example
-------
>>> with HostSyncDetector() as detector:
...     step()
>>> assert not detector.findings, detector.report()
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS_FILE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

# Python-level calls that move a tensor's value to the host (or would, on a device tensor).
_READS = {
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.cpu: "Tensor.cpu",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "tensor used as a Python index",
    torch.Tensor.__repr__: "repr(tensor)",
    torch.Tensor.__format__: "format(tensor)",
    torch.equal: "torch.equal",
    torch.allclose: "torch.allclose",
}
# Constructors that copy host data to the tensor's device.
_CONSTRUCTORS = {
    torch.tensor: "torch.tensor",
    torch.as_tensor: "torch.as_tensor",
    torch.asarray: "torch.asarray",
    torch.from_numpy: "torch.from_numpy",
}
# aten operations whose output size depends on the data (the device must report it to the host).
_DATA_DEPENDENT = {
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten.argwhere.default",
    "aten.masked_select.default",
    "aten._unique.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.bincount.default",
    "aten._local_scalar_dense.default",
}


@dataclass(frozen=True)
class Finding:
    """One operation that would synchronise with (or copy from) the host on a device."""

    operation: str
    where: str  # innermost frame of this package, "file:line in function"

    def __str__(self) -> str:
        return f"{self.operation} at {self.where}"


def _where() -> str:
    """The innermost frame of this package outside this module, else the innermost frame outside
    torch (the caller's code)."""
    outside_torch = None
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _THIS_FILE or path.startswith(_TORCH_DIR):
            continue
        if path.startswith(_PACKAGE_DIR):
            return f"{os.path.relpath(path, os.path.dirname(_PACKAGE_DIR))}:{frame.lineno} in {frame.name}"
        outside_torch = outside_torch or f"{frame.filename}:{frame.lineno} in {frame.name}"
    return outside_torch or "unknown"


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _is_host_data(data) -> bool:
    return not isinstance(data, torch.Tensor)


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, detector: HostSyncDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = self.detector.flags
        self._check(func, args, kwargs)
        if self.detector.flags == seen:
            return func(*args, **kwargs)
        # already reported here: the aten operations behind this call would repeat it
        self.detector._paused += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.detector._paused -= 1

    def _check(self, func, args, kwargs) -> None:
        name = _READS.get(func)
        if name is not None:
            self.detector.flag(name)
        elif func in _CONSTRUCTORS:
            data = args[0] if args else kwargs.get("data", kwargs.get("obj", kwargs.get("ndarray")))
            if _is_host_data(data):
                self.detector.flag(f"{_CONSTRUCTORS[func]} of host data")
        elif func is torch.Tensor.__setitem__:
            index, value = args[1], args[2]
            if not isinstance(value, torch.Tensor):
                self.detector.flag("a Python value written into a tensor by indexing")
            if _has_bool_index(index):
                self.detector.flag("boolean-mask indexing (write)")
        elif func is torch.Tensor.__getitem__:
            if _has_bool_index(args[1]):
                self.detector.flag("boolean-mask indexing (read)")
        elif func in (torch.where, torch.Tensor.where) and len(args) + len(kwargs) == 1:
            self.detector.flag("torch.where with one argument")
        elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None and len(args) < 4:
                self.detector.flag("repeat_interleave with tensor repeats and no output_size")


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, detector: HostSyncDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in _DATA_DEPENDENT:
            self.detector.flag(name.removesuffix(".default"))
        elif name.startswith(("aten.index.Tensor", "aten.index_put")):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.detector.flag(f"{name} with a boolean mask")
        return func(*args, **kwargs)


class HostSyncDetector:
    """Context manager that records every operation that would synchronise a device with the host.

    Parameters
    ----------
    raise_on_first : bool
        Raise :class:`HostSyncError` at the first finding instead of recording it.

    Attributes
    ----------
    findings : list of Finding
        In the order seen; one entry per (operation, place), repeats dropped.
    """

    def __init__(self, raise_on_first: bool = False) -> None:
        self.raise_on_first = raise_on_first
        self.findings: list[Finding] = []
        self._modes: list = []
        self._paused = 0
        self.flags = 0  # findings counted with repeats

    def flag(self, operation: str) -> None:
        if self._paused:
            return
        self.flags += 1
        finding = Finding(operation, _where())
        if self.raise_on_first:
            raise HostSyncError(str(finding))
        if finding not in self.findings:
            self.findings.append(finding)

    def report(self) -> str:
        """One line per finding."""
        return "\n".join(str(f) for f in self.findings) or "no host synchronisation"

    def __enter__(self) -> HostSyncDetector:
        self._modes = [_FunctionWatch(self), _DispatchWatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


class HostSyncError(RuntimeError):
    """An operation that would synchronise the device with the host ran under the detector."""
