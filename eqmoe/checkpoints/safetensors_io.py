"""Reading safetensors files tensor by tensor, bfloat16 and FP8 included.

The ``safetensors`` package validates each file's header; the tensors are then memory-mapped with
NumPy (and ``ml_dtypes`` for bfloat16 and the FP8 types of block-FP8 checkpoints, which ``safetensors``'
NumPy backend cannot return), so one tensor at a time is read from disk.
"""

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # block-FP8 weights (eqmoe.checkpoints.quantized)
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,  # their power-of-two scales: one exponent byte each
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(numpy_type): name for name, numpy_type in DTYPES.items()}


class StreamedFile:
    """A safetensors file written one tensor at a time, so that the writer holds one tensor, not the file's. The
    header, which comes first in the file, is known only once every tensor is in: the data go to a scratch file
    beside ``path`` as they come, and :meth:`close` writes the header and then moves the data in behind it."""

    def __init__(self, path: Path, metadata: dict[str, str] | None = None):
        self.path, self.keys, self.size = Path(path), [], 0
        self._header: dict = {"__metadata__": metadata} if metadata else {}
        self._scratch = self.path.with_name(self.path.name + ".data")
        self._data = open(self._scratch, "wb")  # noqa: SIM115 (closed by close())

    def add(self, key: str, tensor: np.ndarray) -> None:
        if key in self._header:
            raise ValueError(f"{self.path}: tensor {key!r} written twice")
        tensor = np.asarray(tensor, order="C")  # (ascontiguousarray would make a scalar one-dimensional)
        if tensor.dtype not in _NAMES:
            raise ValueError(f"{self.path}: tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot hold")
        self._data.write(tensor.reshape(-1).view(np.uint8).data)  # bfloat16 and FP8 hold no buffer format of their own
        self._header[key] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self.size, self.size + tensor.nbytes],
        }
        self.keys.append(key)
        self.size += tensor.nbytes

    def close(self) -> list[str]:
        """Write the file (header, then the data); its tensor names, in order."""
        self._data.close()
        header = json.dumps(self._header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data start 8-byte aligned, as safetensors writes them
        with open(self.path, "wb") as out, open(self._scratch, "rb") as data:
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, out, length=1 << 20)  # a small buffer: memory is the point
        self._scratch.unlink()
        return self.keys


class SafetensorsFile:
    """One ``.safetensors`` file: its tensor names, shapes and a lazy reader for each tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: safetensors file not found")
        try:
            with safe_open(str(self.path), framework="numpy"):
                pass
        except SafetensorError as error:
            raise ValueError(f"{self.path}: not a valid safetensors file ({error})") from None
        with open(self.path, "rb") as handle:
            (header_size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_size))
        header.pop("__metadata__", None)
        self._data_start = 8 + header_size
        self._header = header

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def dtype(self, key: str) -> str:
        return self._header[key]["dtype"]

    def read(self, key: str) -> np.ndarray:
        entry = self._header[key]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {key!r} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        dtype = np.dtype(DTYPES[entry["dtype"]])
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {key!r} has {end - begin} bytes, expected {count * dtype.itemsize}")
        data = np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=(count,))
        return np.asarray(data).reshape(entry["shape"])
