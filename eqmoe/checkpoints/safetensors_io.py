"""Reading safetensors files tensor by tensor, bfloat16 and FP8 included.

The ``safetensors`` package validates each file's header; the tensors are then memory-mapped with
NumPy (and ``ml_dtypes`` for bfloat16 and the FP8 types of block-FP8 checkpoints, which ``safetensors``'
NumPy backend cannot return), so one tensor at a time is read from disk.
"""

import json
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
