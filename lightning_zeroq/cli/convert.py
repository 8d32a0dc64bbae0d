"""``zeroq-convert CKPT OUT``: the command line of ``checkpoint.convert.consolidate`` (a sharded
checkpoint directory to one file, tensor by tensor, no GPU). Errors are one line in its own words;
Ctrl-C, SIGTERM and SIGHUP leave nothing at the output path."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from lightning_zeroq.checkpoint.agree import CheckpointError
from lightning_zeroq.checkpoint.convert import ConvertError, consolidate


def one_line(error: BaseException) -> str:
    """An error as one line: a one-process ``CheckpointError``'s rank lines joined, newlines folded."""
    text = str(error).strip() or type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(error, CheckpointError) and len(lines) > 1 and lines[0].endswith("rank(s):"):
        lines = [line.split(": ", 1)[1] if line.startswith("rank ") else line for line in lines[1:]]
    if not isinstance(error, (ConvertError, CheckpointError, OSError, ValueError, RuntimeError)):
        lines[0] = f"{type(error).__name__}: {lines[0]}"
    return "; ".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeroq-convert",
        description="Consolidate a lightning_zeroq (or any torch.distributed.checkpoint) checkpoint directory "
                    "into one file of full fp32 tensors by state_dict name, tensor by tensor, without a GPU.")
    parser.add_argument("checkpoint", type=Path, help="the checkpoint directory (what trainer.save_checkpoint "
                        "wrote; DeepSpeed's and FSDP's too)")
    parser.add_argument("out", type=Path, help="OUT.pt, OUT.pth or OUT.ckpt (a torch file) or OUT.safetensors: the "
                        "suffix decides the format, any other is refused")
    parser.add_argument("--optimizer", action="store_true", help="keep the optimizer state (with a torch file: a "
                        "Lightning checkpoint, trainer state included, that strategy='ddp' resumes; refused for a "
                        "checkpoint saved without it)")
    parser.add_argument("--lightning", action="store_true", help="write a Lightning checkpoint (state_dict and "
                        "trainer state) instead of a bare state_dict; a torch file only (with --optimizer: the same "
                        "file as --optimizer alone)")
    args = parser.parse_args(argv)

    def interrupted(signum: int, frame: Any) -> None:  # SIGTERM/SIGHUP end it as Ctrl-C does: nothing left
        raise KeyboardInterrupt(signal.Signals(signum).name)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGHUP)} if main_thread else {}
    try:
        out = consolidate(args.checkpoint, args.out, optimizer=args.optimizer,
                          lightning=args.lightning or (args.optimizer and args.out.suffix != ".safetensors"))
    except KeyboardInterrupt as stop:
        print(f"zeroq-convert: interrupted ({str(stop) or 'SIGINT'}); {args.out} was not written.", file=sys.stderr)
        return 130
    except Exception as error:  # one line, no traceback: the messages name the file and the fix
        print(f"zeroq-convert: error: {one_line(error)} ({args.out} was not written)", file=sys.stderr)
        return 1
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
