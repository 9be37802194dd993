"""Count the host syncs a piece of PyTorch code would make on a GPU, on any device (CPU included).

A host sync is an op after which the host must wait for the device's queue: it copies a value
from the device to the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``,
``torch.equal``), or its output's shape depends on tensor values, so the host must read them
before it can allocate the output (``nonzero``, boolean-mask indexing, ``masked_select``,
``bincount``, ``unique``, ``repeat_interleave`` without ``output_size``). Each one stalls the
GPU and rules out CUDA graphs and a whole-graph ``torch.compile``.

    with HostSyncCounter() as syncs:
        loss = model(x).sum(); loss.backward()
    syncs.total, syncs.by_op  # e.g. 2, {"aten._local_scalar_dense": 1, "aten.nonzero": 1}

Ops are recognised by PyTorch's own tags (``data_dependent_output``, ``dynamic_output_shape``)
plus the few cases the tags miss or over-report. ``by_site`` names where each sync was called
from (the innermost frame outside PyTorch), so a caller can tell its own syncs from a library's.

On a CPU-only run every tensor stands for a device tensor, except those a GPU run would also
keep on the host: tensors made by a factory (``torch.tensor``, ``torch.arange``, ...) without a
``device`` or with ``device="cpu"``, shapes as tensors (``shape_as_tensor``), results of
``.cpu()``, and whatever is computed from such tensors alone. Reading those is not counted.
- ``.cpu()``, ``.numpy()``, ``.tolist()`` and ``.to("cpu")`` (the string) of a device tensor
  count as device-to-host copies; ``.to(some_tensor.device)`` does not (device-generic code moves
  host-made tensors to the model's device that way: a host-to-device move on a GPU), and its
  result counts as a device tensor.
- ``one_hot`` with ``num_classes`` counts nothing: its CPU kernel checks the class range with
  ``.item()``, its CUDA kernel relies on device asserts. Without ``num_classes`` it counts once.
- Host-to-device copies by a factory count: ``torch.tensor``, ``torch.as_tensor``,
  ``torch.asarray`` of host data (Python numbers or sequences, NumPy arrays, host tensors) with
  a ``device`` other than the string "cpu" (a ``torch.device``, as ``x.device``, stands for the
  device), and ``x.new_tensor(data)`` of a device tensor x. On a GPU such a call makes a
  blocking copy from pageable host memory, which waits for the stream. These factories copy
  below PyTorch's Python dispatch, so no dispatch mode sees the copy, not even on a GPU; they
  are counted by name ("torch.tensor (host to device)"). ``x.new_full``, ``torch.full`` and
  ``torch.arange`` make their values on the device and count nothing. ``.to(device)`` of a
  host tensor is not counted here (see above).
- On a real device every other blocking copy between the host and the device counts (the
  dispatcher sees it: ``aten._to_copy``, ``aten.copy_``).
"""
import os
import traceback
from typing import Dict, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

# Composite: always reaches the dispatcher as _local_scalar_dense, which is counted instead.
_NOT_COUNTED = {aten.item.default}
_BOOL_DTYPES = (torch.bool, torch.uint8)
_DEVICE_TO_HOST_METHODS = {torch.Tensor.cpu: "Tensor.cpu", torch.Tensor.numpy: "Tensor.numpy",
                           torch.Tensor.tolist: "Tensor.tolist"}
# Factories that copy their data argument, made on the host, to their ``device``.
_COPYING_FACTORIES = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor",
                      torch.asarray: "torch.asarray"}


def _op_name(func) -> str:
    overload = func._overloadname
    base = f"aten.{func._opname}"
    return base if overload == "default" else f"{base}.{overload}"


def _has_bool_index(indices) -> bool:
    return any(index is not None and index.dtype in _BOOL_DTYPES for index in indices)


def _is_masked_fill(args, kwargs) -> bool:
    """``x[mask] = scalar``: index_put with one mask and a one-element value, which PyTorch
    runs as masked_fill (no nonzero, no sync)."""
    indices = args[1]
    value = args[2] if len(args) > 2 else kwargs["values"]
    return (len(indices) == 1 and indices[0] is not None and indices[0].dtype in _BOOL_DTYPES
            and value.numel() == 1)


def _is_cross_device_copy(source: torch.Tensor, target_device: torch.device,
                          non_blocking: bool) -> bool:
    on_host = (source.device.type == "cpu", target_device.type == "cpu")
    return on_host[0] != on_host[1] and (not non_blocking or on_host[1])


def _sync_name(func, args, kwargs) -> Optional[str]:
    """The name to count ``func`` under if it makes a host sync with these arguments."""
    if func in _NOT_COUNTED:
        return None
    packet = func.overloadpacket
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_,
                  aten._unsafe_index_put):
        if not _has_bool_index(args[1]):
            return None
        if packet is not aten.index and _is_masked_fill(args, kwargs):
            return None
        return _op_name(func) + " (bool mask)"
    if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor:
        output_size = kwargs.get("output_size", args[1] if len(args) > 1 else None)
        return None if output_size is not None else _op_name(func)
    if packet is aten.histc:  # the CUDA kernel reads min/max from the device when both are 0
        low = kwargs.get("min", args[2] if len(args) > 2 else 0)
        high = kwargs.get("max", args[3] if len(args) > 3 else 0)
        return _op_name(func) if low == high else None
    if packet is aten._to_copy:
        device = kwargs.get("device")
        if device is not None and _is_cross_device_copy(
                args[0], torch.device(device), kwargs.get("non_blocking", False)):
            return _op_name(func)
        return None
    if packet is aten.copy_:
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return (_op_name(func) if _is_cross_device_copy(args[1], args[0].device, non_blocking)
                else None)
    if torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
        return _op_name(func)
    return None


