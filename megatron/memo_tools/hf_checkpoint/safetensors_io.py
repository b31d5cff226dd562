"""Hugging Face weight files: read a model directory's safetensors (one file, or shards named by
model.safetensors.index.json) and write them. Only safetensors and JSON are ever read: a
pickled ``pytorch_model.bin`` is refused, never opened."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron.memo_tools.hf_checkpoint.errors import ConversionError
from megatron.memo_tools.hf_checkpoint.hf_config import read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers' default shard size (save_pretrained's max_shard_size="5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class SafetensorsReader:
    """Lazy access to the tensors of a Hugging Face model directory (memory-mapped: a tensor is
    read when asked for)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._handles = {}
        self._file_of = self._locate()

    def _locate(self) -> dict[str, Path]:
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index} has no weight_map; re-download the model")
            file_of = {name: self.directory / file for name, file in weight_map.items()}
            for file in sorted(set(file_of.values())):
                if not file.is_file():
                    raise ConversionError(f"{index} names {file.name}, which is missing from "
                                          f"{self.directory}; download every shard")
            return file_of
        if single.is_file():
            return {name: single for name in self._open(single).keys()}
        if any(self.directory.glob("*.bin")) or any(self.directory.glob("*.pt")):
            raise ConversionError(
                f"{self.directory} has pickled weights (*.bin/*.pt) but no {SINGLE_FILE} or "
                f"{INDEX_FILE}; this tool reads safetensors only: save the model with "
                "transformers' save_pretrained(dir) or download its safetensors files")
        raise ConversionError(f"{self.directory} has no {SINGLE_FILE} or {INDEX_FILE}; point "
                              "the flag at a Hugging Face model directory")

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as error:
                raise ConversionError(f"{file} is not a readable safetensors file ({error}); "
                                      "re-download it") from None
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self._file_of)

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def _slice(self, name: str):
        file = self._file_of[name]
        handle = self._open(file)
        if name not in handle.keys():
            raise ConversionError(f"{INDEX_FILE} puts {name} in {file.name}, which does not "
                                  "hold it; re-download the model")
        return handle.get_slice(name)

    def shape_of(self, name: str) -> list[int]:
        """From the file's header; no data read."""
        return self._slice(name).get_shape()

    def dtype_of(self, name: str) -> torch.dtype:
        """From the file's header; no data read."""
        code = self._slice(name).get_dtype()
        if code not in DTYPES:
            raise ConversionError(f"{self.file_of(name)}: {name} has dtype {code}; only "
                                  f"{', '.join(DTYPES)} convert")
        return DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        self._slice(name)  # checks the file holds it
        return self._open(self._file_of[name]).get_tensor(name)


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards, size = [[]], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors(tensors: Mapping[str, torch.Tensor], directory: Path,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write ``tensors`` as transformers does: one model.safetensors, or shards of at most
    ``max_shard_bytes`` (a larger tensor alone) with model.safetensors.index.json. Returns the
    file names written."""
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(names, shards):
        save_file({name: tensors[name].contiguous() for name in shard}, str(directory / file),
                  metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name in shard}}
        write_json(index, directory / INDEX_FILE)
        names.append(INDEX_FILE)
    return names


def write_json(value: dict, path: Path) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def copy_files(source: Path, destination: Path, names: Iterable[str]) -> list[str]:
    """Copy those of ``names`` that exist in ``source`` into ``destination``."""
    copied = []
    for name in names:
        if (source / name).is_file():
            (destination / name).write_bytes((source / name).read_bytes())
            copied.append(name)
    return copied
