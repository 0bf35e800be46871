"""Read Hugging Face checkpoint weights (single-file, sharded or globbed safetensors) into modules, strictly,
without a second full copy; build modules directly in their serving dtype and device."""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from omnistage.models.layers.quant import QuantFormat
from omnistage.models.layers.quant_layers import QuantScheme, pack_if_complete, quantize_targets
from omnistage.models.prequantized import Fp8Scale, PackedInt, read_stored, stored_layers, unpack

logger = logging.getLogger(__name__)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_BIN_FILE = "pytorch_model.bin"  # PyTorch's pickled weights, which transformers still reads where no safetensors are
_BIN_INDEX_FILE = "pytorch_model.bin.index.json"
# safetensors' names of torch dtypes (what a view's get_dtype says)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tensors for a module on the meta device are assigned in groups of about this many bytes (one group at a time
# is held besides the module: a 5 GB bfloat16 shard read whole would hold 10 GB of float32 at once).
_ASSIGN_BYTES = 256 << 20


@contextlib.contextmanager
def building(dtype: torch.dtype, device: str | torch.device, init: bool = True) -> Iterator[None]:
    """Create a model's tensors directly in its serving dtype and on its device: a 30B checkpoint must not
    first materialise as float32 on the host. ``init=False``: parameters are left uninitialised (``torch.nn.init``
    does nothing), so memory the loader never writes is never touched and no time goes into random values the
    load overwrites: what every strict load of a whole model wants (every parameter is loaded, or the load
    raises), and what a quantizing load needs, whose float weights are replaced before any data is read."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), (contextlib.nullcontext() if init else _SkipInit()):
            yield
    finally:
        torch.set_default_dtype(previous)


class _SkipInit(TorchFunctionMode):
    """``torch.nn.init``'s in-place initialisers become no-ops (they dispatch through torch functions)."""

    _SKIPPED = frozenset(getattr(nn.init, name) for name in (
        "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
        "xavier_normal_", "constant_", "ones_", "zeros_", "orthogonal_"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map each tensor name in the checkpoint to the file that holds it: safetensors (single, sharded with its
    index, or any ``*.safetensors``), else, as transformers falls back, PyTorch's ``pytorch_model.bin`` (single or
    sharded with its index)."""
    root = Path(model_dir)
    if (root / _INDEX_FILE).is_file():
        return _indexed(root / _INDEX_FILE)
    files = [root / _SINGLE_FILE] if (root / _SINGLE_FILE).is_file() else sorted(root.glob("*.safetensors"))
    if not files and (root / _BIN_INDEX_FILE).is_file():
        return _indexed(root / _BIN_INDEX_FILE)
    if not files and (root / _BIN_FILE).is_file():
        files = [root / _BIN_FILE]
    if not files:
        raise ValueError(f"{model_dir} holds no weights ({_SINGLE_FILE}, {_INDEX_FILE}, {_BIN_FILE} or "
                         f"{_BIN_INDEX_FILE})")
    out: dict[str, Path] = {}
    for path in files:
        with open_weights(path) as f:
            out.update({name: path for name in f.keys()})
    return out


def _indexed(index: Path) -> dict[str, Path]:
    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    absent = sorted({fname for fname in weight_map.values() if not (index.parent / fname).is_file()})
    if absent:
        raise ValueError(f"{index} lists weight files that are not there: {_summary(absent)}")
    return {name: index.parent / fname for name, fname in weight_map.items()}


def open_weights(path: Path) -> Any:
    """One weights file, as safetensors' ``safe_open`` reads it (``keys``, ``get_tensor``, ``get_slice``: a view's
    shape, dtype and rows): a safetensors file, or PyTorch's pickled weights (memory-mapped: only the tensors read
    are read)."""
    return safe_open(str(path), framework="pt") if path.suffix == ".safetensors" else _PickledWeights(path)


class _PickledWeights:
    """``pytorch_model.bin`` behind ``safe_open``'s calls (unpickled tensors only, ``weights_only``)."""

    def __init__(self, path: Path) -> None:
        try:
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # (a pickle of other objects, or the legacy non-zip format mmap cannot read)
            raise ValueError(f"{path}: not readable as PyTorch weights ({type(exc).__name__}: {exc})") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ValueError(f"{path}: not a state dict of tensors")
        self._state = state

    def __enter__(self) -> _PickledWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self._state = {}  # (releases the mapping)

    def keys(self) -> list[str]:
        return list(self._state)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._state[name].clone()  # (a tensor of its own, not a view on the mapped file)

    def get_slice(self, name: str) -> _PickledView:
        return _PickledView(self._state[name])