def _tensors(args, kwargs):
    return [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]


def _is_cpu_string(device) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class _HostSyncFunctionMode(TorchFunctionMode):
    """What the dispatcher cannot see: which tensors are made on the host, device-to-host copies
    of CPU tensors (no-ops there) and ``one_hot``'s CPU-only range check."""

    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        tensors = _tensors(args, kwargs)
        if func is torch.nn.functional.one_hot:
            num_classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
            if num_classes < 0 and not counter._is_host(args[0]):
                counter._record("one_hot (no num_classes)")
            counter._ignore_scalar_reads += 1
            try:
                return func(*args, **kwargs)
            finally:
                counter._ignore_scalar_reads -= 1
        copy = self._host_to_device_copy(func, args, kwargs)
        if copy is not None:
            counter._record(f"{copy} (host to device)")
        to_host = None
        if func in _DEVICE_TO_HOST_METHODS:
            to_host = _DEVICE_TO_HOST_METHODS[func]
        elif func is torch.Tensor.to:
            targets = [*args[1:], kwargs.get("device")]
            if any(_is_cpu_string(target) for target in targets):
                to_host = "Tensor.to('cpu')"
            elif any(isinstance(target, (str, torch.device)) for target in targets):
                to_host = "to a device"
        if to_host is not None and to_host != "to a device" and args[0].device.type == "cpu" \
                and not counter._is_host(args[0]):
            counter._record(to_host)
        result = func(*args, **kwargs)
        if to_host == "to a device":
            counter._forget_host(result)
        elif to_host is not None or func is torch._shape_as_tensor or (not tensors and (
                kwargs.get("device") is None or _is_cpu_string(kwargs["device"]))):
            counter._mark_host(result)
        return result


    def _host_to_device_copy(self, func, args, kwargs) -> Optional[str]:
        """The factory's name if this call copies host data to a device (module docstring)."""
        if func is torch.Tensor.new_tensor:
            target, data = args[0], (args[1] if len(args) > 1 else kwargs.get("data"))
            device = kwargs.get("device")
            if device is None:
                if self.counter._is_host(target):
                    return None
                device = target.device
            name = "Tensor.new_tensor"
        elif func in _COPYING_FACTORIES:
            data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
            device = kwargs.get("device")
            if device is None:
                return None
            name = _COPYING_FACTORIES[func]
        else:
            return None
        device_type = device.type if isinstance(device, torch.device) else (
            device.split(":")[0] if isinstance(device, str) else "cuda")  # an int: a GPU index
        if device_type == "meta" or (isinstance(device, str) and device_type == "cpu"):
            return None
        if isinstance(data, torch.Tensor):
            # a tensor argument is copied above the dispatcher, which sees it on a real device;
            # on the CPU, a host tensor moved to x.device stands for a host-to-device copy
            if not self.counter._is_host(data) or device_type != "cpu":
                return None
        return name


class HostSyncCounter(TorchDispatchMode):
    """Counts host syncs (see the module docstring) in ``total``, per op in ``by_op`` and per
    calling line ("file:line") in ``by_site``."""

    def __init__(self):
        super().__init__()
        self.by_op: Dict[str, int] = {}
        self.by_site: Dict[str, int] = {}
        self._ignore_scalar_reads = 0
        self._host_tensors = WeakTensorKeyDictionary()
        self._device_seen = False
        self._function_mode = _HostSyncFunctionMode(self)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def _record(self, name: str) -> None:
        self.by_op[name] = self.by_op.get(name, 0) + 1
        site = _calling_site()
        self.by_site[site] = self.by_site.get(site, 0) + 1

    def _is_host(self, tensor: torch.Tensor) -> bool:
        return tensor in self._host_tensors or (self._device_seen
                                                and tensor.device.type == "cpu")

    def _mark_host(self, result) -> None:
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                self._host_tensors[leaf] = True

    def _forget_host(self, result) -> None:
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                self._host_tensors.pop(leaf, None)

    def __enter__(self):
        self._function_mode.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._function_mode.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            self._function_mode.__exit__(exc_type, exc_value, traceback)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        if not self._device_seen and any(t.device.type != "cpu" for t in tensors):
            self._device_seen = True
        result = func(*args, **kwargs)
        on_host = func is aten._shape_as_tensor.default or (
            tensors and all(self._is_host(t) for t in tensors))
        if on_host:
            self._mark_host(result)
        elif not (self._ignore_scalar_reads and func is aten._local_scalar_dense.default):
            name = _sync_name(func, args, kwargs)
            if name is not None:
                self._record(name)
        return result


def _calling_site() -> str:
    """The innermost frame outside PyTorch and this module, as "path:line"."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if path == __file__ or path.startswith(_TORCH_DIR) or "contextlib" in path:
            continue
        return f"{path}:{frame.lineno}"
    return "?"
