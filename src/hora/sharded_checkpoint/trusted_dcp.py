"""torch.distributed.checkpoint (DCP) files read and written under hora's trust rules (:mod:`hora.common.trusted_load`).

DCP's own reader (torch 2.13, ``torch/distributed/checkpoint/filesystem.py``) unpickles the checkpoint's
``.metadata`` with ``pickle.load`` and ``default_planner.py``'s ``load_bytes`` loads every non-tensor value with
``torch.load(weights_only=False)``: both run whatever code the files name. Here:

- every file is opened with :func:`~hora.common.trusted_load.open_owned` (another user's file is refused) and
  every directory made is the job's user's alone (:func:`~hora.common.trusted_load.private_directory`);
- ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which builds only DCP's metadata records, torch's
  sizes, dtypes and layouts, and paths (:data:`DCP_CLASSES`);
- non-tensor values load with ``torch.load(weights_only=True)`` unless the caller opts out (tensors always do,
  in DCP's own code);
- the plans the ranks exchange while saving are DCP's records too: :func:`dcp_records` lets hora's object
  collectives load them under ``weights_only=True`` when the job has no secret (with one they are MACed).

Example:
    >>> reader = TrustedReader("/checkpoints/run1/ckpt-000000010.dcp")  # doctest: +SKIP
    >>> metadata = reader.read_metadata()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
from collections.abc import Generator, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint._traverse import set_element  # what DCP's own load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem, WriteItemType

from hora.common.trusted_load import UnsafeToLoad, open_owned, private_directory, unsafe_reason
from hora.common.writer_files import RememberingFile

# DCP's records: what its metadata file and its save plans hold besides tensors and plain values.
DCP_CLASSES: tuple[Any, ...] = (
    dcp_md.Metadata, dcp_md.MetadataIndex, dcp_md.ChunkStorageMetadata, dcp_md.TensorProperties,
    dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata, dcp_md.StorageMeta, dcp_md._MEM_FORMAT_ENCODING,
    dcp_planner.SavePlan, dcp_planner.WriteItem, dcp_planner.WriteItemType, dcp_planner.TensorWriteData,
    dcp_storage.WriteResult, dcp_fs._StorageInfo, dcp_fs._StoragePrefix, torch.serialization._get_layout,
    torch.Size, pathlib.PosixPath, pathlib.PurePosixPath,
)
_ALLOWED = {(getattr(c, "__module__", ""), c.__qualname__) for c in DCP_CLASSES}


@contextlib.contextmanager
def dcp_records() -> Iterator[None]:
    """Within this block ``torch.load(weights_only=True)`` also builds DCP's plan and result records (no code)."""
    with torch.serialization.safe_globals(list(DCP_CLASSES)):
        yield


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and torch's dtypes, sizes and layouts; refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeToLoad(f"its metadata names {module}.{name}, which is not one of DCP's records (it could run "
                           "code)")


class _OwnedFileSystem(dcp_fs.FileSystem):
    """DCP's file system, with hora's rules: read only the job user's files; make private directories."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "r" not in mode:
            with super().create_stream(path, mode) as stream:
                sink = RememberingFile(stream)  # type: ignore[arg-type]
                try:
                    yield sink  # type: ignore[misc]  # a file in all but its write
                except RuntimeError as e:  # torch.save's word for a failed write: say what failed
                    if sink.error is None:
                        raise
                    raise sink.error from e
            return
        with open_owned(path) as stream:
            yield stream  # type: ignore[misc]  # a binary file is the stream DCP reads

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        private_directory(path)


class TrustedWriter(dcp_fs.FileSystemWriter):
    """DCP's file writer making private directories (one file per rank, fsynced)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.fs = _OwnedFileSystem()


class TrustedReader(dcp_fs.FileSystemReader):
    """DCP's file reader opening only the job user's files and unpickling its metadata safely."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.fs = _OwnedFileSystem()

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        with self.fs.create_stream(self._get_metadata_path(), "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except UnsafeToLoad:
                raise
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
                raise ValueError(f"its metadata cannot be read ({type(e).__name__}: {e})") from e
        if not isinstance(metadata, dcp_md.Metadata):
            raise ValueError(f"its metadata is a {type(metadata).__name__}, not DCP's Metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_md.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class TrustedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner loading non-tensor values with ``weights_only`` (True unless the caller opts out)."""

    def __init__(self, weights_only: bool = True) -> None:
        super().__init__()
        self._weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=self._weights_only)
        except pickle.UnpicklingError as e:
            if self._weights_only:
                raise UnsafeToLoad(f"{read_item.dest_index.fqn}: {unsafe_reason(e)}") from None
            raise
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)


class StagingSavePlanner(DefaultSavePlanner):
    """DCP's save planner that can copy what this rank writes now (:meth:`stage`), so that an asynchronous write
    saves the values of the moment it was asked for, while training goes on changing them."""

    def __init__(self) -> None:
        super().__init__()
        self._staged: dict[Any, Any] = {}

    def stage(self, plan: SavePlan) -> None:
        """Resolve every item of this rank's final ``plan`` now: tensors copied to the CPU, values pickled."""
        for item in plan.items:
            data = super().resolve_data(item)
            if isinstance(data, torch.Tensor):
                data = data.detach().to("cpu", copy=True)
            self._staged[item.index] = data

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        staged = self._staged.get(write_item.index)
        if staged is None:
            return super().resolve_data(write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            staged.seek(0)
        return staged