class _PickledView:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def get_dtype(self) -> str:
        return _SAFETENSORS_DTYPES.get(self._tensor.dtype, str(self._tensor.dtype))

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._tensor[index].clone()


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in _CAST_DTYPES:
        raise ValueError(f"dtype must be one of {_CAST_DTYPES} or None, got {dtype}")


def load_weights(
    model_dir: str | Path, prefix: str, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """Read the tensors whose names start with `prefix`, returned with the prefix stripped.

    Works for single-file and sharded (`model.safetensors.index.json`) checkpoints; only the files that
    hold matching tensors are opened. Floating-point tensors are cast to `dtype` (None keeps the stored
    dtype); integer tensors keep theirs.
    """
    _check_dtype(dtype)
    by_file: dict[Path, list[str]] = {}
    for name, path in checkpoint_files(model_dir).items():
        if name.startswith(prefix):
            by_file.setdefault(path, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, names in sorted(by_file.items()):
        with open_weights(path) as f:
            for name in names:
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                out[name[len(prefix) :]] = tensor
    return out


class EmbeddingRows(nn.Module):
    """A few rows of a checkpoint's embedding table, looked up by their ids in the whole table: a stage that
    reads only some rows of another stage's table (the Talker: the Thinker's special-token rows) does not hold
    the table (152064 x 2048 in the released Qwen3-Omni: 1.2 GB in float32)."""

    def __init__(self, ids: Sequence[int], weight: torch.Tensor) -> None:
        super().__init__()
        self.ids = tuple(int(i) for i in ids)
        self.weight = nn.Parameter(weight, requires_grad=False)  # [len(ids), H]
        self._row = {i: n for n, i in enumerate(self.ids)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        try:
            rows = [self._row[int(i)] for i in ids.reshape(-1).tolist()]
        except KeyError as exc:
            raise KeyError(f"embedding row {exc.args[0]} was not loaded (rows held: {list(self.ids)})") from None
        index = torch.tensor(rows, dtype=torch.long, device=self.weight.device)
        return self.weight[index].reshape(*ids.shape, self.weight.shape[1])


def load_embedding_rows(model_dir: str | Path, name: str, ids: Sequence[int], dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> EmbeddingRows:
    """Rows ``ids`` of the 2-D checkpoint tensor ``name``, read row by row (nothing else of it is read)."""
    _check_dtype(dtype)
    path = checkpoint_files(model_dir).get(name)
    if path is None:
        raise ValueError(f"{model_dir} has no tensor {name!r}")
    with open_weights(path) as f:
        view = f.get_slice(name)
        num_rows = view.get_shape()[0]
        bad = [i for i in ids if not 0 <= i < num_rows]
        if bad:
            raise ValueError(f"rows {bad} are outside {name!r} ({num_rows} rows)")
        rows = [view[i:i + 1] for i in ids]
    weight = torch.cat(rows).to(dtype=dtype, device=device) if rows else torch.empty(0, 0, dtype=dtype)
    return EmbeddingRows(ids, weight)


def _skipped(name: str, prefix: str, skip: tuple[str, ...]) -> bool:
    # A skip entry may be written relative to `prefix` ("audio_tower.") or in full ("thinker.audio_tower.").
    return any(name.startswith(s) or (prefix + name).startswith(s) for s in skip)


def _summary(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _reader(files: dict[Path, list[str]], handles: contextlib.ExitStack) -> Callable[[str], torch.Tensor]:
    """A tensor by checkpoint name, each file opened once (a layer's parts may sit in different shards)."""
    where = {name: path for path, names in files.items() for name in names}
    opened: dict[Path, Any] = {}

    def read(name: str) -> torch.Tensor:
        path = where[name]
        if path not in opened:
            opened[path] = handles.enter_context(open_weights(path))
        return opened[path].get_tensor(name)

    return read


@dataclass(frozen=True)
class _Dequantized:
    """A checkpoint's layers read as float weights: FP8 weights with their scales, integer layers with zero points
    (GPTQ, AWQ, compressed-tensors') from their packed tensors (``prequantized.StoredLayers``); ``aux``: those layers'
    other tensors."""

    fp8: Mapping[str, Fp8Scale]
    packed_int: Mapping[str, PackedInt]
    aux: frozenset[str]

    def _brought_in(self, key: str) -> tuple[str, PackedInt] | None:
        """(state-dict key of the weight, its scheme) where tensor ``key`` is the one that brings in a layer with
        zero points (its scheme's first stored tensor); None for any other."""
        base, _, stored = key.rpartition(".")
        scheme = self.packed_int.get(base + ".weight")
        return (base + ".weight", scheme) if scheme is not None and stored == scheme.names[0] else None

    def for_target(self, read: Callable[[str], torch.Tensor], name: str, key: str,
                   targets: Mapping[str, Any]) -> tuple[Any, Any] | None:
        """(quantized target, the layer for it: ``PackedInt.for_format``) where checkpoint tensor ``name`` brings in
        a layer with zero points whose weight a quantizing load quantizes; else None."""
        layer = self._brought_in(key)
        target = targets.get(layer[0]) if layer is not None else None
        if target is None:
            return None
        return target, layer[1].for_format(read, name.rpartition(".")[0], target.buffer.fmt)

    def weight(self, read: Callable[[str], torch.Tensor], name: str, key: str) -> tuple[str, torch.Tensor] | None:
        """(state-dict key, tensor as the module takes it) for checkpoint tensor ``name`` (``key`` relative to the
        load's prefix); None for a pre-quantized layer's other tensors, read with its weight."""
        if key in self.aux:
            layer = self._brought_in(key)
            if layer is None:
                return None  # (an FP8 scale, a packed layer's other tensors)
            return layer[0], layer[1].dequantize(read, name.rpartition(".")[0])
        tensor = read(name)
        fp8 = self.fp8.get(key)
        return key, tensor if fp8 is None else fp8.dequantize(tensor, read(name[: -len("weight")] + fp8.scale_name))


def load_into(
    module: nn.Module,
    model_dir: str | Path,
    prefix: str,
    dtype: torch.dtype | None = torch.float32,
    skip: tuple[str, ...] = (),
    quantize: QuantScheme | None = None,
    loaded: Callable[[nn.Module], None] | None = None,
) -> None:
    """Load checkpoint tensors under `prefix` into `module`, whose state-dict names equal the checkpoint
    names minus `prefix`.

    Names under a `skip` entry are ignored on both sides (e.g. the thinker's audio/visual towers).
    Raises ValueError naming every missing or shape-mismatched tensor, and any extra tensor of a layer it loads (a
    scale it would not apply), with the unexpected ones; nothing is loaded then (names and shapes come from the
    files' headers, before any data is read). Tensors of modules the module does not have, where nothing is
    missing, are logged and not read, as transformers ignores them. Data is then read tensor by
    tensor and copied into the module's own tensors (cast on the copy), so a model built directly in its
    serving dtype and device needs no second copy of anything but the tensor being read. Parameters on the
    meta device are replaced by the loaded tensors. Afterwards floating-point *parameters* are cast to `dtype` (None: left as they
    are); buffers keep their dtype (e.g. float32 rotary frequencies under bfloat16 weights).

    ``quantize``: the weights that scheme names are quantized as they are read, one tensor at a time, into the
    quantized layers that replace their float ones (``quant_layers.quantize_targets``); each layer is packed for
    its kernel once all its rows are in. Peak memory: the quantized model, the other weights, and the tensor
    being read (build the module with ``building(..., init=False)`` so the float weights are never touched).

    ``loaded``: called with each submodule as soon as every tensor it owns (its own, not its children's) has
    been copied in, e.g. to pack a layer and release its unpacked weights before the next one is read
    (``fast_linear.pack_on_load``). Not called by a quantizing load or for a module built on the meta device.
    """
    _check_dtype(dtype)
    stored_names = checkpoint_files(model_dir)
    tied = _tie_as_stored(module, {name[len(prefix):] for name in stored_names if name.startswith(prefix)})
    expected = {k: v for k, v in module.state_dict(keep_vars=True).items()
                if not _skipped(k, prefix, skip) and k not in tied}
    files: dict[Path, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, path in stored_names.items():
        key = name[len(prefix):]
        if name.startswith(prefix) and not _skipped(key, prefix, skip) and key not in tied:
            files.setdefault(path, []).append(name)
    for path, names in files.items():
        with open_weights(path) as f:
            for name in names:
                shapes[name[len(prefix):]] = tuple(f.get_slice(name).get_shape())
    stored = read_stored(model_dir)
    packed: dict[str, QuantFormat] = {}
    dequantized = _Dequantized({}, {}, frozenset())
    if stored is not None:  # pre-quantized layers stand in for their float weights (name, shape) in the checks
        layers = stored_layers(shapes, stored, prefix)
        layers.stand_in(shapes, lambda shape: shape)
        packed = {k: fmt for k, (_, fmt) in layers.packed.items()}
        # (aux: read with their layers' weights)
        dequantized = _Dequantized(layers.fp8, {k: scheme for k, (_, scheme) in layers.packed_int.items()}, layers.aux)
        if packed:
            quantize = QuantScheme(quantize.formats if quantize is not None else {}, exact=packed)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    # beside a layer the module loads, an extra tensor is data of that layer omnistage would not apply (a scale
    # of a quantization it does not read): refused; tensors of modules it does not have are only unused
    loaded_layers = {key.rpartition(".")[0] for key in expected}
    companions = [k for k in unexpected if k.rpartition(".")[0] in loaded_layers]
    mismatched = sorted(
        f"{k} (checkpoint {shapes[k]}, module {tuple(expected[k].shape)})"
        for k in set(shapes) & set(expected)
        if shapes[k] != tuple(expected[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing from checkpoint: {_summary(missing)}")
    if unexpected:
        problems.append(f"unexpected in checkpoint: {_summary(unexpected)}")
    if companions:
        problems.append(f"tensors beside loaded layers that nothing reads (a quantization this checkpoint's "
                        f"config does not declare?): {_summary(companions)}")
    if mismatched:
        problems.append(f"shape mismatch: {_summary(mismatched)}")
    if missing or mismatched or companions:
        raise ValueError(
            f"cannot load {model_dir} (prefix {prefix!r}) into {type(module).__name__}: "
            + "; ".join(problems)
        )
    if unexpected:  # tensors the model does not use (e.g. saved rotary tables): transformers ignores them too
        logger.warning("%s (prefix %r): %d tensors %s does not use are not read: %s", model_dir, prefix,
                       len(unexpected), type(module).__name__, _summary(unexpected, 5))
        unused = set(unexpected)
        for path, names in files.items():  # (a pre-quantized layer's own names go with its weight)
            files[path] = [n for n in names if _layer_weight(n[len(prefix):], dequantized.aux) not in unused]
    on_meta = any(t.is_meta for t in expected.values())
    if quantize is not None:
        if on_meta:
            raise ValueError("a quantizing load needs the module's tensors allocated, not on the meta device")
        _load_quantizing(module, files, prefix, expected, quantize, dtype, packed, dequantized)
        return
    waiting: Counter[str] = Counter()  # per owning module: its tensors not read yet (``loaded``)
    if loaded is not None and not on_meta:
        modules = dict(module.named_modules())
        owners = _owners(modules, sorted({_layer_weight(name[len(prefix):], dequantized.aux)
                                          for names in files.values() for name in names}))
        waiting.update(owners.values())
    with contextlib.ExitStack() as handles:
        read = _reader(files, handles)
        for _, names in sorted(files.items()):
            part: dict[str, torch.Tensor] = {}
            held = 0
            for name in names:
                weight = dequantized.weight(read, name, name[len(prefix):])
                if weight is None:
                    continue
                key, tensor = weight
                if not on_meta:  # straight into the module's tensor (copy_ casts): no converted copy
                    with torch.no_grad():  # (popped: a fused part's view would keep a packed tensor alive)
                        expected.pop(key).copy_(tensor)
                    del tensor
                    if waiting:
                        owner = owners[key]
                        waiting[owner] -= 1
                        if not waiting[owner]:
                            loaded(modules[owner])
                    continue
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                part[key] = tensor
                held += tensor.numel() * tensor.element_size()
                if held >= _ASSIGN_BYTES:
                    module.load_state_dict(part, strict=False, assign=True)
                    part, held = {}, 0
            if part:
                module.load_state_dict(part, strict=False, assign=True)
            del part
    for alias, name in tied.items():  # an assigned tensor replaced one name's parameter only: tie the others again
        _set_parameter(module, alias, module.get_parameter(name))
    if dtype is not None:
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def _layer_weight(key: str, aux: frozenset[str]) -> str:
    """The weight a checkpoint name belongs to: itself, or for a pre-quantized layer's scale, shape or packed
    values (``aux``) the layer's ``X.weight``."""
    return key.rpartition(".")[0] + ".weight" if key in aux else key


def _tie_as_stored(module: nn.Module, stored: set[str]) -> dict[str, str]:
    """A parameter the module holds under several names (an output head tied to its token embedding), as
    transformers loads it: a later name the checkpoint stores gets a tensor of its own and loads it; the others
    stay tied to the first name. Returns those: later name -> first name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        tied_to = first.setdefault(id(param), name)
        if tied_to == name:
            continue
        if name in stored:
            _set_parameter(module, name, nn.Parameter(torch.empty_like(param), requires_grad=param.requires_grad))
        else:
            tied[name] = tied_to
    return tied


def _set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner), attr, param)


def _owners(names: dict[str, nn.Module], keys: list[str]) -> dict[str, str]:
    """Each state-dict key's owning submodule among ``names`` (its longest module-name prefix: a fused
    parameter's parts, such as ``experts.3.up_proj.weight``, belong to the module holding the fused tensor)."""
    owners = {}
    for key in keys:
        owner = key.rpartition(".")[0]
        while owner and owner not in names:
            owner = owner.rpartition(".")[0]
        owners[key] = owner
    return owners


def _load_quantizing(module: nn.Module, files: dict[Path, list[str]], prefix: str,
                     expected: dict[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype | None,
                     packed: dict[str, QuantFormat], dequantized: _Dequantized) -> None:
    targets = quantize_targets(module, expected, scheme, dtype or torch.float32)
    pending = {id(t.module): t.module for t in targets.values()}
    with torch.no_grad(), contextlib.ExitStack() as handles:
        read = _reader(files, handles)
        for _, names in sorted(files.items()):
            for name in names:
                key = name[len(prefix):]
                if key.endswith(".weight_packed") and key[: -len("_packed")] in packed:  # (stored as it is)
                    base = key.rpartition(".")[0]
                    key = base + ".weight"
                    shape = tuple(read(prefix + base + ".weight_shape").tolist())
                    if shape != tuple(expected[key].shape):
                        raise ValueError(f"{prefix + base}: weight_shape {list(shape)} does not match its packed "
                                         f"values ({list(expected[key].shape)})")
                    values, scales = unpack(read(name), read(prefix + base + ".weight_scale"), packed[key])
                    target = targets[key]
                    target.buffer.write_quantized(target.start, values, scales)
                    del values, scales
                elif (stored := dequantized.for_target(read, name, key, targets)) is not None:
                    target, values = stored  # (a layer with zero points into its quantized layer)
                    if isinstance(values, tuple):
                        target.buffer.write_quantized(target.start, *values)
                    else:
                        target.buffer.write_rows(target.start, values)
                    del values
                else:
                    weight = dequantized.weight(read, name, key)
                    if weight is None:
                        continue  # (scales, shapes: read with their layer's values)
                    key, tensor = weight
                    target = targets.get(key)
                    if target is None:
                        expected[key].copy_(tensor.to(dtype) if dtype is not None and tensor.is_floating_point()
                                            else tensor)
                        continue
                    target.buffer.write_rows(target.start, tensor)
                    del tensor
                if pack_if_complete(target.module):
                    del pending[id(target.module)]
    if pending:  # (the strict name check above makes this unreachable unless a module's buffer is inconsistent)
        raise ValueError(f"quantized layers left incomplete: {sorted(type(m).__name__ for m in pending.values())}")
    if dtype is not None:
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
