"""``horovod.torch.compression`` under ``hora run``: hora's compressors under Horovod's names."""

from __future__ import annotations

from hora.datapath.wire import Compression, Compressor, NoneCompressor  # noqa: F401

FP16Compressor = Compression.fp16  # Horovod's class of static methods; hora's instance answers the same calls
