"""A small reader and writer of the safetensors format (torch alone; the ``safetensors`` package is not needed).

The format (https://huggingface.co/docs/safetensors): 8 bytes, the little-endian unsigned length N of the
header; N bytes of UTF-8 JSON, ``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}``
with an optional ``"__metadata__": {str: str}``, padded with spaces to a multiple of 8 bytes; then the data,
each tensor's bytes row-major and little-endian, at its offsets relative to the end of the header. Nothing
is pickled: a file holds numbers and names only.
"""
import json
import struct
import sys
from typing import Dict, Optional, Tuple

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Refuse a header bigger than this: a damaged or foreign file would otherwise make us read gigabytes as JSON.
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A file that is not a valid safetensors file, or a tensor that cannot be stored in one."""


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if sys.byteorder != "little" and t.element_size() > 1:
        raise SafetensorsError("writing safetensors on a big-endian machine is not supported")
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def save_file(tensors: Dict[str, torch.Tensor], path, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``tensors`` (name -> tensor, each its own storage: tied weights saved once, under one name) and
    ``metadata`` (str -> str) to ``path``."""
    header, chunks, offset = {}, [], 0
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError("safetensors metadata maps strings to strings")
        header["__metadata__"] = dict(metadata)
    for name in sorted(tensors):  # sorted, so that the same tensors give the same file
        t = tensors[name]
        if t.dtype not in NAMES:
            raise SafetensorsError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold here "
                                   f"(one of {', '.join(str(d) for d in NAMES)})")
        data = _tensor_bytes(t)
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in chunks:
            f.write(data)


def load_file(path, device="cpu") -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """The tensors and the metadata of the safetensors file ``path``; a file that breaks the format is a
    SafetensorsError naming what is wrong."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise SafetensorsError(f"{path} is not a safetensors file: {len(raw)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > min(MAX_HEADER, len(raw) - 8):
        raise SafetensorsError(f"{path} is not a safetensors file: its header length {n} exceeds the file")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path} is not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path} is not a safetensors file: its header is not a JSON object")
    data = memoryview(raw)[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    tensors, end = {}, 0
    for name, info in sorted(header.items(), key=lambda item: item[1].get("data_offsets", [0])[0]):
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            begin, stop = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed entry {info!r} (dtype from "
                                   f"{', '.join(DTYPES)}, shape, data_offsets)") from None
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if begin != end or stop - begin != size or stop > len(data):
            raise SafetensorsError(f"{path}: tensor {name!r} has data_offsets [{begin}, {stop}] for {size} bytes of "
                                   f"{info['dtype']} {shape}: the data must be contiguous, in order, within the file")
        end = stop
        buf = bytearray(data[begin:stop])  # a copy: the tensor owns writable memory
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        tensors[name] = t.view(dtype).reshape(shape).to(device)
    if end != len(data):
        raise SafetensorsError(f"{path}: {len(data) - end} bytes after the last tensor's data")
    return tensors, metadata
