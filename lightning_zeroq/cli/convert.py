"""``zeroq-convert CKPT OUT``: the command line of ``checkpoint.convert.consolidate`` (a sharded
checkpoint directory to one file, tensor by tensor, no GPU; ``--adapters-only``: the trainable parameters
alone) and of ``checkpoint.hf_export.export_hf`` (``--hf``: a Hugging Face model directory, LoRA merged).
Errors are one line in its own words; Ctrl-C, SIGTERM and SIGHUP leave nothing at the output path."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from lightning_zeroq.checkpoint.agree import CheckpointError
from lightning_zeroq.checkpoint.convert import ConvertError, consolidate
from lightning_zeroq.checkpoint.hf_export import DEFAULT_MAX_SHARD_SIZE, DTYPES, LoraSettings, export_hf

HF_ONLY = ("peft_config", "lora_r", "lora_alpha", "use_rslora", "base", "max_shard_size", "dtype")
"""The flags that only ``--hf`` reads."""


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
        "into one file of full fp32 tensors by state_dict name, tensor by tensor, without a GPU.",
    )
    parser.add_argument(
        "checkpoint",
        type=Path,
        help="the checkpoint directory (what trainer.save_checkpoint wrote; DeepSpeed's and FSDP's too)",
    )
    parser.add_argument(
        "out",
        type=Path,
        help="OUT.pt, OUT.pth or OUT.ckpt (a torch file) or OUT.safetensors: the "
        "suffix decides the format, any other is refused; with --hf a new (or empty) directory",
    )
    parser.add_argument(
        "--optimizer",
        action="store_true",
        help="keep the optimizer state (with a torch file: a "
        "Lightning checkpoint, trainer state included, that strategy='ddp' resumes; refused for a "
        "checkpoint saved without it)",
    )
    parser.add_argument(
        "--lightning",
        action="store_true",
        help="write a Lightning checkpoint (state_dict and "
        "trainer state) instead of a bare state_dict; a torch file only (with --optimizer: the same "
        "file as --optimizer alone)",
    )
    parser.add_argument(
        "--adapters-only",
        action="store_true",
        help="the trainable parameters alone (those the "
        "optimizer's param groups hold: LoRA factors), fp32, as a bare state dict (.pt or .safetensors)",
    )
    hf = parser.add_argument_group("--hf: a Hugging Face model directory, for from_pretrained() without ZeroQ")
    hf.add_argument(
        "--hf",
        action="store_true",
        help="write OUT as a directory in save_pretrained's layout "
        "(model.safetensors, or model-0000i-of-0000N.safetensors and model.safetensors.index.json) with "
        "PEFT's names unwrapped and each LoRA module merged: W + (lora_alpha / r) * B @ A",
    )
    hf.add_argument(
        "--peft-config",
        type=Path,
        metavar="FILE",
        help="the adapter's adapter_config.json (or its "
        "directory): r, lora_alpha, use_rslora, fan_in_fan_out, rank_pattern, alpha_pattern",
    )
    hf.add_argument("--lora-r", type=int, metavar="R", help="LoRA rank (default: the config's, else the factors')")
    hf.add_argument("--lora-alpha", type=float, metavar="ALPHA", help="LoRA alpha (overrides the config's)")
    hf.add_argument("--use-rslora", action="store_true", default=None, help="scale by alpha / sqrt(r), not alpha / r")
    hf.add_argument(
        "--base",
        type=Path,
        metavar="DIR",
        help="the base model's Hugging Face directory: the weights "
        "the checkpoint lacks (saved with exclude_frozen_parameters=True) are read from it, and its "
        "config.json, generation and tokenizer files are copied",
    )
    hf.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help=f"largest shard, e.g. 5GB or 500MB (default {DEFAULT_MAX_SHARD_SIZE}, save_pretrained's)",
    )
    hf.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="cast every floating tensor (default: each keeps its stored dtype, a merged weight its base's)",
    )
    args = parser.parse_args(argv)
    given = [
        f"--{name.replace('_', '-')}" for name in HF_ONLY if getattr(args, name) not in (None, parser.get_default(name))
    ]
    if given and not args.hf:
        parser.error(f"{', '.join(given)} only apply to --hf")
    if args.hf and (args.optimizer or args.lightning or args.adapters_only):
        parser.error("--hf writes the merged weights alone: drop --optimizer, --lightning and --adapters-only")

    def interrupted(signum: int, frame: Any) -> None:  # SIGTERM/SIGHUP end it as Ctrl-C does: nothing left
        raise KeyboardInterrupt(signal.Signals(signum).name)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGHUP)} if main_thread else {}
    try:
        if args.hf:
            lora = LoraSettings.from_peft_config(args.peft_config) if args.peft_config else LoraSettings()
            lora = lora.replace(r=args.lora_r, lora_alpha=args.lora_alpha, use_rslora=args.use_rslora)
            out = export_hf(
                args.checkpoint,
                args.out,
                lora=lora,
                base=args.base,
                max_shard_size=args.max_shard_size,
                dtype=args.dtype,
                progress=lambda line: print(line, flush=True),
            )
        else:
            out = consolidate(
                args.checkpoint,
                args.out,
                optimizer=args.optimizer,
                lightning=args.lightning or (args.optimizer and args.out.suffix != ".safetensors"),
                adapters_only=args.adapters_only,
                note=lambda line: print(f"note: {line}", flush=True),
            )
    except KeyboardInterrupt as stop:
        print(f"zeroq-convert: interrupted ({str(stop) or 'SIGINT'}); {args.out} was not written.", file=sys.stderr)
        return 130
    except Exception as error:  # one line, no traceback: the messages name the file and the fix
        print(f"zeroq-convert: error: {one_line(error)} ({args.out} was not written)", file=sys.stderr)
        return 1
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if out.is_dir():
        files = sorted(p for p in out.iterdir() if p.is_file())
        print(f"wrote {out} ({len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB)")
        if not (out / "config.json").is_file():
            print(
                f"note: {out} has no config.json: copy the base model's (and its tokenizer files) into it, or pass "
                "--base DIR, before from_pretrained()."
            )
    else:
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
