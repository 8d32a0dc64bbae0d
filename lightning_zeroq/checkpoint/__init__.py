"""Checkpoints in ``torch.distributed.checkpoint`` format, engine-agnostic where possible.

| file | its one job |
|---|---|
| ``api.py`` | the door, the only file the Trainer's and Fabric's glue imports (its ``__all__``): ``save``, ``write_file``, ``load -> Loaded`` (single file, directory, errors, loss scaler), ``read_single_file``, ``read_weights``, ``remove_checkpoint``, and the names the glue needs of the files behind it |
| ``boxes.py`` | a rank's contiguous flat range of a tensor as rectangular boxes of its full shape |
| ``chunks.py`` | ``LocalChunks``: what a rank writes or reads of one tensor; ``BytesTarget`` |
| ``writer.py`` | ``ChunkSavePlanner`` and ``ChunkWriter`` (ordered, headed, fsynced files), the pinned ``StagingRing`` sync saves copy device tensors through, staging for async |
| ``files.py`` | a checkpoint's files opened once, relative to its directory, never through a link; allowed names |
| ``checksum.py`` | the checksum of every stored item (xxh3_64), computed as the writer writes |
| ``safe.py`` | reading without unpickling code: allow-list metadata, ``weights_only`` items, checked items, ``read_entries`` |
| ``store.py`` | the directory: manifest, what a path is (``classify``), completeness (``validate``) |
| ``atomic.py`` | temporary sibling (locked while its save lives), fsync, ``RENAME_EXCHANGE`` publish, crash recovery, fault points |
| ``agree.py`` | the checkpoint gloo group (``LOCAL`` without a process group); every rank raises the same ``CheckpointError`` (``lightning_zeroq.ranks.agree``) |
| ``codec.py`` | the trainer state as JSON (tensors bit for bit) |
| ``checkpointer.py`` | the save protocol (sync and async) and ``open_checkpoint`` |
| ``engine_io.py`` | a ``ZeroEngine``'s save and load (``save_engine``, ``load_engine``), through the engine's sharded view (``zero/state_dict.py``), the only part of ``zero/`` this package uses |
| ``convert.py`` | consolidation (what ``zeroq-convert`` runs): one file, tensor by tensor, no GPU, no process group |
| ``pretrained.py`` | pretrained weights (Hugging Face safetensors, a ``torch.save`` state dict, DCP) into a built engine, each rank reading only its own ranges; names, validation, progress |
| ``torch_file.py`` | a single-file torch checkpoint (``strategy="ddp"``'s) into the engine: safe load, model check, optimizer state |

What is the Trainer's or Fabric's own (Lightning's checkpoint dict, the weights-only file, Fabric's
entries filled in place) lives with them (``lightning_zeroq/lightning/checkpoint.py``,
``lightning_zeroq/fabric/checkpoint.py``). Nothing is imported
here, so importing one file does not import Lightning.
"""
